"""What a writer committed stays as committed, or the writer says it is gone.

Two guards of ShardWriter's commit path (actstore.write.writer), for storage that loses
objects (an object store restarted with its bucket kept, a folder cleaned by hand):

- `PerSampleRows` writes the per-sample arrays (lengths, labels, keys, fields) without
  reading back what they hold. zarr-python writes rows [n0, n1) by reading the chunk
  holding row n0, merging, and writing it back, and a missing chunk reads as the fill
  value: rows this writer had committed came back as zeros (examples of length 0),
  silently. Here the writer keeps the rows of each array's last, partly filled chunk and
  writes from that chunk's first row to the array's end, which zarr writes without reading
  (every in-bounds row of each chunk is given). A resumed writer reads that chunk once
  (`first_rows`), and a missing chunk of an array that promises every chunk is damage,
  named.
- `missing_objects` lists the shard once and returns the objects of its committed examples
  (`committed_keys`: activation chunk or Zarr shard files, per-sample chunks; and the
  metadata documents and record files) that are not there. The writer runs it before the commit record that completes a
  shard committed in several commits, so a shard that lost an object never completes
  (finalize refuses it, `actstore write` fails); a shard written in one commit put every
  object in that commit, and costs no listing.
- `check_per_sample` is finalize's: the per-sample rows of each block it publishes against
  the crc32c the block records (per-sample chunks only are read, never activations).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from actstore import catalog
from actstore.errors import CorruptStoreError
from actstore.layout import keys
from actstore.layout.arraymeta import array_problems, chunk_rows
from actstore.layout.arrays import ArraySpec, every_chunk, shard_arrays
from actstore.layout.checksum import per_sample_crc32c
from actstore.layout.chunks import ChunkGeometry, array_meta_key, key_scheme, row_chunk_key
from actstore.layout.config import StoreConfig
from actstore.layout.records import Block
from actstore.layout.spool import Ranges, contains
from actstore.storage import KeyNotFound, Storage

MAX_NAMED = 5  # missing objects named in the error, one by one


class PerSampleRows:
    """Rows of each per-sample array's last chunk, kept across commits (keys relative to the shard)."""

    def __init__(self, sh: Storage, read_meta: Any):
        self.sh = sh
        self.read_meta = read_meta  # key -> bytes of a metadata document (the writer's buffered view)
        self.tail: dict[str, tuple[int, np.ndarray]] = {}  # array -> (first row of its chunk, rows from there)

    def write(self, arr: Any, name: str, n0: int, vals: np.ndarray) -> None:
        """Write rows [n0, n0 + len(vals)) of per-sample array `arr` (zarr, already resized
        to end there) from the first row of the chunk holding row n0."""
        rows = int(arr.chunks[0])
        c0 = n0 // rows * rows
        head = self.first_rows(arr, name, c0, n0)
        data = np.concatenate([head, vals]) if len(head) else np.asarray(vals)
        arr[c0 : n0 + len(vals)] = data
        n1 = n0 + len(vals)
        c1 = n1 // rows * rows
        self.tail[name] = (c1, np.array(data[c1 - c0 :]))

    def first_rows(self, arr: Any, name: str, c0: int, n0: int) -> np.ndarray:
        """Rows [c0, n0) of `arr`: kept from the last commit, or read once from its chunk."""
        if n0 == c0:
            return np.zeros((0, *arr.shape[1:]), arr.dtype)
        kept = self.tail.get(name)
        if kept is not None and kept[0] == c0 and len(kept[1]) == n0 - c0:
            return kept[1]
        import json

        fmt, sep = key_scheme(json.loads(self.read_meta(array_meta_key(name, arr.metadata.zarr_format))))
        key = row_chunk_key(name, fmt, sep, len(arr.shape), c0 // int(arr.chunks[0]))
        dtype = np.dtype(arr.dtype).newbyteorder("<") if np.dtype(arr.dtype).itemsize > 1 else np.dtype(arr.dtype)
        row_shape = tuple(int(x) for x in arr.chunks[1:])
        nbytes = int(arr.chunks[0]) * int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        size = self.sh.size(key)
        if size is None:
            if not every_chunk(dict(arr.attrs)):
                return np.zeros((n0 - c0, *row_shape), arr.dtype)  # an older writer omitted chunks of zeros
            raise CorruptStoreError(
                f"{self.sh.where(key)} is missing: it holds per-sample values of examples {c0}..{n0 - 1}, "
                "committed before; the storage lost it. This shard cannot be continued: write it again "
                "(overwrite=True, or `actstore write` without --resume into a new store)"
            )
        if size != nbytes:
            raise CorruptStoreError(f"{self.sh.where(key)} has {size} bytes; a chunk of {name} has {nbytes}")
        data = np.frombuffer(self.sh.get(key), dtype=dtype).reshape(int(arr.chunks[0]), *row_shape)
        return data[: n0 - c0].astype(arr.dtype)


def committed_keys(
    n: int,
    *,
    per_sample: Iterable[tuple[int, Callable[[int], str]]],
    activations: Iterable[ChunkGeometry],
    removed: Ranges = (),
) -> list[str]:
    """The objects examples [0, n) of a shard are stored in (keys relative to the shard).

    Args:
        n: committed examples.
        per_sample: per per-sample array, (rows per chunk, the key of chunk c).
        activations: the raw activation arrays' geometries (arrays written through
            zarr-python omit chunks of zeros: not listed).
    """
    out: list[str] = []
    for rows, key in per_sample:
        out += [key(c) for c in range(-(-n // rows))]
    for geo in activations:
        if geo.shard_examples is not None:
            out += [geo.shard_key(s * geo.shard_examples) for s in range(-(-n // geo.shard_examples))]
        else:
            kept = [ex for ex in range(n) if not contains(removed, ex)]
            out += [k for ex in kept for lp in range(geo.n_layers) for k in geo.chunk_keys_of(ex, lp)]
    return out


def missing_objects(sh: Storage, want: Iterable[str]) -> list[str]:
    """The keys of `want` that one listing of the shard does not show."""
    have = {e.key for e in sh.list("")}
    return [k for k in want if k not in have]


def refuse_missing(sh: Storage, missing: list[str], shard: int, n: int) -> None:
    """Raise the error that names the objects a writer committed and no longer finds."""
    if not missing:
        return
    named = ", ".join(keys.basename(k) if "/" not in k else k for k in missing[:MAX_NAMED])
    more = f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else ""
    raise CorruptStoreError(
        f"shard {shard} of {sh.url} lost {len(missing)} object(s) its writer committed ({named}{more}): the storage "
        f"dropped them after they were written. The shard is not completed (its {n} examples would not read back); "
        "write it again (ShardWriter(..., overwrite=True), or a new store)"
    )


def check_per_sample(shard: Storage, cfg: StoreConfig, blocks: list[Block], n: int, name: str) -> None:
    """finalize's check of a shard it publishes: each block's per-sample rows (lengths,
    labels, keys, fields) still hold the crc32c their writer recorded. Reads the per-sample
    chunks only (small: raw bytes, decoded here), never the activations; a block of an older
    writer records none."""
    recorded = [b for b in blocks if b.per_sample_crc32c]
    if not recorded or not n:
        return
    for a in shard_arrays(cfg):
        base = keys.basename(a.key)
        if a.activations or not any(base in b.per_sample_crc32c for b in recorded):
            continue
        values = _per_sample_values(shard, cfg, a, n, name)
        for b in recorded:
            want = b.per_sample_crc32c.get(base)
            if want is not None and per_sample_crc32c(values[b.start : b.stop], a.dtype) != want:
                raise CorruptStoreError(
                    f"cannot finalize: {name}'s per-sample array {base} no longer holds what its writer committed for "
                    f"examples {b.start}..{b.stop - 1} (crc32c differs: an object was lost or changed on "
                    f"{shard.where(a.key)}). Nothing was published; write the shard again (overwrite=True), or run "
                    "`actstore verify --deep` for the details"
                )


def _per_sample_values(shard: Storage, cfg: StoreConfig, a: ArraySpec, n: int, name: str) -> np.ndarray:
    """Rows [0, n) of per-sample array `a`, from its chunks' bytes (its metadata checked as
    readers check it: an uncompressed little-endian layout)."""
    where = shard.where(a.key)
    try:
        meta = catalog.array_meta(shard, a.key, cfg.zarr_format)
        problems = array_problems(meta, a, cfg.zarr_format, n)
        attrs = catalog.array_attrs(shard, a.key, meta)
    except KeyNotFound:
        problems = ["no metadata"]
    if problems:
        raise CorruptStoreError(f"cannot finalize: {name}'s per-sample array {where} has {problems[0]}")
    rows, (fmt, sep) = chunk_rows(meta, a), key_scheme(meta)
    tail = tuple(a.shape[1:])
    dtype = np.dtype(a.dtype)
    out = np.zeros((n, *tail), dtype)
    chunk_bytes = rows * math.prod(tail) * dtype.itemsize
    for c in range(-(-n // rows)):
        key = row_chunk_key(a.key, fmt, sep, 1 + len(tail), c)
        try:
            data = shard.get(key)
        except KeyNotFound:
            if every_chunk(attrs):
                raise CorruptStoreError(
                    f"cannot finalize: {name} lost {shard.where(key)}, which holds per-sample values of examples "
                    f"{c * rows}..{min(n, (c + 1) * rows) - 1}. Nothing was published; write the shard again"
                ) from None
            continue  # an older writer omitted chunks of zeros
        if len(data) != chunk_bytes:
            raise CorruptStoreError(f"cannot finalize: {shard.where(key)} has {len(data)} bytes, not {chunk_bytes}")
        chunk = np.frombuffer(data, dtype).reshape(rows, *tail)
        out[c * rows : (c + 1) * rows] = chunk[: n - c * rows]
    return out
