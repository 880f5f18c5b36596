"""Whole Zarr shard files written on a background thread while the writer goes on appending.

With Zarr sharding a writer gathers S examples into a staging buffer, then writes them as
one shard file. Here the full buffer goes to a thread that writes the file while the
appending thread fills (and checksums) the next buffer: converting, screening and
checksumming the next batches overlaps the disk. Buffers are reused (at most `n_buffers` per
segment exist), so memory stays bounded and a slow disk makes `take_buffer` wait.

A write error is kept and raised by the next `check`/`drain` on the appending thread; the
shard's last commit is untouched (a partial shard file lies past it and a resume drops it).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from actstore.chunkio import ChunkLayout, Writeback


class BackgroundShardFiles:
    """One writer thread for the shard files of every segment of one writer shard.

    Args:
        layouts: {segment: ChunkLayout} of sharded arrays (shard_examples S).
        shapes: {segment: (L, T_pad, D)} of one example.
        dtype: the stored numpy dtype.
        n_buffers: staging buffers per segment (one filling, the others queued or writing).
    """

    def __init__(self, layouts: dict[str, ChunkLayout], shapes: dict[str, tuple[int, ...]], dtype: np.dtype, n_buffers: int = 3):
        self.layouts = layouts
        self.shapes = shapes
        self.dtype = np.dtype(dtype)
        S = next(iter(layouts.values())).shard_examples
        assert S is not None
        self.S = S
        self.n_buffers = n_buffers
        self._allocated = 0
        self._free: queue.Queue = queue.Queue()
        self._todo: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        # Starting each file's writeback is kernel work of its own: a second thread does
        # it while this one copies the next file into the page cache.
        self._writeback = Writeback()
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
                        self._write(buf, first, n)
                    except BaseException as e:  # noqa: BLE001 - handed to the appending thread
                        self.error = e
                if release:
                    self._free.put(buf)
            finally:
                self._todo.task_done()

    def _write(self, buf: dict[str, np.ndarray], first: int, n: int) -> None:
        for seg, lay in self.layouts.items():
            lay.write_shards(first, buf[seg][:n], writeback=self._writeback)
