"""Checks of one segment's activation array in one shard: every chunk object present at its
size (fast), then every (example, layer) checksum recomputed (deep)."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from actstore import catalog
from actstore.chunkio import ChunkIO, crc32c
from actstore.errors import ActstoreError, CorruptChunkError
from actstore.layout import keys
from actstore.layout.chunks import EMPTY, ChunkGeometry, geometry_from_metadata, key_scheme
from actstore.layout.config import SegmentSpec
from actstore.verify.check import MAX_LISTED, Checker
from actstore.verify.report import ERROR, WARNING

MAX_MISSING_ENUMERATED = 1_000_000  # beyond this many missing chunks, one summary line


def check_acts(v: Checker, ctx: Any, seg: SegmentSpec, si: int, blocks, el, deep: bool) -> None:
    _ActsCheck(v, ctx, seg, si, blocks, el, deep).run()


def _name(ctx: Any, local: int) -> str:
    """How a problem names an example: its global index, or its local index before finalize."""
    g = ctx.global_index(local)
    return str(g) if g is not None else f"local {local} of shard {ctx.shard}"


class _ActsCheck:
    def __init__(self, v: Checker, ctx: Any, seg: SegmentSpec, si: int, blocks, el, deep: bool):
        self.v, self.ctx, self.seg, self.si, self.deep = v, ctx, seg, si, deep
        self.blocks, self.el = blocks, el
        self.cfg = v.cfg
        self.array = keys.acts_array(seg.name)  # relative to the shard
        self.akey = ctx.key(self.array)  # relative to the store
        self.n_tc = seg.n_chunks
        self.missing: dict[tuple[int, int], list[str]] = {}  # (local, layer pos) -> chunk keys
        self.bad_size: set[tuple[int, int]] = set()
        self.io: ChunkIO | None = None

    def add(self, severity: str, kind: str, message: str, key: Any = None, local: int | None = None, lp: int | None = None) -> None:
        where: dict[str, Any] = dict(shard=self.ctx.shard, segment=self.seg.name)
        if local is not None:
            where.update(local=local, example=self.ctx.global_index(local))
        if lp is not None:
            where["layer"] = self.cfg.layers[lp]
        self.v.add(severity, kind, message, key, **where)

    def run(self) -> None:
        meta = self._meta()
        if meta is None:
            return
        try:
            geo = geometry_from_metadata(self.array, meta, self.cfg.n_layers, self.cfg.d_model)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e!r})", self.akey)
            return
        if geo is not None and (geo.t_chunk != self.seg.t_chunk or geo.dtype != np.dtype(self.cfg.zarr_dtype)):
            self.add(ERROR, "array-meta", f"chunks of {geo.t_chunk} tokens of {geo.dtype}; the store config says {self.seg.t_chunk} tokens of {self.cfg.zarr_dtype}", self.akey)
            return
        self.io = ChunkIO(self.ctx.storage, geo) if geo is not None else None
        fmt, sep = key_scheme(meta)
        self._walk(geo, fmt, sep)
        if self.deep:
            self._deep(geo)
        for (local, lp), files in self.missing.items():
            self.add(
                ERROR, "missing-chunk",
                f"chunk file {files[0]} of (example {_name(self.ctx, local)}, "
                f"layer {self.cfg.layers[lp]}) is missing: the direct writer writes every chunk, so it was deleted (readers would return zeros)",
                files[0], local, lp,
            )

    def _meta(self) -> dict[str, Any] | None:
        """The array's metadata as readers see it: the consolidated copy when there is one."""
        cfg, seg = self.cfg, self.seg
        try:
            meta = catalog.array_meta(self.ctx.storage, self.array)
        except FileNotFoundError:
            self.add(ERROR, "array-meta", f"activation array {self.array.rsplit('/', 1)[-1]} is missing", self.akey)
            return None
        except (ActstoreError, ValueError) as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e})", self.akey)
            return None
        try:
            consolidated = catalog.consolidated_arrays(self.ctx.storage)
        except (ActstoreError, ValueError, TypeError, KeyError, AttributeError) as e:
            self.add(ERROR, "array-meta", f"the shard's consolidated metadata is damaged ({e!r})", self.ctx.prefix)
            return None
        if consolidated is not None:
            if consolidated.get(self.array) != meta:
                self.add(ERROR, "array-meta", "the shard's consolidated metadata disagrees with the array's own metadata "
                         "(readers use the consolidated copy)", self.akey)
            meta = consolidated.get(self.array, meta)
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not isinstance(shape, list) or len(shape) != 4 or shape[1:] != [cfg.n_layers, seg.t_max, cfg.d_model]:
            self.add(ERROR, "array-meta", f"array has shape {shape}, expected (n, {cfg.n_layers}, {seg.t_max}, {cfg.d_model})", self.akey)
            return None
        if not isinstance(shape[0], int) or shape[0] < self.ctx.n:
            self.add(ERROR, "array-meta", f"array holds {shape[0]} examples; {self.ctx.n} are published", self.akey)
            return None
        return meta

    # ---- fast: every chunk object present at its size --------------------------------
    def _walk(self, geo: ChunkGeometry | None, fmt: int, sep: str) -> None:
        L, n_tc, n = self.cfg.n_layers, self.n_tc, self.ctx.n
        sharded = geo is not None and geo.shard_examples is not None
        raw = geo is not None and not sharded
        complete = bool(self.ctx.rec and self.ctx.rec.complete)
        committed = self.ctx.rec.n_committed if self.ctx.rec else n
        found = array("q")  # flat (example, layer, token chunk) index of each chunk file present
        head = self.akey + "/"
        for entry in self.v.listing.under(self.akey):
            rel = entry.key[len(head):]
            if entry.kind == "link":
                self.v.symlink(entry.key, self.ctx.shard)
                continue
            if rel in keys.ZARR_NAMES or entry.kind == "dir":
                continue
            key = _chunk_key(rel, fmt, sep)
            grid_ok = key is not None and (key[1:] == (0, 0, 0) if sharded else (key[1] < L and key[2] < n_tc and key[3] == 0))
            if not grid_ok:
                if not keys.is_temporary(rel.split("/")[-1]):
                    self.add(WARNING, "stray-file", f"{rel} in array {self.array.rsplit('/', 1)[-1]} is not a chunk of this array", entry.key)
                continue
            ex = key[0] * geo.shard_examples if sharded else key[0]
            if ex >= n:
                if complete and ex >= committed:
                    self.add(WARNING, "stray-file", f"chunk {rel} belongs to example {ex}, past the shard's {committed} committed examples", entry.key)
                continue
            self.v.report.n_chunk_files += 1
            if sharded:
                self._check_shard_file(geo, entry.key, key[0])
            elif raw:
                if entry.size != geo.chunk_nbytes:
                    what = "truncated" if entry.size < geo.chunk_nbytes else "too long"
                    self.add(ERROR, "chunk-size", f"chunk file {rel} has {entry.size} bytes, expected {geo.chunk_nbytes} ({what})", entry.key, ex, key[1])
                    self.bad_size.add((ex, key[1]))
                found.append((ex * L + key[1]) * n_tc + key[2])
        if not raw:
            return
        expected = n * L * n_tc
        if expected - len(found) > MAX_MISSING_ENUMERATED:
            self.deep = False
            self.add(ERROR, "missing-chunk", f"the shard publishes {n} examples ({expected} chunk files) but only {len(found)} chunk files exist", self.akey)
            return
        if len(found) < expected:
            present = np.zeros(expected, bool)  # bounded: expected <= files found + MAX_MISSING_ENUMERATED
            present[np.asarray(found, np.int64)] = True
            for flat in np.flatnonzero(~present)[: 100 * MAX_LISTED]:
                ex, rest = divmod(int(flat), L * n_tc)
                lp, tc = divmod(rest, n_tc)
                self.missing.setdefault((ex, lp), []).append(self.ctx.key(geo.chunk_key(ex, lp, tc)))

    def _check_shard_file(self, geo: ChunkGeometry, key: str, k: int) -> None:
        S = geo.shard_examples
        try:
            index = self.io.shard_index(geo.shard_key(k * S))
        except CorruptChunkError as e:
            self.add(ERROR, "chunk-size", str(e), key, k * S)
            return
        if index is None:
            return
        stop = min(self.ctx.n - k * S, S)
        sizes = index[:stop, :, :, 1]
        empty = index[:stop, :, :, 0] == EMPTY
        bad = (~empty) & (sizes != geo.chunk_nbytes)
        for i, lp, tc in np.argwhere(bad)[:MAX_LISTED]:
            self.add(
                ERROR, "chunk-size", f"inner chunk (token chunk {tc}) in shard file {key.rsplit('/', 1)[-1]} has {int(sizes[i, lp, tc])} bytes, expected {geo.chunk_nbytes}",
                key, k * S + int(i), int(lp),
            )
            self.bad_size.add((k * S + int(i), int(lp)))

    # ---- deep: recompute checksums ---------------------------------------------------
    def _deep(self, geo: ChunkGeometry | None) -> None:
        if self.blocks is None:
            return
        L, seg = self.cfg.n_layers, self.seg
        buf_shape = (self.n_tc * seg.t_chunk, self.cfg.d_model)
        dtype = np.dtype(self.cfg.zarr_dtype)
        zarr_arr = None
        if geo is None:
            import zarr

            try:
                zarr_arr = zarr.open_array(store=self.ctx.storage.zarr_store(self.array, read_only=True), mode="r")
            except Exception as e:  # noqa: BLE001 - untrusted metadata
                self.add(ERROR, "array-meta", f"array cannot be opened by zarr ({e!r})", self.akey)
                return
        for bi, b in enumerate(self.blocks):
            block_crc = 0
            damaged_here = False
            for local in range(b.start, b.stop):
                rows = self._read_example(zarr_arr, local, buf_shape, dtype)
                for lp in range(L):
                    if rows is None or (local, lp) in self.bad_size:
                        damaged_here = True
                        continue
                    crc = crc32c(rows[lp])
                    block_crc = crc32c(rows[lp], block_crc)
                    self.v.report.n_bytes_read += rows[lp].nbytes
                    damaged_here |= self._compare(local, lp, crc)
                if self.v.progress is not None:
                    self.v.progress(L * int(np.prod(buf_shape)) * dtype.itemsize)
            if block_crc != b.crc32c[seg.name] and not damaged_here:
                self.add(
                    ERROR, "block-checksum",
                    f"block {bi} (examples {b.start}..{b.stop - 1} of the shard) has crc32c {block_crc:#010x}, the writer recorded "
                    f"{b.crc32c[seg.name]:#010x}: "
                    + ("one of its chunk files was altered (this shard records no per-example checksums to say which)" if self.el is None
                       else "the block record or the per-example checksums were altered"),
                    self.ctx.key(keys.BLOCKS),
                )

    def _compare(self, local: int, lp: int, crc: int) -> bool:
        """Compare one (example, layer)'s crc32c with the record; True when it is damaged."""
        missing = (local, lp) in self.missing
        if self.el is None:
            return missing
        want = int(self.el[local, self.si, lp])
        if missing and crc == want:
            files = self.missing.pop((local, lp))
            self.add(
                WARNING, "missing-chunk",
                f"chunk file {files[0]} is missing, but the checksum shows zeros were written there "
                "(zarr omits chunks equal to the fill value: the shard was written with engine='zarr')",
                files[0], local, lp,
            )
            return False
        if missing:
            return True
        if crc != want:
            files = self._files(local, lp)
            where = f"chunk file {files[0].rsplit('/', 1)[-1]}" if len(files) == 1 else (
                f"one of its chunk files {', '.join(f.rsplit('/', 1)[-1] for f in files)}"
            )
            self.add(
                ERROR, "checksum",
                f"crc32c of (example {_name(self.ctx, local)}, layer {self.cfg.layers[lp]}) is {crc:#010x}, "
                f"the writer recorded {want:#010x}: the bytes of {where} were altered",
                files[0], local, lp,
            )
            return True
        return False

    def _read_example(self, zarr_arr, local: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray | None:
        """(L, n_tc * t_chunk, D) rows of one example in the stored dtype, or None if unreadable."""
        L = self.cfg.n_layers
        out = np.zeros((L, *shape), dtype)
        if self.io is not None:
            for lp in range(L):
                if (local, lp) in self.bad_size:
                    continue
                try:
                    self.io.read_into(local, lp, out[lp])
                except CorruptChunkError as e:
                    if (local, lp) not in self.bad_size:
                        self.bad_size.add((local, lp))
                        self.add(ERROR, "chunk-size", str(e), self._files(local, lp)[0], local, lp)
            return out
        try:
            out[:, : self.seg.t_max] = zarr_arr[local]
        except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes is damage
            self.add(ERROR, "chunk-decode", f"example cannot be decoded by zarr ({e!r})", self.akey, local)
            return None
        return out

    def _files(self, local: int, lp: int) -> list[str]:
        if self.io is None:
            return [self.akey]
        return [self.ctx.key(k) for k in self.io.geo.chunk_keys_of(local, lp)]


def _chunk_key(rel: str, fmt: int, sep: str) -> tuple[int, ...] | None:
    if fmt == 3:
        if not rel.startswith("c" + sep):
            return None
        rel = rel[2:]
    if sep == "." and "/" in rel:
        return None
    parts = rel.split(sep)
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)
