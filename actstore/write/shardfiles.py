"""ShardFiles: Zarr format 3 shard files written whole by a background thread.

A writer gathers S examples into a staging buffer, then writes them as one shard file.
The full buffer goes to a thread that writes (or uploads) the file while the appending
thread fills and checksums the next buffer: converting, screening and checksumming the
next batches overlaps the storage. Buffers are reused (at most `n_buffers` per segment
exist), so memory stays bounded and slow storage makes `take_buffer` wait.

A commit covers every appended example: a partly filled shard is written as a whole
shard file then, and replaced whole once it fills. A write error is kept and raised by
the next `check`/`drain` on the appending thread; the shard's last commit is untouched
(a partial shard file lies past it and a resume drops it).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from actstore.chunkio import ChunkIO
from actstore.layout.config import StoreConfig
from actstore.storage import Writeback
from actstore.write.batch import Batch
from actstore.write.layouts import Layout


class BackgroundShardFiles:
    """One writer thread for the shard files of every segment of one writer shard.

    Args:
        io: {segment: ChunkIO} of sharded arrays (shard_examples S).
        shapes: {segment: (L, T_pad, D)} of one example.
        dtype: the stored numpy dtype.
        writeback: the storage's writeback helper (a local disk's), or None.
        n_buffers: staging buffers per segment (one filling, the others queued or writing).
    """

    def __init__(self, io: dict[str, ChunkIO], shapes: dict[str, tuple[int, ...]], dtype: np.dtype,
                 writeback: Writeback | None, n_buffers: int = 3):
        self.io = io
        self.shapes = shapes
        self.dtype = np.dtype(dtype)
        self.S = next(iter(io.values())).geo.shard_examples
        self.n_buffers = n_buffers
        self._allocated = 0
        self._free: queue.Queue = queue.Queue()
        self._todo: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        # Starting each file's writeback is kernel work of its own: a second thread does
        # it while this one copies the next file into the page cache.
        self._writeback = writeback
        self._thread = threading.Thread(target=self._run, name="actstore-shard-files", daemon=True)
        self._thread.start()

    def take_buffer(self) -> dict[str, np.ndarray]:
        """An empty staging buffer {segment: (S, L, T_pad, D)}; waits while all are in use."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._allocated < self.n_buffers:
            self._allocated += 1
            return {s: np.empty((self.S, *shape), self.dtype) for s, shape in self.shapes.items()}
        return self._free.get()

    def submit(self, buf: dict[str, np.ndarray], first_ex: int, n: int, release: bool = True) -> None:
        """Write examples first_ex..first_ex+n-1 (the first n rows of `buf`) as one shard file.

        With release=False the buffer stays with the caller, who goes on filling rows n..
        (a partial shard written at a commit, replaced whole once the shard fills).
        """
        self._todo.put((buf, first_ex, n, release))

    def check(self) -> None:
        """Raise the error of a failed background write, if any."""
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        """Wait until every submitted shard file is written; raise a write error."""
        self._todo.join()
        self.check()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()
        if self._writeback is not None:
            self._writeback.close()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            try:
                if item is None:
                    return
                buf, first, n, release = item
                if self.error is None:
                    try:
                        for seg, io in self.io.items():
                            io.write_shards(first, buf[seg][:n], writeback=self._writeback)
                    except BaseException as e:  # noqa: BLE001 - handed to the appending thread
                        self.error = e
                if release:
                    self._free.put(buf)
            finally:
                self._todo.task_done()


class ShardFiles(Layout):
    """Format 3 Zarr shard files of S examples, staged here and written in the background."""

    background = True
    files = "shard files"

    def __init__(self, cfg: StoreConfig, io: dict[str, ChunkIO], n_written: int, writeback: Writeback | None):
        super().__init__(cfg)
        self.io = io
        shapes = {s.name: (cfg.n_layers, s.n_chunks * s.t_chunk, cfg.d_model) for s in cfg.segments}
        self.bg = BackgroundShardFiles(io, shapes, np.dtype(cfg.zarr_dtype), writeback)
        self.S = cfg.shard_examples
        self.stage = self.bg.take_buffer()
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
        self.bg.check()

    def append(self, batch: Batch, n0: int) -> None:
        """Copy a batch into the staging buffer; hand each full buffer to the background thread."""
        i, b = 0, batch.b
        while i < b:
            k = min(b - i, self.S - self.stage_n)
            for name, arr in batch.acts.items():
                part = self.stage[name][self.stage_n : self.stage_n + k]
                part[...] = arr[i : i + k]
                # Checksums here, on rows just copied (in cache), while the background
                # thread writes: per (example, layer), the block's derived from them.
                self._add_rows(name, part)
            self.stage_n += k
            i += k
            if self.stage_n == self.S:
                self.bg.submit(self.stage, self.stage_first, self.stage_n)
                self.stage_first += self.stage_n
                self.stage_n = self.stage_written = 0
                self.stage = self.bg.take_buffer()

    def flush(self, complete: bool) -> int:
        # A commit covers every appended example: a partly filled shard is written as
        # a whole shard file now and replaced whole once it fills.
        if self.stage_n > self.stage_written:
            self.bg.submit(self.stage, self.stage_first, self.stage_n, release=False)
            self.stage_written = self.stage_n
        self.bg.drain()
        return self.stage_first + self.stage_n

    @classmethod
    def first_stale(cls, cfg: StoreConfig, n: int) -> int:
        # A partly filled shard file at n // S holds committed examples: it stays (whole).
        return -(-n // cfg.shard_examples)

    def close(self) -> None:
        self.bg.stop()
