"""How a writer shard's activations reach storage: one small interface, one class a layout.

The commit protocol (actstore.write.writer) drives a layout without knowing which it is:

- `append(batch, n0)` writes or stages the batch's activation rows for local examples
  n0.. and keeps their checksums (per (example, layer), and the block's chained crc32c);
  a failure leaves the layout's checksum state as it was before the call;
- `flush(complete)` makes every appended example written and returns their count;
- `check()` raises the error of failed background work; with `background` True such an
  error (from `check` or `flush`) leaves the layout unusable: the writer closes;
- `at_boundary` says whether a commit now writes nothing twice (automatic commits wait
  for it, up to twice the commit size);
- `take_checksums(n)` hands the protocol the checksums of the next n committed examples;
- `first_stale(cfg, n)` (a class method) says from which first chunk-grid coordinate a
  resumed shard's objects are uncommitted, to be dropped before the layout opens;
- `io_stats()` says what its write pipeline holds and has written (progress output);
- `close()` stops background work.

Layouts: `ChunkFiles` (a raw chunk object per (example, layer, token chunk), format 2 or
3) and `ShardFiles` (format 3 Zarr shard files staged whole, actstore.write.shardfiles)
hand whole objects to a `WritePipeline` (actstore.write.pipeline), whose threads write or
upload them while the appending thread converts and checksums; `ZarrArrays` goes through
zarr-python (e.g. compressed).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from actstore.chunkio import ChunkIO, crc32c
from actstore.layout.checksum import combine_all
from actstore.layout.config import StoreConfig
from actstore.write.batch import Batch, LayerList
from actstore.write.pipeline import IOStats, WritePipeline


class Layout:
    """Base: the checksum bookkeeping every layout shares."""

    background = False  # whether rows are written by a thread whose errors end the writer
    borrows = False  # whether an append may lend its rows (written from where they are, later)
    files = "chunk files"  # what it writes, for error messages

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        names = [s.name for s in cfg.segments]
        self.block_crc = dict.fromkeys(names, 0)
        self.el_crc: dict[str, list[int]] = {n: [] for n in names}

    def append(self, batch: Batch, n0: int) -> None:
        raise NotImplementedError

    def flush(self, complete: bool) -> int:
        raise NotImplementedError

    @classmethod
    def first_stale(cls, cfg: StoreConfig, n: int) -> int:
        """The first chunk-grid index (along examples) holding no committed example, when
        n examples are committed: later objects are a crashed writer's tail."""
        return n

    @property
    def at_boundary(self) -> bool:
        return True

    def check(self) -> None:
        pass

    def io_stats(self) -> IOStats | None:
        return None

    def close(self) -> None:
        pass

    def take_checksums(self, n: int) -> tuple[dict[str, int], np.ndarray]:
        """(block crc32c per segment, (n, segments, layers) per-row crc32c) of the next n
        examples; the block's chained crc starts again from zero."""
        k = n * self.cfg.n_layers
        el_esl = np.stack(
            [np.array(self.el_crc[s.name][:k], "<u4").reshape(n, self.cfg.n_layers) for s in self.cfg.segments], axis=1
        )
        for s in self.cfg.segments:
            del self.el_crc[s.name][:k]
        block = dict(self.block_crc)
        self.block_crc = dict.fromkeys(self.block_crc, 0)
        return block, el_esl

    def _row_checksums(self, batch: Batch) -> None:
        """One pass over the batch's bytes: a crc32c per (example, layer) row, and the block's
        chained crc32c derived from them (checksum.combine_all), not read a second time."""
        for seg in self.cfg.segments:
            self._add_rows(seg.name, batch.acts[seg.name])

    def _add_rows(self, name: str, arr: np.ndarray) -> None:
        """Checksum the (n, L, T_pad, D) rows of `arr` into the row list and the block crc."""
        rows = [crc32c(arr[i, lp]) for i in range(arr.shape[0]) for lp in range(arr.shape[1])]
        self.el_crc[name].extend(rows)
        if rows:
            self.block_crc[name] = combine_all(self.block_crc[name], rows, arr[0, 0].nbytes)

    def _undo_point(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.block_crc), {k: len(v) for k, v in self.el_crc.items()}

    def _undo(self, point: tuple[dict[str, int], dict[str, int]]) -> None:
        self.block_crc = dict(point[0])
        for k, n in point[1].items():
            del self.el_crc[k][n:]


class ChunkFiles(Layout):
    """One raw chunk object per (example, layer, token chunk).

    An append hands each example's objects to the write pipeline's threads, checksums the
    rows meanwhile, and returns once every object of the batch is written: an append that
    fails (a full disk) adds nothing and leaves the writer usable, and the batch's arrays
    (perhaps the caller's memory) are never kept, so never copied.
    """

    def __init__(self, cfg: StoreConfig, io: dict[str, ChunkIO], n_written: int, pipeline: WritePipeline):
        super().__init__(cfg)
        self.io = io
        self.n_written = n_written
        self.pipeline = pipeline

    def append(self, batch: Batch, n0: int) -> None:
        point = self._undo_point()
        futures = []
        try:
            try:
                for i in range(batch.b):
                    futures.append(
                        self.pipeline.submit(partial(self._write_example, batch, i, n0 + i), self.cfg.example_bytes())
                    )
                self._row_checksums(batch)  # beside the writes
            finally:
                self.pipeline.wait(futures)  # the batch's memory is free again; raises an I/O error
        except BaseException:
            self._undo(point)
            raise
        self.n_written = n0 + batch.b

    def _write_example(self, batch: Batch, i: int, ex: int) -> None:
        for seg in self.cfg.segments:
            acts = batch.acts[seg.name]
            self.io[seg.name].write_example(ex, [acts[i, lp] for lp in range(self.cfg.n_layers)])

    def flush(self, complete: bool) -> int:
        return self.n_written

    def io_stats(self) -> IOStats:
        return self.pipeline.stats()

    def close(self) -> None:
        self.pipeline.close()


class ZarrArrays(Layout):
    """Through zarr-python (any codec): batches wait in memory until the commit writes them."""

    def __init__(self, cfg: StoreConfig, arrays: dict[str, Any], n_written: int):
        super().__init__(cfg)
        self.arrays = arrays
        self.n_flushed = self.n_written = n_written
        self.pending: dict[str, list[np.ndarray]] = {s.name: [] for s in cfg.segments}

    def append(self, batch: Batch, n0: int) -> None:
        for seg in self.cfg.segments:
            arr = batch.acts[seg.name]
            if isinstance(arr, LayerList):
                arr = arr.stack()  # (a copy: the caller's layers are not kept)
            elif batch.aliased[seg.name]:
                arr = arr.copy()
            self.pending[seg.name].append(arr)
        self._row_checksums(batch)
        self.n_written = n0 + batch.b

    def flush(self, complete: bool) -> int:
        n0, n = self.n_flushed, self.n_written - self.n_flushed
        if not n:
            return n0
        for seg in self.cfg.segments:
            parts = self.pending[seg.name]
            chunk = np.concatenate(parts) if len(parts) > 1 else parts[0]
            arr = self.arrays[seg.name]
            if arr.shape[0] != n0 + n:
                arr.resize((n0 + n, *arr.shape[1:]))
            arr[n0 : n0 + n] = chunk[:, :, : seg.t_max]
            self.pending[seg.name] = []
        self.n_flushed = n0 + n
        return self.n_flushed
