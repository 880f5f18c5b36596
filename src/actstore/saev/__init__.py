"""saev shards: export (protocol 2.0 and 2.1), verification, reading, import and run layout.

See docs/export.md. The protocol constants live in actstore.layout.saevspec.
"""

from actstore.errors import SaevExistsError, SaevExportError, SaevFormatError, SaevOptionError
from actstore.read.saevstore import SaevStore, is_saev_dir
from actstore.saev.export import SaevExport, default_dump_to, export_saev
from actstore.saev.importer import import_saev
from actstore.saev.plan import SaevExportOptions
from actstore.saev.runs import link_run
from actstore.saev.verify import SaevReport, verify_saev

__all__ = [
    "SaevExistsError",
    "SaevExport",
    "SaevExportError",
    "SaevExportOptions",
    "SaevFormatError",
    "SaevOptionError",
    "SaevReport",
    "SaevStore",
    "default_dump_to",
    "export_saev",
    "import_saev",
    "is_saev_dir",
    "link_run",
    "verify_saev",
]
