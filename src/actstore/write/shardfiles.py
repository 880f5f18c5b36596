"""ShardFiles: Zarr format 3 shard files staged whole and written by the write pipeline.

A writer gathers S examples into a staging buffer, then hands the full buffer to the
write pipeline (actstore.write.pipeline), whose threads write (or upload) it as one shard
file per segment while the appending thread fills and checksums the next buffer:
converting, screening and checksumming the next batches overlaps the storage, and
several shard files are in flight at once (one per pipeline thread). The buffer itself is
written (or uploaded) and then reused: one copy of each byte, and memory bounded by the
buffers (`take_buffer` waits while all are in use).

A commit covers every appended example: a partly filled shard is written as a whole
shard file then, and replaced whole once it fills. A write error is kept and raised by
the next `check`/`flush` on the appending thread; the shard's last commit is untouched
(a partial shard file lies past it and a resume drops it).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from actstore.chunkio import ChunkIO
from actstore.layout.config import StoreConfig
from actstore.storage import Writeback
from actstore.write.batch import Batch, LayerList
from actstore.write.layouts import Layout
from actstore.write.pipeline import IOStats, WritePipeline

COPY_BYTES = 2**20  # staged and checksummed together: well within a core's L2 cache


SPARE_BYTES = 2 * 2**30  # staging buffers kept for this process's next writer
_spare: list[dict[str, np.ndarray]] = []
_spare_lock = threading.Lock()


class StagingBuffers:
    """Up to `n` staging buffers {segment: (S, L, T_pad, D)}, allocated on first use and
    reused: a buffer comes back when the pipeline has written it. A closed writer's free
    buffers serve this process's next writer of the same shape (faulting in fresh pages
    costs more than the copy into them)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: np.dtype, n: int):
        self.shapes = shapes
        self.dtype = np.dtype(dtype)
        self.n = n
        self._allocated = 0
        self._free: queue.Queue = queue.Queue()

    def take(self) -> dict[str, np.ndarray]:
        """An empty buffer; waits while all `n` are being written."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._allocated < self.n:
            self._allocated += 1
            return self._reuse() or {s: np.empty(shape, self.dtype) for s, shape in self.shapes.items()}
        return self._free.get()

    def give_back(self, buf: dict[str, np.ndarray]) -> None:
        self._free.put(buf)

    def _fits(self, buf: dict[str, np.ndarray]) -> bool:
        return {s: (a.shape, a.dtype) for s, a in buf.items()} == {s: (sh, self.dtype) for s, sh in self.shapes.items()}

    def _reuse(self) -> dict[str, np.ndarray] | None:
        with _spare_lock:
            for i, buf in enumerate(_spare):
                if self._fits(buf):
                    return _spare.pop(i)  # (by position: dicts of arrays do not compare)
        return None

    def close(self) -> None:
        """Keep the free buffers for the next writer (up to SPARE_BYTES in this process)."""
        while True:
            try:
                buf = self._free.get_nowait()
            except queue.Empty:
                return
            with _spare_lock:
                held = sum(a.nbytes for b in _spare for a in b.values())
                if held + sum(a.nbytes for a in buf.values()) <= SPARE_BYTES:
                    _spare.append(buf)


class ShardFiles(Layout):
    """Format 3 Zarr shard files of S examples, staged here and written by the pipeline.

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
        shapes = {s.name: (self.S, cfg.n_layers, s.n_chunks * s.t_chunk, cfg.d_model) for s in cfg.segments}
        file_bytes = self.S * cfg.example_bytes()
        # One buffer filling, one per pipeline thread writing, within the pipeline's bytes.
        n = max(2, min(pipeline.threads + 1, pipeline.max_bytes // max(file_bytes, 1) + 1))
        self.buffers = StagingBuffers(shapes, np.dtype(cfg.zarr_dtype), n)
        self.stage = self.buffers.take()
        self.stage_first = n_written // self.S * self.S
        self.stage_n = self.stage_written = n_written - self.stage_first
        if self.stage_n:  # resumed after a commit that wrote a partial shard: reload it
            for s in cfg.segments:
                for i in range(self.stage_n):
                    for lp in range(cfg.n_layers):
                        io[s.name].read_into(self.stage_first + i, lp, self.stage[s.name][i, lp])

    @property
    def at_boundary(self) -> bool:
        """No partly filled shard file is staged (a commit now writes no shard file twice)."""
        return self.stage_n == 0

    def check(self) -> None:
        self.pipeline.check()

    def append(self, batch: Batch, n0: int) -> None:
        """Copy a batch into the staging buffer; hand each full buffer to the pipeline."""
        i, b = 0, batch.b
        while i < b:
            k = min(b - i, self.S - self.stage_n)
            for name, arr in batch.acts.items():
                part = self.stage[name][self.stage_n : self.stage_n + k]
                # The one copy, into the buffer that is written, a few examples at a time
                # (about COPY_BYTES), each checksummed right after its copy while still in the
                # CPU's cache (per (example, layer), the block's derived from them) while the
                # pipeline writes: one pass over memory for both.
                step = max(1, COPY_BYTES // max(part[:1].nbytes, 1))
                for j in range(0, k, step):
                    e = min(j + step, k)
                    if isinstance(arr, LayerList):  # the layers as the capture produced them
                        for lp, a in enumerate(arr.layers):
                            part[j:e, lp] = a[i + j : i + e]
                    else:
                        part[j:e] = arr[i + j : i + e]
                    self._add_rows(name, part[j:e])
            self.stage_n += k
            i += k
            if self.stage_n == self.S:
                self._submit(self.stage, self.stage_first, self.stage_n, release=True)
                self.stage_first += self.stage_n
                self.stage_n = self.stage_written = 0
                self.stage = self.buffers.take()

    def _submit(self, buf: dict[str, np.ndarray], first: int, n: int, release: bool) -> None:
        """Write examples first..first+n-1 (the first n rows of `buf`) as one shard file per
        segment. With release=False the buffer stays with the caller, who goes on filling
        rows n.. once the pipeline is drained (a partial shard written at a commit)."""

        def write() -> None:
            for seg, io in self.io.items():
                io.write_shards(first, buf[seg][:n], writeback=self._writeback, durable=self.durable)

        done = (lambda: self.buffers.give_back(buf)) if release else None
        self.pipeline.submit(write, n * self.cfg.example_bytes(), done)

    def flush(self, complete: bool) -> int:
        # A commit covers every appended example: a partly filled shard is written as
        # a whole shard file now and replaced whole once it fills.
        if self.stage_n > self.stage_written:
            self._submit(self.stage, self.stage_first, self.stage_n, release=False)
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
        if self.stage is not None:  # (closed once: a buffer must never be kept twice)
            self.buffers.give_back(self.stage)
            self.stage = None
            self.buffers.close()
