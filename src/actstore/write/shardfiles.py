"""ShardFiles: Zarr format 3 shard files gathered whole and written by the write pipeline.

A writer gathers S examples, then hands the whole shard file to the write pipeline
(actstore.write.pipeline), whose threads write (or upload) it, one shard file per segment,
while the appending thread gathers and checksums the next: converting, screening and
checksumming the next batches overlaps the storage, and several shard files are in flight
at once (one per pipeline thread). A shard file's data is the (example, layer) rows of its
examples in order, gathered in one of two ways:

- copied into a staging buffer (the one copy of each byte, checksummed while in the
  cache), reused once written: memory bounded by the buffers (`take` waits while all are
  in use);
- lent (ShardWriter.append(release=...), what a capture does): the caller's rows are
  written as they are, in one gathered write, and handed back (`release`) once every
  shard file holding them is written. No copy at all.

A commit covers every appended example: a partly filled shard is written as a whole
shard file then, and replaced whole once it fills. A write error is kept and raised by
the next `check`/`flush` on the appending thread; the shard's last commit is untouched
(a partial shard file lies past it and a resume drops it).
"""

from __future__ import annotations

import numpy as np

from actstore.chunkio import ChunkIO
from actstore.hostmem import HostBuffer, Lent, SlotPool, Spare, carve_bytes
from actstore.layout.config import StoreConfig
from actstore.storage import Writeback
from actstore.write.batch import Batch, LayerList
from actstore.write.layouts import Layout
from actstore.write.pipeline import MAX_BYTES, IOStats, WritePipeline

COPY_BYTES = 2**20  # staged and checksummed together: well within a core's L2 cache


SPARE = Spare(2 * 2**30)  # staging buffers kept for this process's next writer


def lent_bytes(cfg: StoreConfig, max_bytes: int | None = None) -> int:
    """The most bytes of lent rows (ShardWriter.append(release=...)) a shard-file writer
    holds before an append waits: the file being gathered (or waiting to be submitted) and
    the files submitted, not yet written (the pipeline's `max_bytes`, or one file when a
    file is larger). A capture sizes its pool of host slots from this."""
    file_bytes = cfg.shard_examples * cfg.example_bytes()
    return file_bytes + max(MAX_BYTES if max_bytes is None else int(max_bytes), file_bytes)


class _Staging(dict):
    """{segment: (S, L, T_pad, D)} arrays carved from one pooled host buffer (`buf`)."""

    buf: HostBuffer


class StagingBuffers:
    """Up to `n` staging buffers {segment: (S, L, T_pad, D)}, from a pool of host buffers
    (actstore.hostmem): allocated on first use and reused, a buffer comes back when the
    pipeline has written it; a closed writer's free buffers serve this process's next
    writer (faulting in fresh pages costs more than the copy into them)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: np.dtype, n: int):
        self.shapes = [(shape, np.dtype(dtype)) for shape in shapes.values()]
        self.names = list(shapes)
        self.nbytes = carve_bytes([int(np.prod(s)) * d.itemsize for s, d in self.shapes])
        self.pool = SlotPool(n, "plain", SPARE)

    def take(self) -> _Staging:
        """An empty buffer; waits while all `n` are being written."""
        buf = self.pool.take(self.nbytes)
        out = _Staging(zip(self.names, buf.carve_arrays(self.shapes)))
        out.buf = buf
        return out

    def give_back(self, staging: _Staging) -> None:
        self.pool.give_back(staging.buf)

    def close(self) -> None:
        """Keep the free buffers for the next writer (up to the spare's cap in this process)."""
        self.pool.close()


class ShardFiles(Layout):
    """Format 3 Zarr shard files of S examples, gathered here and written by the pipeline.

    Args:
        cfg: the store configuration (shard_examples S).
        io: {segment: ChunkIO} of the sharded arrays.
        n_written: examples already committed (a resumed shard reloads a partial file).
        pipeline: the write pipeline its shard files go to.
        writeback: the storage's writeback helper (a local disk's), or None.
        durable: each shard file synced (data and name) on its I/O thread, beside the next
            writes (ShardWriter(fsync=True)).
    """

    background = True
    borrows = True  # appends may lend their rows (Batch.release)
    files = "shard files"

    def __init__(
        self,
        cfg: StoreConfig,
        io: dict[str, ChunkIO],
        n_written: int,
        pipeline: WritePipeline,
        writeback: Writeback | None,
        durable: bool = False,
    ):
        super().__init__(cfg)
        self.io = io
        self.S = cfg.shard_examples
        self.pipeline = pipeline
        self._writeback = writeback
        self.durable = durable
        shapes = {s.name: (self.S, cfg.n_layers, s.t_pad, cfg.d_model) for s in cfg.segments}
        file_bytes = self.S * cfg.example_bytes()
        # One buffer filling, one per pipeline thread writing, within the pipeline's bytes.
        n = max(2, min(pipeline.threads + 1, pipeline.max_bytes // max(file_bytes, 1) + 1))
        self.buffers = StagingBuffers(shapes, np.dtype(cfg.zarr_dtype), n)
        self.stage: dict[str, np.ndarray] | None = None  # taken when a copied batch needs it
        self.parts: dict[str, list] = {s.name: [] for s in cfg.segments}  # the current file's rows, in order
        self.lent: list[Lent] = []  # lent batches whose rows the current file holds
        self.stage_first = n_written // self.S * self.S
        self.stage_n = self.stage_written = n_written - self.stage_first
        if self.stage_n:  # resumed after a commit that wrote a partial shard: reload it
            stage = self._stage()
            for s in cfg.segments:
                for i in range(self.stage_n):
                    for lp in range(cfg.n_layers):
                        io[s.name].read_into(self.stage_first + i, lp, stage[s.name][i, lp])
                self.parts[s.name].append(stage[s.name][: self.stage_n])

    @property
    def at_boundary(self) -> bool:
        """No partly filled shard file is gathered (a commit now writes no shard file twice)."""
        return self.stage_n == 0

    def check(self) -> None:
        self.pipeline.check()

    def _stage(self) -> dict[str, np.ndarray]:
        if self.stage is None:
            self.stage = self.buffers.take()
        return self.stage

    def append(self, batch: Batch, n0: int) -> None:
        """Gather a batch's rows (copied, or lent); hand each full shard file to the pipeline."""
        lent = Lent(batch.release) if batch.release is not None else None
        i, b = 0, batch.b
        try:
            while i < b:
                k = min(b - i, self.S - self.stage_n)
                for name, arr in batch.acts.items():
                    if lent is not None:  # the rows themselves, checksummed where they are
                        rows = arr[i : i + k]
                        self._add_rows(name, rows)
                        self.parts[name].extend(rows[j, lp] for j in range(k) for lp in range(self.cfg.n_layers))
                    else:
                        self._copy(name, arr, i, k)
                if lent is not None:
                    lent.hold()
                    self.lent.append(lent)
                self.stage_n += k
                i += k
                if self.stage_n == self.S:
                    self._submit(self.stage_first, self.stage_n, release=True)
                    self.stage_first += self.stage_n
                    self.stage_n = self.stage_written = 0
        finally:
            if lent is not None:
                lent.done()  # (the batch's own hold: released once its files are written)

    def _copy(self, name: str, arr: object, i: int, k: int) -> None:
        """Copy rows i..i+k of `arr` into the staging buffer, a few examples at a time (about
        COPY_BYTES), each checksummed right after its copy while still in the CPU's cache:
        one pass over memory for both."""
        part = self._stage()[name][self.stage_n : self.stage_n + k]
        step = max(1, COPY_BYTES // max(part[:1].nbytes, 1))
        for j in range(0, k, step):
            e = min(j + step, k)
            if isinstance(arr, LayerList):  # the layers as the capture produced them
                for lp, a in enumerate(arr.layers):
                    part[j:e, lp] = a[i + j : i + e]
            else:
                part[j:e] = arr[i + j : i + e]
            self._add_rows(name, part[j:e])
        self.parts[name].append(part)

    def _submit(self, first: int, n: int, release: bool) -> None:
        """Write examples first..first+n-1 (the gathered rows) as one shard file per segment.
        With release=True the file is whole: its staging buffer and lent rows go back once
        it is written; with release=False (a partial shard written at a commit) they stay,
        and gathering goes on once the pipeline is drained."""
        parts = {seg: list(rows) for seg, rows in self.parts.items()}

        def write() -> None:
            for seg, io in self.io.items():
                io.write_shard_parts(first, n, parts[seg], writeback=self._writeback, durable=self.durable)

        done = None
        if release:
            stage, lent = self.stage, self.lent
            self.stage, self.lent = None, []
            self.parts = {seg: [] for seg in self.parts}

            def done() -> None:
                if stage is not None:
                    self.buffers.give_back(stage)
                for x in lent:
                    x.done()

        self.pipeline.submit(write, n * self.cfg.example_bytes(), done)

    def flush(self, complete: bool) -> int:
        # A commit covers every appended example: a partly filled shard is written as
        # a whole shard file now and replaced whole once it fills.
        if self.stage_n > self.stage_written:
            self._submit(self.stage_first, self.stage_n, release=False)
            self.stage_written = self.stage_n
        self.pipeline.drain()
        return self.stage_first + self.stage_n

    @classmethod
    def first_stale(cls, cfg: StoreConfig, n: int) -> int:
        # A partly filled shard file at n // S holds committed examples: it stays (whole).
        return -(-n // cfg.shard_examples)

    def io_stats(self) -> IOStats:
        return self.pipeline.stats()

    def close(self) -> None:
        self.pipeline.close()
        if self._writeback is not None:
            self._writeback.close()
        lent, self.lent = self.lent, []
        for x in lent:  # nothing more will be written from them
            x.done()
        self.parts = {seg: [] for seg in self.parts}
        if self.stage is not None:  # (closed once: a buffer must never be kept twice)
            self.buffers.give_back(self.stage)
            self.stage = None
        self.buffers.close()
