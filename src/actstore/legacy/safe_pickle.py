"""A restricted unpickler for legacy shards: numpy arrays and plain containers, nothing else.

A pickle can call any importable callable while loading (`os.system`, `subprocess.Popen`,
`builtins.eval`). A legacy shard needs only dicts, lists, tuples, strings, numbers and
numpy arrays, so `find_class` admits exactly the globals numpy's array and scalar
reconstruction uses (numpy 1.x and 2.x spellings) and refuses every other one before it is
imported. Decompressed input is bounded (a gzip bomb cannot exhaust memory), and so are the
objects built and the references shared between records (a few KB whose records share one
array would otherwise expand to GBs): each limit is named in the error it raises.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
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
        raise UnsafePickleError(
            f"the pickle calls _codecs.encode with encoding {encoding!r}; only 'latin1' (bytes in protocol 2) is admitted"
        )
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


MAX_OBJECTS = 10_000_000  # pickle operations (objects built) of one shard, by default
MAX_SHARED_BYTES = (
    64  # an object this small (numbers, short strings, tuples of them) may be referenced any number of times
)
_MEMO_GETS = {pickle.GET[0], pickle.BINGET[0], pickle.LONG_BINGET[0], pickle.DUP[0]}
_SCAN = 1_000_000  # items scanned for an array inside one shared object


class RestrictedUnpickler(pickle._Unpickler):  # the Python unpickler: its operations can be counted
    """An unpickler whose find_class admits only ALLOWED_GLOBALS, which builds at most
    `max_objects` objects, and which bounds shared references (the pickle memo): an array,
    or an object holding one, is never referenced twice (records sharing one array would be
    copied once per reference: a few KB of pickle expanding to GBs), and any larger object
    at most `max_shares` more times (a legacy writer may share an example's text and
    metadata between its records in the layer lists: max_shares = layers - 1)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, where: str, max_objects: int = MAX_OBJECTS, max_shares: int = 0):
        super().__init__(file)
        self.where = where
        self.max_objects = max_objects
        self.max_shares = max_shares
        self.n_ops = 0
        self._shares: dict[int, int] = {}  # id of a larger shared object -> references beyond the first
        self._arrays: dict[int, bool] = {}  # id of a shared object -> whether it holds an array
        self.dispatch = {op: self._counted(op, fn) for op, fn in type(self).dispatch.items()}

    def _counted(self, op: int, fn: Any) -> Any:
        shared = op in _MEMO_GETS

        def step(unpickler: Any) -> None:
            self.n_ops += 1
            if self.n_ops > self.max_objects:
                raise LegacyFormatError(
                    f"{self.where}: the pickle builds more than {self.max_objects} objects (max_objects), more than "
                    "its metadata's records need (a damaged or hostile file?); pass a larger max_objects if the shard is genuine"
                )
            fn(unpickler)
            if shared:
                self._shared(self.stack[-1])

        return step

    def _shared(self, obj: Any) -> None:
        if _cost(obj, 0) <= MAX_SHARED_BYTES:
            return
        key = id(obj)  # the memo keeps every memoized object alive: ids stay unique
        holds = self._arrays.get(key)
        if holds is None:
            holds = self._arrays[key] = _holds_array(obj)
        n = self._shares.get(key, 0) + 1
        if holds or n > self.max_shares:
            what = (
                "an array"
                if isinstance(obj, np.ndarray)
                else f"a {type(obj).__name__}" + (" holding an array" if holds else "")
            )
            raise LegacyFormatError(
                f"{self.where}: the pickle refers to {what} more than once (a shared reference; at most {self.max_shares} "
                f"more times for larger objects, never for arrays): its records would be copied once per reference "
                "(a damaged or hostile file?); refusing it"
            )
        self._shares[key] = n

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
        raise UnsafePickleError(
            f"{self.where}: the pickle uses persistent ids ({str(pid)[:50]!r}); refusing to load it"
        )


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


def _cost(obj: Any, depth: int) -> int:
    """Bytes an object adds each time it is copied (beyond MAX_SHARED_BYTES: not shareable)."""
    if isinstance(obj, np.ndarray) or depth > 4:
        return MAX_SHARED_BYTES + 1
    if obj is None or isinstance(obj, (bool, int, float, complex, np.generic, np.dtype, type)):
        return 8
    if isinstance(obj, (str, bytes)):
        return len(obj)
    if isinstance(obj, tuple):
        return sum(_cost(x, depth + 1) for x in obj[: MAX_SHARED_BYTES + 1])
    return 8 if callable(obj) and not isinstance(obj, (list, dict, set, bytearray)) else MAX_SHARED_BYTES + 1


def _holds_array(obj: Any) -> bool:
    """Whether a container holds a numpy array (scanning at most _SCAN items; beyond: True)."""
    stack, seen, n = [obj], set(), 0
    while stack:
        x = stack.pop()
        n += 1
        if isinstance(x, np.ndarray) or n > _SCAN:
            return True
        if isinstance(x, (list, tuple, set, frozenset)) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(x)
        elif isinstance(x, dict) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(x.values())
    return False


def load_shard_bytes(
    data: bytes, *, compressed: bool, where: str, max_bytes: int, max_objects: int = MAX_OBJECTS, max_shares: int = 0
) -> Any:
    """Unpickle one legacy shard file's bytes with the restricted unpickler.

    Args:
        data: the file's bytes (gzip-compressed when `compressed`).
        compressed: the shard is .pkl.gz.
        where: the file name, for messages.
        max_bytes: refuse a pickle stream longer than this (decompressed).
        max_objects: refuse a pickle that builds more objects than this.
        max_shares: references allowed beyond the first to one larger object (never an array).
    """
    raw: Any = gzip.GzipFile(fileobj=io.BytesIO(data)) if compressed else io.BytesIO(data)
    stream = io.BufferedReader(_BoundedReader(raw, max_bytes, where), buffer_size=1 << 20)
    try:
        return RestrictedUnpickler(stream, where, max_objects, max_shares).load()
    except LegacyFormatError:
        raise
    except MemoryError:
        raise LegacyFormatError(
            f"{where}: the pickle asks for more memory than is available (a damaged or hostile file?)"
        ) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        gzip.BadGzipFile,
        zlib.error,
        OSError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        UnicodeDecodeError,
        RecursionError,
        struct.error,
    ) as e:
        raise LegacyFormatError(f"{where} is not a readable legacy shard pickle ({type(e).__name__}: {e})") from None
    except (SystemError, RuntimeError) as e:  # numpy refusing a forged dtype or array state from inside its C code
        raise LegacyFormatError(
            f"{where} is not a readable legacy shard pickle (numpy rejected its contents: {e})"
        ) from None


def restricted_loads(data: bytes, where: str = "<bytes>", max_bytes: int = 2**34) -> Any:
    """`pickle.loads` with the restricted unpickler (uncompressed bytes)."""
    return load_shard_bytes(data, compressed=False, where=where, max_bytes=max_bytes)
