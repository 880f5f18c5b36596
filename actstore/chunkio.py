"""Direct chunk-file I/O for uncompressed local Zarr arrays chunked (1, 1, T_chunk, D).

The Zarr specs define the bytes: an uncompressed chunk is its C-order elements, little
endian, always of full chunk size (edge chunks padded); a missing chunk is the fill value.
A v3 shard (sharding_indexed, index at the end) is the inner chunks followed by an index of
(offset, nbytes) little-endian uint64 pairs, one per inner chunk in C order, with
2**64-1 for an empty chunk, then (usually) a crc32c of the index. This module reads and
writes exactly those bytes, so zarr-python and actstore read each other's output.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import CorruptChunkError, UnsafePathError
from actstore.fsutil import tmp_name

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - crc32c is a declared dependency
    _crc32c = None

_EMPTY = np.uint64(2**64 - 1)
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # chunk files are never links: refuse one planted in a store


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c (Castagnoli) of a bytes-like object, continuing from `value`."""
    return _crc32c(data, value)


class ChunkLayout:
    """Geometry and file naming of one activation array stored as raw local chunk files.

    Args:
        array_dir: the array's folder.
        zarr_format: 2 or 3.
        separator: chunk key separator ('.' for flat v2 keys, '/' for nested).
        n_layers, n_tchunks, t_chunk, d_model, dtype: chunk grid and element type.
        shard_examples: examples per v3 shard file (None when unsharded).
        index_crc: whether a v3 shard's index is followed by its crc32c.
    """

    def __init__(
        self,
        array_dir: str | os.PathLike,
        *,
        zarr_format: int,
        separator: str,
        n_layers: int,
        n_tchunks: int,
        t_chunk: int,
        d_model: int,
        dtype: np.dtype,
        shard_examples: int | None = None,
        index_crc: bool = True,
    ):
        self.dir = str(array_dir)
        self.zarr_format = zarr_format
        self.sep = separator
        self.n_layers = n_layers
        self.n_tchunks = n_tchunks
        self.t_chunk = t_chunk
        self.d_model = d_model
        self.dtype = np.dtype(dtype)
        self.chunk_nbytes = t_chunk * d_model * self.dtype.itemsize
        self.shard_examples = shard_examples
        self.index_crc = index_crc
        self._prefix = self.dir + ("/c" + separator if zarr_format == 3 else "/")
        self._made_dirs: set[str] = set()
        self._index_cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_made_dirs"] = set()
        state["_index_cache"] = OrderedDict()
        return state

    # ---- naming -------------------------------------------------------------------
    def chunk_path(self, ex: int, layer_pos: int, tc: int) -> str:
        """Path of the chunk file (unsharded) holding (ex, layer_pos, token chunk tc)."""
        s = self.sep
        return f"{self._prefix}{ex}{s}{layer_pos}{s}{tc}{s}0"

    def shard_path(self, ex: int) -> str:
        s = self.sep
        return f"{self._prefix}{ex // self.shard_examples}{s}0{s}0{s}0"

    # ---- reading ------------------------------------------------------------------
    def read_into(self, ex: int, layer_pos: int, out: np.ndarray) -> None:
        """Fill `out` (n_tchunks * t_chunk, d_model) with every token chunk of (ex, layer)."""
        mv = memoryview(out.reshape(-1).view(np.uint8))
        nb = self.chunk_nbytes
        for tc in range(self.n_tchunks):
            dest = mv[tc * nb : (tc + 1) * nb]
            if self.shard_examples is None:
                read_chunk_file(self.chunk_path(ex, layer_pos, tc), dest)
            else:
                self._read_sharded(ex, layer_pos, tc, dest)

    def read_cached(self, ex: int, layer_pos: int, out: np.ndarray) -> bool:
        """read_into when every byte is already in the page cache, without waiting for the
        disk (preadv2 RWF_NOWAIT); False (out partly written or not) when some byte is not,
        or where the system cannot tell: then read_into. Loaders copy cached chunks on
        one thread and hand only the others to their I/O threads."""
        global _nowait_ok
        if not _nowait_ok:
            return False
        mv = memoryview(out.reshape(-1).view(np.uint8))
        nb = self.chunk_nbytes
        for tc in range(self.n_tchunks):
            dest = mv[tc * nb : (tc + 1) * nb]
            if self.shard_examples is None:
                path, offset = self.chunk_path(ex, layer_pos, tc), 0
            else:
                path = self.shard_path(ex)
                index = self._index_cache.get(path)
                if index is None:
                    return False  # the first read of a shard file loads (and checks) its index
                offset, nbytes = index[ex % self.shard_examples, layer_pos, tc]
                if (offset == _EMPTY and nbytes == _EMPTY) or int(nbytes) != nb:
                    return False  # a missing or damaged chunk: read_into says which
                offset = int(offset)
            try:
                fd = os.open(path, os.O_RDONLY | _O_BINARY | _O_NOFOLLOW)
            except OSError:
                return False  # missing, a link, ...: read_into handles and explains it
            try:
                if self.shard_examples is None and os.fstat(fd).st_size != nb:
                    return False
                n = os.preadv(fd, [dest], offset, _RWF_NOWAIT)
            except BlockingIOError:
                return False
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    _nowait_ok = False  # this kernel or file system cannot tell: never again
                    return False
                raise
            finally:
                os.close(fd)
            if n != nb:
                return False  # partly cached (or cut short): read_into reads it whole
        return True

    def _read_sharded(self, ex: int, layer_pos: int, tc: int, dest: memoryview) -> None:
        path = self.shard_path(ex)
        index = self._shard_index(path)
        if index is None:
            dest[:] = b"\0" * len(dest)
            return
        offset, nbytes = index[ex % self.shard_examples, layer_pos, tc]
        if offset == _EMPTY and nbytes == _EMPTY:
            dest[:] = b"\0" * len(dest)
            return
        if int(nbytes) != len(dest):
            raise CorruptChunkError(
                f"shard file {path} holds a {int(nbytes)}-byte chunk for example {ex}, layer position "
                f"{layer_pos}, token chunk {tc}; an uncompressed chunk has {len(dest)} bytes"
            )
        fd = os.open(path, os.O_RDONLY | _O_BINARY)
        try:
            n = os.preadv(fd, [dest], int(offset))
        finally:
            os.close(fd)
        if n != len(dest):
            raise CorruptChunkError(f"shard file {path} is truncated: chunk at byte {int(offset)} is cut short")

    def _shard_index(self, path: str) -> np.ndarray | None:
        index = self._index_cache.get(path)
        if index is not None:
            self._index_cache.move_to_end(path)
            return index
        n_inner = self.shard_examples * self.n_layers * self.n_tchunks
        index_nbytes = 16 * n_inner + (4 if self.index_crc else 0)
        try:
            fd = os.open(path, os.O_RDONLY | _O_BINARY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < index_nbytes:
                raise CorruptChunkError(f"shard file {path} has {size} bytes, less than its {index_nbytes}-byte index")
            raw = os.pread(fd, index_nbytes, size - index_nbytes)
        finally:
            os.close(fd)
        if self.index_crc:
            want = int.from_bytes(raw[-4:], "little")
            if crc32c(raw[:-4]) != want:
                raise CorruptChunkError(f"shard file {path} has a damaged index (crc32c mismatch)")
            raw = raw[:-4]
        index = np.frombuffer(raw, dtype="<u8").reshape(self.shard_examples, self.n_layers, self.n_tchunks, 2)
        ends = index[..., 0] + index[..., 1]
        used = index[..., 0] != _EMPTY
        if used.any() and int(ends[used].max()) > size - index_nbytes:
            raise CorruptChunkError(f"shard file {path} has an index that points past the end of its data")
        self._index_cache[path] = index
        if len(self._index_cache) > 64:
            self._index_cache.popitem(last=False)
        return index

    # ---- writing ------------------------------------------------------------------
    def write_example(self, ex: int, acts_ltd: np.ndarray, crc: int) -> int:
        """Write every chunk of one example; `acts_ltd` is (L, n_tchunks*t_chunk, D) C-order.

        Returns the crc32c of the written chunk bytes chained onto `crc`.
        """
        assert self.shard_examples is None
        mv = memoryview(acts_ltd.reshape(-1).view(np.uint8))
        nb = self.chunk_nbytes
        k = 0
        for lp in range(self.n_layers):
            for tc in range(self.n_tchunks):
                chunk = mv[k * nb : (k + 1) * nb]
                path = self.chunk_path(ex, lp, tc)
                if self.zarr_format == 3:
                    self._ensure_parent(path)
                write_file(path, chunk)
                crc = crc32c(chunk, crc)
                k += 1
        return crc

    def write_shards(self, first_ex: int, acts_eltd: np.ndarray, writeback: Writeback | None = None) -> None:
        """Write whole Zarr v3 shard files for examples first_ex.. (first_ex % S == 0).

        `acts_eltd` is (n, L, n_tchunks*t_chunk, D) C-order; every shard file but the
        last holds S examples, the last may hold fewer (its other index entries are
        empty) and is replaced whole once it fills. Inner chunks are laid out in C order
        of the shard's chunk grid, followed by the index and its crc32c (index_location
        "end"). Each file is written beside its name and renamed into place, so a shard
        file is always a whole one: the old version or the new. With `writeback`, each
        file's writeback is started on that thread instead of this one.
        """
        S = self.shard_examples
        assert S is not None and first_ex % S == 0 and self.zarr_format == 3
        n = acts_eltd.shape[0]
        per_ex = self.n_layers * self.n_tchunks
        nb = self.chunk_nbytes
        for start in range(0, n, S):
            part = np.ascontiguousarray(acts_eltd[start : start + S])
            k = part.shape[0] * per_ex
            index = np.full((S * per_ex, 2), _EMPTY, dtype="<u8")
            index[:k, 0] = np.arange(k, dtype=np.uint64) * np.uint64(nb)
            index[:k, 1] = nb
            raw = index.tobytes()
            if self.index_crc:
                raw += crc32c(raw).to_bytes(4, "little")
            path = self.shard_path(first_ex + start)
            self._ensure_parent(path)
            tmp = str(tmp_name(Path(path)))
            try:
                write_file(tmp, memoryview(part.reshape(-1).view(np.uint8)), memoryview(raw), writeback=writeback)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._index_cache.pop(path, None)

    def delete_example(self, ex: int) -> None:
        """Remove the chunk files of one example (used to drop an uncommitted block)."""
        for lp in range(self.n_layers):
            for tc in range(self.n_tchunks):
                try:
                    os.unlink(self.chunk_path(ex, lp, tc))
                except FileNotFoundError:
                    pass

    def _ensure_parent(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_nowait_ok = bool(_RWF_NOWAIT) and hasattr(os, "preadv") and os.environ.get("ACTSTORE_READ_NOWAIT", "1") != "0"


def read_chunk_file(path: str, dest: memoryview) -> bool:
    """Read one whole chunk file into `dest`; a missing file is the fill value (zeros).

    Returns True when the file existed. A file of any other size than `len(dest)` is
    damaged and raises CorruptChunkError: a reader never returns garbage.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_BINARY | _O_NOFOLLOW)
    except FileNotFoundError:
        dest[:] = b"\0" * len(dest)
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(
                f"chunk file {path} is a symbolic link; actstore never writes links, so the store was altered: "
                "refusing to follow it (run `actstore verify`)"
            ) from None
        raise
    try:
        extra = bytearray(1)
        n = os.readv(fd, [dest, extra])
        if n != len(dest):
            raise CorruptChunkError(
                f"chunk file {path} has {os.fstat(fd).st_size} bytes, expected {len(dest)}: "
                "the file is damaged (truncated or overwritten); run `actstore verify --deep`"
            )
    finally:
        os.close(fd)
    return True


def _load_sync_file_range():
    """libc's sync_file_range (Linux only), or None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


_sync_file_range = _load_sync_file_range() if os.environ.get("ACTSTORE_EAGER_WRITEBACK", "1") != "0" else None


def write_file(path: str, *parts: memoryview, writeback: Writeback | None = None) -> None:
    """Write `parts`, one after the other, as the whole content of `path` (created or truncated).

    On Linux the file's writeback is started at once (sync_file_range WRITE, which does not
    wait for the disk): the disk then works while the writer computes, instead of idling
    until a flush. Starting it is kernel work (block allocation, building the I/O) of about
    half the copy's; with `writeback` it runs on that thread, beside the next file's copy.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
    try:
        for view in parts:
            while view.nbytes:
                n = os.write(fd, view)
                view = view[n:]
        if _sync_file_range is not None:
            if writeback is not None:
                writeback.submit(os.dup(fd))
            else:
                _sync_file_range(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE
    finally:
        os.close(fd)


class Writeback:
    """A thread that starts the writeback of written files (sync_file_range WRITE).

    It only starts I/O: durability still comes from the writer's flush (syncfs) where it is
    asked for. A failure to start writeback is ignored: the kernel writes the pages later.
    """

    def __init__(self, depth: int = 8):
        self._q: queue.Queue = queue.Queue(depth)  # file descriptors owned by the thread
        self._thread = threading.Thread(target=self._run, name="actstore-writeback", daemon=True)
        self._thread.start()

    def submit(self, fd: int) -> None:
        """Start the writeback of file `fd`; the thread closes it (waits while `depth` are queued)."""
        self._q.put(fd)

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            fd = self._q.get()
            if fd is None:
                return
            try:
                _sync_file_range(fd, 0, 0, 2)  # write_file submits only where it exists
            finally:
                os.close(fd)


def layout_from_metadata(array_dir: str | os.PathLike, meta: dict[str, Any], n_layers: int, d_model: int) -> ChunkLayout | None:
    """A ChunkLayout when the array's Zarr metadata allows raw reads, else None (use zarr).

    Raw reads need: no compressor, no filters, C order, little-endian dtype, chunks
    (1, 1, T_chunk, D); for v3 a lone `bytes` codec, or `sharding_indexed` with index at
    the end whose inner codecs are a lone `bytes` codec.
    """
    array_dir = Path(array_dir)
    shape = meta.get("shape")
    if meta.get("zarr_format") == 2:
        dtype = np.dtype(meta["dtype"])
        if meta.get("compressor") is not None or meta.get("filters") or meta.get("order", "C") != "C":
            return None
        if dtype.byteorder == ">":
            return None
        chunks = meta["chunks"]
        sep = meta.get("dimension_separator") or "."
        shards = None
        index_crc = True
    elif meta.get("zarr_format") == 3:
        dtype = np.dtype(_v3_dtype(meta.get("data_type")) or "V0")
        if dtype.itemsize == 0:
            return None
        enc = meta.get("chunk_key_encoding", {})
        if enc.get("name") != "default":
            return None
        sep = enc.get("configuration", {}).get("separator", "/")
        chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codecs = meta.get("codecs", [])
        shards = None
        index_crc = True
        if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
            conf = codecs[0]["configuration"]
            if conf.get("index_location", "end") != "end" or not _is_plain_bytes(conf.get("codecs", [])):
                return None
            idx = [c.get("name") for c in conf.get("index_codecs", [])]
            if idx not in (["bytes"], ["bytes", "crc32c"]):
                return None
            index_crc = idx == ["bytes", "crc32c"]
            shards = chunks
            chunks = conf["chunk_shape"]
        elif not _is_plain_bytes(codecs):
            return None
    else:
        return None
    if len(chunks) != 4 or chunks[0] != 1 or chunks[1] != 1 or chunks[3] != d_model or len(shape) != 4:
        return None
    t_chunk = chunks[2]
    n_tchunks = -(-shape[2] // t_chunk)
    if shards is not None:
        if shards[1] != shape[1] or shards[2] != n_tchunks * t_chunk or shards[3] != d_model:
            return None
        shard_examples = shards[0]
    else:
        shard_examples = None
    return ChunkLayout(
        array_dir,
        zarr_format=meta["zarr_format"],
        separator=sep,
        n_layers=n_layers,
        n_tchunks=n_tchunks,
        t_chunk=t_chunk,
        d_model=d_model,
        dtype=dtype.newbyteorder("<"),
        shard_examples=shard_examples,
        index_crc=index_crc,
    )


def _is_plain_bytes(codecs: list) -> bool:
    return (
        len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    )


def _v3_dtype(name: Any) -> str | None:
    return {"float16": "<f2", "float32": "<f4", "uint16": "<u2", "bfloat16": "<u2"}.get(name) if isinstance(name, str) else None


def load_array_meta(array_dir: str | os.PathLike) -> dict[str, Any]:
    """The Zarr metadata document of an array folder (.zarray or zarr.json)."""
    p = Path(array_dir)
    for name in (".zarray", "zarr.json"):
        f = p / name
        if f.exists():
            return json.loads(f.read_text(encoding="utf-8"))
    raise FileNotFoundError(f"{p} holds no Zarr array metadata (.zarray or zarr.json)")


# ---- transitional: the new storage-based chunk I/O (actstore/chunkio_new content) ---------
from actstore._chunkio_new import ChunkIO, drop_chunks  # noqa: E402,F401
