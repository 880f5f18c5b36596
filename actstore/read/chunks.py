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


class MappedChunk(NamedTuple):
    """Where one token chunk lies in a FileRegion: `rows[row : row + t_chunk]`.

    slot is -1 for a chunk that is not stored (its rows are the region's zeros)."""

    slot: int
    offset: int
    nbytes: int
    row: int


def read_many(io: ChunkIO, items: Sequence[tuple[int, int, np.ndarray]]) -> None:
    """Fill each `out` (n_tchunks * t_chunk, D) with the chunks of its (ex, layer_pos).

    Chunk files are one object each (read one by one: the caller's threads give the
    concurrency); the chunks that lie in one Zarr shard file go to the storage together
    (`read_ranges_into`), in file order.
    """
    g = io.geo
    if g.shard_examples is None:
        for ex, lp, out in items:
            io.read_into(ex, lp, out)
        return
    nb = g.chunk_nbytes
    by_key: dict[str, list[tuple[int, memoryview]]] = {}
    for ex, lp, out in items:
        mv = memoryview(out.reshape(-1).view(np.uint8))
        for tc in range(g.n_tchunks):
            dest = mv[tc * nb : (tc + 1) * nb]
            offset = io.shard_chunk(ex, lp, tc)
            if offset is None:
                dest[:] = b"\0" * nb
            else:
                by_key.setdefault(g.shard_key(ex), []).append((offset, dest))
    for key, ranges in by_key.items():
        ranges.sort(key=lambda r: r[0])
        for (offset, dest), n in zip(ranges, io.storage.read_ranges_into(key, ranges)):
            if n != len(dest):
                raise CorruptChunkError(io.cut_short(key, offset))


def map_chunks(io: ChunkIO, region: FileRegion, ex: int, lp: int) -> list[MappedChunk] | None:
    """The region rows of every token chunk of (ex, lp), each file mapped and pinned
    (release the slots >= 0 with `region.unpin`). None when a chunk cannot be mapped (its
    offset is not a whole number of rows, or no slot is free): read the unit instead.
    `io.storage` must be a LocalStorage."""
    g = io.geo
    out: list[MappedChunk] = []
    try:
        for tc in range(g.n_tchunks):
            chunk = _map_chunk(io, region, ex, lp, tc)
            if chunk is None:
                region.unpin([c.slot for c in out if c.slot >= 0])
                return None
            out.append(chunk)
    except BaseException:
        region.unpin([c.slot for c in out if c.slot >= 0])
        raise
    return out


def _map_chunk(io: ChunkIO, region: FileRegion, ex: int, lp: int, tc: int) -> MappedChunk | None:
    g = io.geo
    nb = g.chunk_nbytes
    zeros = MappedChunk(-1, 0, nb, region.zero_row)
    if g.shard_examples is None:
        key, offset = g.chunk_key(ex, lp, tc), 0
    else:
        key, offset = g.shard_key(ex), io.shard_chunk(ex, lp, tc)
        if offset is None:
            return zeros
        if offset % region.row_bytes:
            return None  # not written by actstore or zarr-python's dense layout: the read path copes
    opened = region.open(io.storage, key)
    if opened is None:
        return zeros  # no file: the fill value (chunk files); a shard file's index said so already
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
