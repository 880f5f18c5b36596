"""Copying a store between storages (`actstore cp`): what to copy and in which order
(copier.py), what SRC holds and which step publishes each object (listing.py), and the
object transfer: streamed puts, checksums, a bounded pool (transfer.py)."""

from actstore.copy.copier import MARKER, CopyResult, copy_store
from actstore.errors import CopyError, CopyVerifyError

__all__ = ["MARKER", "CopyError", "CopyResult", "CopyVerifyError", "copy_store"]
