"""Fast checks of one segment's activation array in one shard: its metadata against the
store config, and every chunk object present at its exact size. The state it leaves (what
is missing, what has the wrong size, how chunks are read) is what deep mode's checksums
(actstore.verify.deep) start from."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from actstore import catalog
from actstore.chunkio import ChunkIO
from actstore.errors import ActstoreError, CorruptChunkError
from actstore.layout import keys
from actstore.layout.arraymeta import array_problems
from actstore.layout.arrays import array_specs
from actstore.layout.chunks import EMPTY, ChunkGeometry, array_shape, geometry_from_metadata, key_scheme
from actstore.layout.config import SegmentSpec
from actstore.verify.check import MAX_LISTED, Checker, ShardCtx, array_entries, attrs_problem
from actstore.verify.report import ERROR, WARNING

MAX_MISSING_ENUMERATED = 1_000_000  # beyond this many missing chunks, one summary line

_DAMAGED = (ValueError, TypeError, KeyError, AttributeError, IndexError)  # what damaged metadata raises


class ActsCheck:
    """One segment's activation array of one shard.

    After `fast()`: `io` reads its raw chunks (None: zarr-python reads it), `missing` maps
    (local example, layer position) to the chunk keys absent, `bad_size` holds the
    (example, layer position) pairs whose chunks cannot be read, and `deep_ok` says whether
    the checksums may be recomputed.
    """

    def __init__(self, v: Checker, ctx: ShardCtx, seg: SegmentSpec, si: int):
        self.v, self.ctx, self.seg, self.si = v, ctx, seg, si
        self.cfg = v.cfg
        self.array = keys.acts_array(seg.name)  # relative to the shard
        self.akey = ctx.key(self.array)  # relative to the store
        self.n_tc = seg.n_chunks
        self.missing: dict[tuple[int, int], list[str]] = {}
        self.bad_size: set[tuple[int, int]] = set()
        self.io: ChunkIO | None = None
        self.deep_ok = True

    def add(
        self, severity: str, kind: str, message: str, key: Any = None, local: int | None = None, lp: int | None = None
    ) -> None:
        self.v.add(severity, kind, message, key, shard=self.ctx.shard, **self._where(local, lp))

    def _where(self, local: int | None, lp: int | None) -> dict[str, Any]:
        """The segment, example and layer a problem names."""
        where: dict[str, Any] = dict(segment=self.seg.name)
        if local is not None:
            where.update(local=local, example=self.ctx.global_index(local))
        if lp is not None:
            where["layer"] = self.cfg.layers[lp]
        return where

    def fast(self) -> bool:
        """Check the metadata and walk the chunk objects; False when the metadata is too
        damaged to go on (already reported)."""
        meta = self._meta()
        if meta is None:
            return False
        problems = array_problems(
            meta, array_specs(self.cfg)[self.array], self.cfg.zarr_format, self.ctx.n, complete=self.ctx.complete
        )
        problems += filter(None, [attrs_problem(self.ctx, self.array, meta, self.cfg)])
        if problems:
            self.add(ERROR, "array-meta", problems[0], self.akey)
            return False
        try:
            geo = geometry_from_metadata(self.array, meta, self.cfg.n_layers, self.cfg.d_model)
        except _DAMAGED as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e!r})", self.akey)
            return False
        self.io = ChunkIO(self.ctx.storage, geo) if geo is not None else None
        fmt, sep = key_scheme(meta)
        self._walk(geo, fmt, sep)
        return True

    def report_missing(self) -> None:
        """The chunks still missing (deep mode takes back those whose checksum shows zeros)."""
        for (local, lp), files in self.missing.items():
            self.add(
                ERROR,
                "missing-chunk",
                f"chunk file {files[0]} of (example {self.ctx.example_name(local)}, "
                f"layer {self.cfg.layers[lp]}) is missing: the direct writer writes every chunk, so it was deleted (readers would return zeros)",
                files[0],
                local,
                lp,
            )

    def files(self, local: int, lp: int) -> list[str]:
        """The keys (from the store root) holding (example, layer position)."""
        if self.io is None:
            return [self.akey]
        return [self.ctx.key(k) for k in self.io.geo.chunk_keys_of(local, lp)]

    def _meta(self) -> dict[str, Any] | None:
        """The array's metadata as readers see it: the consolidated copy when there is one."""
        cfg, seg = self.cfg, self.seg
        try:
            meta = catalog.array_meta(self.ctx.storage, self.array)
        except FileNotFoundError:
            self.add(ERROR, "array-meta", f"activation array {keys.basename(self.array)} is missing", self.akey)
            return None
        except (ActstoreError, ValueError) as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e})", self.akey)
            return None
        try:
            consolidated = catalog.consolidated_arrays(self.ctx.storage)
        except (ActstoreError, *_DAMAGED) as e:
            self.add(ERROR, "array-meta", f"the shard's consolidated metadata is damaged ({e!r})", self.ctx.prefix)
            return None
        if consolidated is not None:
            if consolidated.get(self.array) != meta:
                self.add(
                    ERROR,
                    "array-meta",
                    "the shard's consolidated metadata disagrees with the array's own metadata "
                    "(readers use the consolidated copy)",
                    self.akey,
                )
            meta = consolidated.get(self.array, meta)
        try:
            shape = array_shape(meta)
        except ValueError as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e})", self.akey)
            return None
        if len(shape) != 4 or shape[1:] != [cfg.n_layers, seg.t_max, cfg.d_model]:
            self.add(
                ERROR,
                "array-meta",
                f"array has shape {shape}, expected (n, {cfg.n_layers}, {seg.t_max}, {cfg.d_model})",
                self.akey,
            )
            return None
        if shape[0] < self.ctx.n:
            self.add(ERROR, "array-meta", f"array holds {shape[0]} examples; {self.ctx.n} are published", self.akey)
            return None
        return meta

    def _walk(self, geo: ChunkGeometry | None, fmt: int, sep: str) -> None:
        L, n_tc, n = self.cfg.n_layers, self.n_tc, self.ctx.n
        sharded = geo is not None and geo.shard_examples is not None
        raw = geo is not None and not sharded
        complete = bool(self.ctx.rec and self.ctx.rec.complete)
        committed = self.ctx.rec.n_committed if self.ctx.rec else n
        found = array("q")  # flat (example, layer, token chunk) index of each chunk file present
        for rel, key, entry in array_entries(self.v.listing, self.akey, fmt, sep, 4):
            if entry.kind == "link":
                self.v.symlink(entry.key, self.ctx.shard)
                continue
            grid_ok = key is not None and (
                key[1:] == (0, 0, 0) if sharded else (key[1] < L and key[2] < n_tc and key[3] == 0)
            )
            if not grid_ok:
                if not self.v.not_a_chunk_file(entry.key, entry.kind, self.ctx.shard) and not keys.is_temporary(
                    keys.basename(rel)
                ):
                    self.add(
                        WARNING,
                        "stray-file",
                        f"{rel} in array {keys.basename(self.array)} is not a chunk of this array",
                        entry.key,
                    )
                continue
            ex = key[0] * geo.shard_examples if sharded else key[0]
            if ex >= n:
                if complete and ex >= committed:
                    self.add(
                        WARNING,
                        "stray-file",
                        f"chunk {rel} belongs to example {ex}, past the shard's {committed} committed examples",
                        entry.key,
                    )
                continue
            self.v.report.n_chunk_files += 1
            if self.v.not_a_chunk_file(
                entry.key, entry.kind, self.ctx.shard, **self._where(ex, None if sharded else key[1])
            ):
                # a folder, FIFO, socket or device: never read
                if sharded:
                    self.bad_size.update((e, lp) for e in range(ex, min(n, ex + geo.shard_examples)) for lp in range(L))
                elif raw:
                    self.bad_size.add((ex, key[1]))
                    found.append((ex * L + key[1]) * n_tc + key[2])
            elif sharded:
                self._check_shard_file(geo, entry.key, key[0])
            elif raw:
                if entry.size != geo.chunk_nbytes:
                    what = "truncated" if entry.size < geo.chunk_nbytes else "too long"
                    self.add(
                        ERROR,
                        "chunk-size",
                        f"chunk file {rel} has {entry.size} bytes, expected {geo.chunk_nbytes} ({what})",
                        entry.key,
                        ex,
                        key[1],
                    )
                    self.bad_size.add((ex, key[1]))
                found.append((ex * L + key[1]) * n_tc + key[2])
        if raw:
            self._missing(geo, found)

    def _missing(self, geo: ChunkGeometry, found: array) -> None:
        """Record the chunk files of published examples that are not there."""
        L, n_tc, n = self.cfg.n_layers, self.n_tc, self.ctx.n
        expected = n * L * n_tc
        gone = sum(max(0, min(b, n) - a) for a, b in self.ctx.removed) * L * n_tc
        if expected - gone - len(found) > MAX_MISSING_ENUMERATED:
            self.deep_ok = False
            self.add(
                ERROR,
                "missing-chunk",
                f"the shard publishes {n} examples ({expected} chunk files) but only {len(found)} chunk files exist",
                self.akey,
            )
            return
        if len(found) < expected:
            present = np.zeros(expected, bool)  # bounded: expected <= files found + MAX_MISSING_ENUMERATED
            present[np.asarray(found, np.int64)] = True
            if self.ctx.removed:  # a spool's consumed examples: their files are gone on purpose
                for a, b in self.ctx.removed:
                    present[a * L * n_tc : min(b, n) * L * n_tc] = True
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
                ERROR,
                "chunk-size",
                f"inner chunk (token chunk {tc}) in shard file {keys.basename(key)} has {int(sizes[i, lp, tc])} bytes, expected {geo.chunk_nbytes}",
                key,
                k * S + int(i),
                int(lp),
            )
            self.bad_size.add((k * S + int(i), int(lp)))
