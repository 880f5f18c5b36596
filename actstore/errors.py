"""The exception tree. Each class also subclasses the builtin a caller would expect."""

from __future__ import annotations


class ActstoreError(Exception):
    """Base of every error actstore raises on purpose."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class StoreNotFoundError(ActstoreError, FileNotFoundError):
    """The path holds no actstore store (or no such shard)."""


class NotFinalizedError(ActstoreError, RuntimeError):
    """The store has writer shards but no manifest yet."""


class StoreMismatchError(ActstoreError, ValueError):
    """The path already holds a store whose configuration differs from the one asked for."""


class ShardExistsError(ActstoreError, FileExistsError):
    """A writer shard exists and neither resume nor overwrite was asked for."""


class ShardCompleteError(ActstoreError, RuntimeError):
    """A writer asked to resume a shard that was already closed."""


class ShardBusyError(ActstoreError, RuntimeError):
    """Another live writer holds the shard's lease; the message names it (host, pid, start)."""


class LeaseLostError(ActstoreError, RuntimeError):
    """A writer's lease on its shard was taken over (it was not renewed in time); it commits nothing more."""


class AppendError(ActstoreError, ValueError):
    """A batch passed to ShardWriter.append does not fit the store."""


class NonFiniteError(AppendError):
    """A batch holds NaN or infinity and the writer was told to refuse them."""


class Float16OverflowError(AppendError):
    """Finite input values lie beyond float16's range (|x| > 65504)."""


class ExampleIndexError(ActstoreError, IndexError):
    """An example index outside the store."""


class LayerNotFoundError(ActstoreError, KeyError):
    """A layer number that the store does not hold."""


class SegmentNotFoundError(ActstoreError, KeyError):
    """A segment name that the store does not hold."""


class FormatVersionError(ActstoreError, ValueError):
    """A store written by a newer (or unknown) version of the format."""


class CorruptStoreError(ActstoreError, ValueError):
    """A file of the store does not match what its metadata promises."""


class CorruptChunkError(CorruptStoreError):
    """A chunk file has the wrong size or checksum."""


class UnsafePathError(CorruptStoreError):
    """Metadata names a path outside the store."""


class VerificationError(CorruptStoreError):
    """`verify_store(..., raise_on_error=True)` (or ActStore(path, verify=...)) found damage.

    The full report is in the `report` attribute (an actstore.verify.VerifyReport).
    """

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class DiskFullError(ActstoreError, OSError):
    """A write failed for lack of space (ENOSPC, EDQUOT) or a file-size limit (EFBIG)."""


class ExportWriteError(ActstoreError, OSError):
    """An export could not write or publish a file (permissions, a read-only file system,
    an I/O error); the message names the file and the fix."""


class LegacyFormatError(ActstoreError, ValueError):
    """A legacy pkl.gz directory does not match its format or its metadata.json."""


class UnsafePickleError(LegacyFormatError):
    """A legacy pickle asks for a global that the restricted unpickler does not admit."""


class LegacyExportExistsError(ActstoreError, FileExistsError):
    """The folder given to export-pkl holds a finished export or files an export did not write."""


class StorageAccessError(ActstoreError, OSError):
    """A store's location cannot be reached, read or written (missing bucket, credentials,
    permissions, an unreachable endpoint); the message names the URL and the cause."""
