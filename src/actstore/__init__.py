"""actstore: an activation store for interpretability research (Zarr, fp16, fast random access)."""

from actstore._version import __version__  # noqa: E402
from actstore.capture.record import record  # noqa: E402  (imports torch only when called)
from actstore.errors import *  # noqa: E402,F401,F403

# actstore.open: an actstore store or a saev directory. Left out of __all__ so that
# `from actstore import *` does not shadow the builtin open.
from actstore.opener import open as open  # noqa: E402,A004  (a re-export)
from actstore.read.store import ActStore  # noqa: E402
from actstore.saev import export_saev, import_saev, verify_saev  # noqa: E402
from actstore.write import ShardWriter  # noqa: E402
from actstore.write.finalize import finalize  # noqa: E402

__all__ = ["ActStore", "ShardWriter", "export_saev", "finalize", "import_saev", "record", "verify_saev", "__version__"]
