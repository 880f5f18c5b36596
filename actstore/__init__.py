"""actstore: an activation store for interpretability research (Zarr, fp16, fast random access)."""

__version__ = "0.1.0"

from actstore.errors import *  # noqa: E402,F401,F403
from actstore.manifest import finalize  # noqa: E402
from actstore.store import ActStore  # noqa: E402
from actstore.writer import ShardWriter  # noqa: E402
from actstore.capture.record import record  # noqa: E402  (imports torch only when called)
from actstore.saev import export_saev, import_saev, verify_saev  # noqa: E402

__all__ = ["ActStore", "ShardWriter", "export_saev", "finalize", "import_saev", "record", "verify_saev", "__version__"]
