"""Raw chunk I/O of one activation array through a Storage, byte-compatible with zarr.

`ChunkIO` reads and writes the chunk bytes that actstore.layout.chunks describes: whole
chunk files (unsharded) or whole Zarr shard files (data, index, crc32c of the index).
zarr-python and actstore read each other's output (tests/test_zarr_compat.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from actstore.errors import CorruptChunkError
from actstore.layout.checksum import crc32c
from actstore.layout.chunks import EMPTY, ChunkGeometry
from actstore.storage import Storage, Writeback
from actstore.storage.mapping import MappedFile

__all__ = ["ChunkIO", "crc32c", "drop_chunks"]

INDEX_CACHE_BYTES = 16 * 2**20  # shard-file indexes kept per array (16 bytes per inner chunk each)
MAPPED_FILES = 64  # shard files kept mapped per array (address space only: the pages are the page cache's)


class ChunkIO:
    """Reads and writes the raw chunks of one array of one writer shard.

    Args:
        storage: the writer shard's storage (keys relative to the shard).
        geometry: the array's chunk geometry.
    """

    def __init__(self, storage: Storage, geometry: ChunkGeometry):
        self.storage = storage
        self.geo = geometry
        self._index_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._mapped: OrderedDict[str, tuple[MappedFile, int] | None] = (
            OrderedDict()
        )  # shard file -> (map, dense examples)

    def __getstate__(self) -> dict:
        return {"storage": self.storage, "geo": self.geo, "_index_cache": OrderedDict(), "_mapped": OrderedDict()}

    def where(self, key: str) -> str:
        return self.storage.where(key)

    def chunk_path(self, ex: int, layer_pos: int, tc: int) -> str:
        """Full path (or URL) of an unsharded chunk, for messages and tests."""
        return self.where(self.geo.chunk_key(ex, layer_pos, tc))

    @property
    def n_tchunks(self) -> int:
        return self.geo.n_tchunks

    # ---- reading ------------------------------------------------------------------
    def read_into(self, ex: int, layer_pos: int, out: np.ndarray) -> int:
        """Fill `out` ((k * t_chunk, d_model)) with the first k token chunks of (ex, layer):
        every chunk when it has n_tchunks * t_chunk rows (or more). Returns how many of them
        were absent (read as the fill value: the caller may check them against a checksum)."""
        g = self.geo
        mv = memoryview(out.reshape(-1).view(np.uint8))
        nb = g.chunk_nbytes
        missing = 0
        for tc in range(min(g.n_tchunks, out.shape[0] // g.t_chunk)):
            dest = mv[tc * nb : (tc + 1) * nb]
            if g.shard_examples is None:
                missing += self._read_chunk(g.chunk_key(ex, layer_pos, tc), dest)
            else:
                missing += self._read_sharded(ex, layer_pos, tc, dest)
        return missing

    def read_mapped(self, ex: int, layer_pos: int, out: np.ndarray) -> bool:
        """read_into as one copy from the mapped shard file, when the file is on a local
        disk, its checked index places the example's chunks densely in order (as actstore
        writes them) and every page they lie in is in the page cache; False (nothing read)
        otherwise: then read_into, which reads, or tells what is missing or damaged."""
        g = self.geo
        if g.shard_examples is None:
            return False
        key = g.shard_key(ex)
        got = self._mapped.get(key, False)
        if got is False:
            got = self._map(key)
        i = ex % g.shard_examples
        if got is None or i >= got[1]:
            return False
        per = g.n_tchunks * g.chunk_nbytes
        k = min(g.n_tchunks, out.shape[0] // g.t_chunk) * g.chunk_nbytes
        return got[0].copy_resident((i * g.n_layers + layer_pos) * per, out.reshape(-1).view(np.uint8)[:k])

    def _map(self, key: str) -> tuple[MappedFile, int] | None:
        """Map shard file `key` (its index read from the mapping and checked) and count its
        leading examples stored densely in order; kept (None: not mappable, read it)."""
        g = self.geo
        got = None
        f = self.storage.map_file(key)
        if f is None:
            return None  # not kept: a file restored, or a mapping another reader gives up, maps later
        if f.size >= g.index_nbytes:
            index = self._keep_index(key, f.bytes[f.size - g.index_nbytes :].tobytes(), f.size)
            per_ex, nb = g.n_layers * g.n_tchunks, g.chunk_nbytes
            flat = index.reshape(-1, 2)
            used = flat[:, 0] != EMPTY
            n = (len(used) if used.all() else int(np.argmin(used))) // per_ex  # examples with every chunk stored
            k = n * per_ex
            if (
                n
                and np.array_equal(flat[:k, 0], np.arange(k, dtype=np.uint64) * np.uint64(nb))
                and (flat[:k, 1] == nb).all()
            ):
                got = (f, n)
        self._mapped[key] = got
        while len(self._mapped) > MAPPED_FILES:
            self._mapped.popitem(last=False)
        return got

    def _read_chunk(self, key: str, dest: memoryview) -> bool:
        """One whole chunk object; a missing one is the fill value (True); another size is damage."""
        size = self.storage.read_object_into(key, dest)
        if size is None:
            dest[:] = b"\0" * len(dest)
            return True
        if size != len(dest):
            raise CorruptChunkError(self.wrong_size(key, size))
        return False

    def read_cached(self, ex: int, layer_pos: int, out: np.ndarray) -> bool:
        """read_into when every byte is at hand without waiting (page cache); False (out
        partly written or not) otherwise: then read_into. Loaders copy cached chunks on
        one thread and hand only the others to their I/O threads."""
        g = self.geo
        mv = memoryview(out.reshape(-1).view(np.uint8))
        nb = g.chunk_nbytes
        for tc in range(g.n_tchunks):
            dest = mv[tc * nb : (tc + 1) * nb]
            if g.shard_examples is None:
                key, offset = g.chunk_key(ex, layer_pos, tc), 0
            else:
                key = g.shard_key(ex)
                index = self._index_cache.get(key)
                if index is None:
                    return False  # the first read of a shard file loads (and checks) its index
                offset, nbytes = index[ex % g.shard_examples, layer_pos, tc]
                if (offset == EMPTY and nbytes == EMPTY) or int(nbytes) != nb:
                    return False  # a missing or damaged chunk: read_into says which
                offset = int(offset)
            if not self.storage.read_cached(key, dest, offset):
                return False
        return True

    def _read_sharded(self, ex: int, layer_pos: int, tc: int, dest: memoryview) -> bool:
        """One chunk of a shard file; an absent one is the fill value (True)."""
        key = self.geo.shard_key(ex)
        offset = self.shard_chunk(ex, layer_pos, tc)
        if offset is None:
            dest[:] = b"\0" * len(dest)
            return True
        if self.storage.read_into(key, dest, offset) != len(dest):
            raise CorruptChunkError(self.cut_short(key, offset))
        return False

    def shard_chunk(self, ex: int, layer_pos: int, tc: int) -> int | None:
        """Byte offset of (ex, layer_pos, tc) in its shard file (`geo.shard_key(ex)`), or None
        when the chunk is not stored (the file or its index entry is missing: fill value);
        an index entry of another size than an uncompressed chunk raises."""
        key = self.geo.shard_key(ex)
        index = self.shard_index(key)
        if index is None:
            return None
        offset, nbytes = index[ex % self.geo.shard_examples, layer_pos, tc]
        if offset == EMPTY and nbytes == EMPTY:
            return None
        nb = self.geo.chunk_nbytes
        if int(nbytes) != nb:
            raise CorruptChunkError(
                f"shard file {self.where(key)} holds a {int(nbytes)}-byte chunk for example {ex}, layer position "
                f"{layer_pos}, token chunk {tc}; an uncompressed chunk has {nb} bytes"
            )
        return int(offset)

    def cut_short(self, key: str, offset: int) -> str:
        return f"shard file {self.where(key)} is truncated: chunk at byte {offset} is cut short"

    def wrong_size(self, key: str, size: int) -> str:
        return (
            f"chunk file {self.where(key)} has {size} bytes, expected {self.geo.chunk_nbytes}: "
            "the file is damaged (truncated or overwritten); run `actstore verify --deep`"
        )

    def shard_index(self, key: str) -> np.ndarray | None:
        """The (checked) index of a shard file, or None when the file does not exist."""
        index = self._index_cache.get(key)
        if index is not None:
            self._index_cache.move_to_end(key)
            return index
        size = self.storage.size(key)  # an object store's failure: StorageAccessError naming the file
        if size is None:
            if self.storage.kind(key) is not None:
                self.storage.get(key)  # raises, naming what stands there instead of a file
            return None
        n = self._index_fits(key, size)
        raw = self.storage.get_range(key, size - n, n)
        return self._keep_index(key, raw, size)

    def index_of_object(self, key: str, data: memoryview) -> np.ndarray:
        """The (checked) index of shard file `key` from the whole file's bytes, kept: for
        readers that fetch a whole file at once (one request instead of two)."""
        n = self._index_fits(key, len(data))
        return self._keep_index(key, bytes(data[len(data) - n :]), len(data))

    def _index_fits(self, key: str, size: int) -> int:
        n = self.geo.index_nbytes
        if size < n:
            raise CorruptChunkError(f"shard file {self.where(key)} has {size} bytes, less than its {n}-byte index")
        return n

    def _keep_index(self, key: str, raw: bytes, size: int) -> np.ndarray:
        index = self.geo.decode_index(raw, size - self.geo.index_nbytes, self.where(key))
        self._index_cache[key] = index
        while len(self._index_cache) > max(64, INDEX_CACHE_BYTES // index.nbytes):  # every index of an array: one size
            self._index_cache.popitem(last=False)
        return index

    # ---- writing ------------------------------------------------------------------
    def write_example(self, ex: int, acts_ltd: Any) -> None:
        """Write every chunk of one example; `acts_ltd` is (L, n_tchunks*t_chunk, D) (or a
        list of its L layers), each layer's rows C-contiguous.

        Chunk files are written in place (not atomically): nobody reads them before the
        commit that names their example. (The writer checksums the rows itself, once.)
        """
        g = self.geo
        assert g.shard_examples is None
        nb = g.chunk_nbytes
        for lp in range(g.n_layers):
            mv = memoryview(np.ascontiguousarray(acts_ltd[lp]).reshape(-1).view(np.uint8))
            for tc in range(g.n_tchunks):
                self.storage.put(g.chunk_key(ex, lp, tc), mv[tc * nb : (tc + 1) * nb], atomic=False)

    def write_shard_parts(
        self, first_ex: int, n: int, parts: list[Any], writeback: Writeback | None = None, durable: bool = False
    ) -> None:
        """Write the Zarr v3 shard file of examples first_ex..first_ex+n-1 (first_ex % S == 0)
        from its data in pieces: C-order arrays whose bytes, in order, are its n examples'
        (layer, token, d_model) rows (a staging buffer's slab, or rows where they lie). The
        file is put atomically, the pieces written as they are (no copy)."""
        g = self.geo
        assert g.shard_examples is not None and first_ex % g.shard_examples == 0 and g.zarr_format == 3
        views = [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts]
        assert sum(v.nbytes for v in views) == n * g.n_layers * g.n_tchunks * g.chunk_nbytes
        key = g.shard_key(first_ex)
        self.storage.put(key, *views, g.encode_index(n), writeback=writeback, durable=durable)
        self._index_cache.pop(key, None)
        self._mapped.pop(key, None)


def drop_chunks(storage: Storage, array: str, first: int) -> None:
    """Delete the chunk (or Zarr shard) objects of `array` whose first grid coordinate is
    >= `first`, whatever the array's codecs: the uncommitted tail of a crashed writer."""
    from actstore.catalog import array_meta
    from actstore.layout.chunks import key_scheme

    fmt, sep = key_scheme(array_meta(storage, array))
    head = "c" + sep if fmt == 3 else ""
    for e in list(storage.list(array)):
        rel = e.key[len(array) + 1 :]
        if e.kind == "dir" or not rel.startswith(head):  # an empty folder a failed write left: no object
            continue
        first_part = rel[len(head) :].split(sep, 1)[0]
        if first_part.isdigit() and int(first_part) >= first:
            storage.delete(e.key)
