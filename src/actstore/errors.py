"""The exception tree. Each class also subclasses the builtin a caller would expect."""

from __future__ import annotations

import os

__all__ = [
    "ActivaultFormatError",
    "ActstoreError",
    "AlignmentError",
    "AppendError",
    "CaptureError",
    "CaptureShardExistsError",
    "ConsumerDroppedError",
    "CopyError",
    "CopyVerifyError",
    "CorruptChunkError",
    "CorruptStoreError",
    "DataError",
    "DeviceError",
    "DictionaryLearningCacheError",
    "DiskFullError",
    "EmptyDatasetError",
    "EncoderError",
    "ExampleIndexError",
    "ExampleRemovedError",
    "ExportWriteError",
    "FeatureError",
    "FieldNotFoundError",
    "Float16OverflowError",
    "ForkedClientError",
    "FormatVersionError",
    "ImportSourceError",
    "ImportVerifyError",
    "KeyNotFound",
    "LayerNotFoundError",
    "LayerTypeError",
    "LeaseLostError",
    "LegacyExportExistsError",
    "LegacyFormatError",
    "ModelLoadError",
    "NoBlocksError",
    "NonFiniteError",
    "NotFinalizedError",
    "OutputBusyError",
    "OutputExistsError",
    "ReadOnlyCacheError",
    "SaelensDatasetError",
    "SaelensExportError",
    "SaelensFolderError",
    "SaevExistsError",
    "SaevExportError",
    "SaevFormatError",
    "SaevOptionError",
    "SegmentNotFoundError",
    "ShardBusyError",
    "ShardCompleteError",
    "ShardExistsError",
    "ShardRewrittenError",
    "SpoolError",
    "StatisticsError",
    "StorageAccessError",
    "StoreChangedError",
    "StoreMismatchError",
    "StoreNotFoundError",
    "TokenMaskError",
    "TokenizerNotFoundError",
    "UnknownLayerError",
    "UnreadableImageError",
    "UnsafePathError",
    "UnsafePickleError",
    "VerificationError",
]


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


class LayerTypeError(LayerNotFoundError, TypeError):
    """A layer given as something that is neither a layer number nor a name (a float, a bool)."""


class SegmentNotFoundError(ActstoreError, KeyError):
    """A segment name that the store does not hold."""


class FieldNotFoundError(ActstoreError, KeyError):
    """A per-sample field or text field name that the store does not hold."""


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

    @classmethod
    def of(cls, e: OSError, doing: str, then: str) -> DiskFullError:
        """The error for `e` met while `doing`, naming its file and what to do `then`."""
        where = f": {e.filename}" if e.filename else ""
        err = cls(f"out of disk space while {doing} ({os.strerror(e.errno)}{where}); {then}")
        err.errno = e.errno
        return err


class ExportWriteError(ActstoreError, OSError):
    """An export could not write or publish a file (permissions, a read-only file system,
    an I/O error); the message names the file and the fix."""


class LegacyFormatError(ActstoreError, ValueError):
    """A legacy pkl.gz directory does not match its format or its metadata.json."""


class UnsafePickleError(LegacyFormatError):
    """A legacy pickle asks for a global that the restricted unpickler does not admit."""


class LegacyExportExistsError(ActstoreError, FileExistsError):
    """The folder given to export-pkl holds a finished export or files an export did not write."""


class OutputExistsError(ActstoreError, FileExistsError):
    """A command's output exists and --overwrite (overwrite=True) was not given, or (views and
    exports) it exists and is not a folder that command wrote, which is never replaced."""


class DeviceError(ActstoreError, ValueError):
    """A device option that is not 'cpu', 'cuda' or 'cuda:N' among the visible CUDA devices
    (actstore.devices.parse_device names the value and the allowed ones)."""


class StorageAccessError(ActstoreError, OSError):
    """A store's location cannot be reached, read or written (missing bucket, credentials,
    permissions, an unreachable endpoint); the message names the URL and the cause."""


class KeyNotFound(StoreNotFoundError):
    """A storage key with no object behind it."""


class ReadOnlyCacheError(ActstoreError, PermissionError):
    """A write through a CachedStorage (a cache reads a finalized store, never writes it)."""


# ---- copying a store (actstore cp) -------------------------------------------------


class CopyError(ActstoreError, OSError):
    """Reading SRC or writing DST failed. What was copied stays; a rerun resumes."""


class CopyVerifyError(CorruptStoreError):
    """An object read back from DST differs from the bytes read from SRC."""


# ---- loaders -------------------------------------------------------------------------


class TokenMaskError(ActstoreError, KeyError):
    """token_mask names a per-token array that the store does not hold."""


class ShardRewrittenError(ActstoreError, RuntimeError):
    """A shard whose rows a follow stream took was rewritten or deleted under it: what it
    yielded is not the store's data (the message names the shard)."""


# ---- saev export and reading ---------------------------------------------------------


class SaevOptionError(ActstoreError, ValueError):
    """An export option (or the store's metadata it defaults to) does not fit the protocol."""


class SaevExistsError(ActstoreError, FileExistsError):
    """The target <HASH> directory exists but does not verify; pass overwrite=True to rebuild it."""


class SaevExportError(ActstoreError, RuntimeError):
    """An export's directory did not pass verify-saev before publication (nothing was published)."""


class SaevFormatError(CorruptStoreError):
    """A saev shard directory breaks a rule of its protocol."""


# ---- SAELens export ------------------------------------------------------------------


class SaelensExportError(ActstoreError, ValueError):
    """An export-saelens option does not fit the store, or OUT is taken."""


class StatisticsError(ActstoreError, ValueError):
    """A store's statistics cannot give what was asked: none kept, a (layer, segment) key
    they lack or that counted no vector, or a segment to name (actstore.read.normalize)."""


# ---- capture: each names what is wrong and how to fix it -----------------------------


class CaptureError(ActstoreError, ValueError):
    """A capture run cannot go on (bad model, layer, data or options)."""


class CaptureShardExistsError(ShardExistsError, CaptureError):
    """A capture run without resume (record(), its runner="ray", `actstore write`) would start
    a shard the store already holds: a ShardExistsError and, as before, a CaptureError. The
    message names the shard, its committed examples, resume and removing the store."""


class UnknownLayerError(CaptureError):
    """A layer number or module path the model does not have."""


class NoBlocksError(CaptureError):
    """The model has no recognised transformer blocks."""


class ModelLoadError(CaptureError):
    """The model could not be loaded (missing package, no such folder, hub unreachable)."""


class DataError(CaptureError):
    """The data source is missing, malformed or empty."""


class EmptyDatasetError(DataError):
    """The data source holds no examples."""


class UnreadableImageError(DataError):
    """An image file that cannot be decoded."""


class SaelensFolderError(CorruptStoreError):
    """An export-saelens folder does not match what its export recorded."""


class FeatureError(ActstoreError, ValueError):
    """A feature pass was asked for something the store or the options cannot give."""


class EncoderError(FeatureError):
    """A direction source (SAE checkpoint, directions matrix) is unreadable or does not fit."""


class TokenizerNotFoundError(FeatureError, FileNotFoundError):
    """The store records no tokenizer that can be loaded from files (pass --tokenizer)."""


class OutputBusyError(ActstoreError, BlockingIOError):
    """Another process is writing the same view or export folder now."""


class ImportSourceError(ActstoreError, ValueError):
    """A source to import is damaged, or not in the format asked for; the message names the file."""


class ImportVerifyError(ActstoreError, RuntimeError):
    """The imported store does not hold what was read from the source."""


class SaelensDatasetError(ImportSourceError):
    """A SAELens cached-activations folder is damaged, of another hook, or not one."""


class DictionaryLearningCacheError(ImportSourceError):
    """A dictionary_learning activation cache folder is damaged or not one."""


class ActivaultFormatError(ImportSourceError):
    """An Activault hook folder, metadata.json or megabatch is damaged or not Activault's."""


class AlignmentError(ActstoreError, ValueError):
    """Aligned sources do not hold the same tokens (examples, lengths or token ids differ)."""


# ---- object stores across fork ----


class ForkedClientError(ActstoreError, RuntimeError):
    """An object store was used in a process forked after obstore had started (it would hang)."""


class StoreChangedError(ActstoreError, RuntimeError):
    """The store changed while a view, export or `show` read it (its manifest is not the one
    the read began with): nothing was published."""


# ---- the spool (a store with a byte budget: docs/capture.md) ----


class SpoolError(ActstoreError, ValueError):
    """A spool option or record is refused: a bad budget, a budget that differs from the
    store's, a block larger than the budget, a layout the spool cannot free."""


class ExampleRemovedError(ActstoreError, LookupError):
    """An example's activations were removed from a spool after every consumer read them."""


class ConsumerDroppedError(ActstoreError, RuntimeError):
    """A spool consumer was dropped (`actstore spool drop`); it must register under a new name."""
