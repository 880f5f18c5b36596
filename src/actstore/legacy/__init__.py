"""The legacy pkl.gz activation shard format (metadata.json + shard_NNNN.pkl.gz).

`import_pkl` reads it into an actstore store with a restricted unpickler (only numpy array
reconstruction is admitted) after checking the listed sha256 checksums; `export_pkl`
writes a store in that format for tools that still read it. The format is described in
shared/seeds/legacy-pkl-shard-format.md; docs/reliability.md lists what is refused.
"""

from actstore.legacy.exporter import ExportReport, export_pkl
from actstore.legacy.importer import ImportReport, import_pkl
from actstore.legacy.metadata import LegacyMetadata, LegacyShardInfo, parse_metadata
from actstore.legacy.safe_pickle import load_shard_bytes, restricted_loads

__all__ = [
    "ExportReport",
    "ImportReport",
    "LegacyMetadata",
    "LegacyShardInfo",
    "export_pkl",
    "import_pkl",
    "load_shard_bytes",
    "parse_metadata",
    "restricted_loads",
]
