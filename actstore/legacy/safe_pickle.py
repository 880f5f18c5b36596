"""A restricted unpickler for legacy shards: numpy arrays and plain containers, nothing else.

A pickle can call any importable callable while loading (`os.system`, `subprocess.Popen`,
`builtins.eval`). A legacy shard needs only dicts, lists, tuples, strings, numbers and
numpy arrays, so `find_class` admits exactly the globals numpy's array and scalar
reconstruction uses (numpy 1.x and 2.x spellings) and refuses every other one before it is
imported. Decompressed input is bounded, so a gzip bomb cannot exhaust memory.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from typing import Any

import numpy as np

from actstore.errors import LegacyFormatError, UnsafePickleError

try:
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # numpy < 2
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as protocol-2 pickles use it for bytes (latin-1 only)."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise UnsafePickleError(f"the pickle calls _codecs.encode with encoding {encoding!r}; only 'latin1' (bytes in protocol 2) is admitted")
    return text.encode("latin1")


# (module, name) -> the object returned. Both numpy 1.x (numpy.core) and 2.x (numpy._core) names.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}
for _mod in ("numpy.core", "numpy._core"):
    ALLOWED_GLOBALS[(f"{_mod}.multiarray", "_reconstruct")] = _multiarray._reconstruct
    ALLOWED_GLOBALS[(f"{_mod}.multiarray", "scalar")] = _multiarray.scalar
    ALLOWED_GLOBALS[(f"{_mod}.numeric", "_frombuffer")] = _numeric._frombuffer


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose find_class admits only ALLOWED_GLOBALS."""

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise UnsafePickleError(
                f"{self.where}: the pickle asks for {module}.{name}, which a legacy shard never needs "
                "(it holds only dicts, lists, strings, numbers and numpy arrays); refusing to load it. "
                "The file may be malicious: do not open it with pickle.load"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.where}: the pickle uses persistent ids ({str(pid)[:50]!r}); refusing to load it")


class _BoundedReader(io.RawIOBase):
    """A read-only stream over `raw` that fails once more than `limit` bytes were read."""

    def __init__(self, raw: Any, limit: int, where: str):
        self.raw = raw
        self.left = limit
        self.limit = limit
        self.where = where

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b)
        n = self.raw.readinto(view[: min(len(view), self.left + 1)])
        self.left -= n
        if self.left < 0:
            raise LegacyFormatError(
                f"{self.where} decompresses to more than {self.limit} bytes, more than its metadata allows "
                "(a damaged or hostile file?); pass a larger max_shard_bytes if the shard is genuine"
            )
        return n


def load_shard_bytes(data: bytes, *, compressed: bool, where: str, max_bytes: int) -> Any:
    """Unpickle one legacy shard file's bytes with the restricted unpickler.

    Args:
        data: the file's bytes (gzip-compressed when `compressed`).
        compressed: the shard is .pkl.gz.
        where: the file name, for messages.
        max_bytes: refuse a pickle stream longer than this (decompressed).
    """
    raw: Any = gzip.GzipFile(fileobj=io.BytesIO(data)) if compressed else io.BytesIO(data)
    stream = io.BufferedReader(_BoundedReader(raw, max_bytes, where), buffer_size=1 << 20)
    try:
        return RestrictedUnpickler(stream, where).load()
    except LegacyFormatError:
        raise
    except MemoryError:
        raise LegacyFormatError(f"{where}: the pickle asks for more memory than is available (a damaged or hostile file?)") from None
    except (pickle.UnpicklingError, EOFError, gzip.BadGzipFile, zlib.error, OSError, ValueError, TypeError, KeyError,
            IndexError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise LegacyFormatError(f"{where} is not a readable legacy shard pickle ({type(e).__name__}: {e})") from None
    except (SystemError, RuntimeError) as e:  # numpy refusing a forged dtype or array state from inside its C code
        raise LegacyFormatError(f"{where} is not a readable legacy shard pickle (numpy rejected its contents: {e})") from None


def restricted_loads(data: bytes, where: str = "<bytes>", max_bytes: int = 2**34) -> Any:
    """`pickle.loads` with the restricted unpickler (uncompressed bytes)."""
    return load_shard_bytes(data, compressed=False, where=where, max_bytes=max_bytes)
