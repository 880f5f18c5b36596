"""Many (example, layer) units of one array at once, for the loaders: batched reads that
send the ranges of one object together (an object store fetches adjacent ranges of a
Zarr shard file as one request), and the one-copy path that maps local files into a
FileRegion and hands out the rows where each chunk lies.

Both keep ChunkIO's rules: a missing chunk reads as zeros (the fill value), a chunk of
the wrong size or cut short is a CorruptChunkError naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from actstore.chunkio import ChunkIO
from actstore.errors import CorruptChunkError
from actstore.storage.mapping import FileRegion

WHOLE_FILE_BYTES = 128 * 2**20  # the largest shard file read whole when most of it is wanted


class MappedChunk(NamedTuple):
    """Where one token chunk lies in a FileRegion: `rows[row : row + t_chunk]`."""

    slot: int
    offset: int
    nbytes: int
    row: int


def read_many(io: ChunkIO, items: Sequence[tuple[int, int, np.ndarray]]) -> list[tuple[int, int, np.ndarray]]:
    """Fill each `out` (n_tchunks * t_chunk, D) with the chunks of its (ex, layer_pos);
    returns the items of which a chunk was absent (read as zeros: the caller checks them
    against the writer's checksums).

    Chunk files are one object each (read one by one: the caller's threads give the
    concurrency); the chunks that lie in one Zarr shard file go to the storage together
    (`read_ranges_into`), in file order.
    """
    g = io.geo
    if g.shard_examples is None:
        return [item for item in items if io.read_into(*item)]
    absent: list[tuple[int, int, np.ndarray]] = []
    by_file: dict[str, list[tuple[int, int, np.ndarray]]] = {}
    for item in items:
        by_file.setdefault(g.shard_key(item[0]), []).append(item)
    for key, group in by_file.items():
        whole = _whole_file(io, key, group)
        ranges = []
        for ex, lp, out in group:
            mv = memoryview(out.reshape(-1).view(np.uint8))
            for tc in range(g.n_tchunks):
                dest = mv[tc * g.chunk_nbytes : (tc + 1) * g.chunk_nbytes]
                offset = io.shard_chunk(ex, lp, tc)
                if offset is None:
                    dest[:] = b"\0" * len(dest)
                    if not absent or absent[-1][2] is not out:
                        absent.append((ex, lp, out))
                elif whole is not None:
                    got = whole[offset : offset + len(dest)]
                    if len(got) != len(dest):
                        raise CorruptChunkError(io.cut_short(key, offset))
                    dest[:] = got  # copy: the file's bytes into the caller's buffer
                else:
                    ranges.append((offset, dest))
        ranges.sort(key=lambda r: r[0])
        for (offset, dest), n in zip(ranges, io.storage.read_ranges_into(key, ranges)):
            if n != len(dest):
                raise CorruptChunkError(io.cut_short(key, offset))
    return absent


def _whole_file(io: ChunkIO, key: str, group: list[tuple[int, int, np.ndarray]]) -> memoryview | None:
    """On an object store, a shard file of at most WHOLE_FILE_BYTES whose wanted chunks span
    most of it (with the gaps the storage fetches anyway: `coalesce_bytes`): the whole file
    in one request, its index read from its tail, rather than one request for the index
    and others for the ranges. None otherwise (or when there is no such file)."""
    g = io.geo
    per_file = g.shard_examples * g.n_layers * g.n_tchunks
    size = per_file * g.chunk_nbytes + g.index_nbytes
    if size > WHOLE_FILE_BYTES or not io.storage.coalesce_bytes or io.storage.keeps_ranges:
        return None  # a local disk reads ranges as cheaply, straight into place; a cache keeps ranges
    # Where the chunks lie in a file written densely in index order (actstore, zarr-python).
    pos = np.unique(
        [
            ((ex % g.shard_examples) * g.n_layers + lp) * g.n_tchunks + tc
            for ex, lp, _ in group
            for tc in range(g.n_tchunks)
        ]
    )
    gap = 1 + io.storage.coalesce_bytes // g.chunk_nbytes  # chunks apart that one request still covers
    covered = len(pos) + int(np.where(np.diff(pos) <= gap, np.diff(pos) - 1, 0).sum())
    if 2 * covered < per_file:
        return None
    try:
        data = io.storage.read_object(key, max_bytes=size)
    except ValueError:
        return None  # not the size actstore writes: the usual path explains
    if data is None or len(data) != size:
        return None  # missing (the fill value), or not the size actstore writes
    io.index_of_object(key, data)
    return data[: size - g.index_nbytes]


def map_chunks(io: ChunkIO, region: FileRegion, ex: int, lp: int) -> list[MappedChunk] | None:
    """The region rows of every token chunk of (ex, lp), each file mapped and pinned
    (release their slots with `region.unpin`). None when a chunk cannot be mapped (absent,
    its offset not a whole number of rows, or no slot free): read the unit instead (the read
    path checks an absent chunk against the writer's checksum).
    `io.storage` must be a LocalStorage."""
    g = io.geo
    out: list[MappedChunk] = []
    try:
        for tc in range(g.n_tchunks):
            chunk = _map_chunk(io, region, ex, lp, tc)
            if chunk is None:
                region.unpin([c.slot for c in out])
                return None
            out.append(chunk)
    except BaseException:
        region.unpin([c.slot for c in out])
        raise
    return out


def _map_chunk(io: ChunkIO, region: FileRegion, ex: int, lp: int, tc: int) -> MappedChunk | None:
    g = io.geo
    nb = g.chunk_nbytes
    if g.shard_examples is None:
        key, offset = g.chunk_key(ex, lp, tc), 0
    else:
        key, offset = g.shard_key(ex), io.shard_chunk(ex, lp, tc)
        if offset is None:
            return None  # not stored: the read path checks it against the writer's checksum
        if offset % region.row_bytes:
            return None  # not written by actstore or zarr-python's dense layout: the read path copes
    opened = region.open(io.storage, key)
    if opened is None:
        return None  # no file: the read path checks the fill value against the writer's checksum
    slot, size = opened
    if g.shard_examples is None and size != nb:
        if slot >= 0:
            region.unpin([slot])
        raise CorruptChunkError(io.wrong_size(key, size))
    if offset + nb > size:
        if slot >= 0:
            region.unpin([slot])
        raise CorruptChunkError(io.cut_short(key, offset))
    if slot < 0:
        return None  # larger than a slot, or every slot pinned
    return MappedChunk(slot, offset, nb, region.first_row(slot, offset))
