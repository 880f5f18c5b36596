"""The write path's I/O stage: whole objects written or uploaded by background threads.

One design for every layout and every storage. The appending thread runs the CPU stages
(convert, screen, copy into staging, checksums) and hands whole objects (a chunk file, a
Zarr shard file) to a `WritePipeline`, whose threads write them (a local file: written,
then its writeback started) or upload them (an object store: one put each; large objects
go in parts, in parallel, with obstore's retries on 5xx, throttling and dropped
connections). The CPU stages of the next objects overlap the I/O of the last ones, and
more threads serve more cores (the page-cache copy of local writes is CPU work too) or
more connections.

Memory is bounded: `submit` waits while `max_bytes` of submitted objects are unwritten,
and the caller's staging buffers are handed over, never copied (a task releases its
buffer when its object is in). An I/O error is kept and raised on the appending thread
by the next `check`, `wait` or `drain`; work submitted after it is skipped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from actstore.storage import Storage

LOCAL_THREADS = max(2, min(4, os.cpu_count() or 2))  # file writes: the page-cache copy is CPU work
REMOTE_THREADS = 8  # object puts in flight (each large one also uploads its parts in parallel)
MAX_BYTES = 512 * 2**20  # bytes submitted and not yet written, per writer


@dataclass(frozen=True)
class IOStats:
    """What a pipeline has done, for progress output."""

    pending_bytes: int  # submitted, not yet written (held in memory)
    peak_pending_bytes: int
    max_bytes: int
    written_bytes: int
    objects: int
    waited_seconds: float  # the appending thread's wait for memory (the I/O did not keep up)
    remote: bool


class WritePipeline:
    """Background writes of whole objects with bounded memory.

    Args:
        storage: where the objects go (its kind picks the default thread count).
        threads: concurrent writes; default LOCAL_THREADS for a local disk, REMOTE_THREADS
            for an object store.
        max_bytes: bytes submitted and not yet written before `submit` waits.
    """

    def __init__(self, storage: Storage, *, threads: int | None = None, max_bytes: int = MAX_BYTES):
        self.remote = storage.local_root is None
        self.threads = threads or (REMOTE_THREADS if self.remote else LOCAL_THREADS)
        self.max_bytes = int(max_bytes)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-io")
        self._cond = threading.Condition()
        self._pending = 0
        self._peak = 0
        self._written = 0
        self._objects = 0
        self._waited = 0.0
        self._futures: list[Future] = []
        self.error: BaseException | None = None

    def submit(self, write: Callable[[], None], nbytes: int, done: Callable[[], None] | None = None) -> Future:
        """Run `write()` on an I/O thread; `done()` runs after it, failed or not (e.g. to
        release the staging buffer it wrote from). Waits while the pipeline holds
        `max_bytes` (an object larger than that is admitted alone)."""
        self.check()
        with self._cond:
            if self._pending and self._pending + nbytes > self.max_bytes:
                t = time.perf_counter()
                while self._pending and self._pending + nbytes > self.max_bytes:
                    self._cond.wait()
                self._waited += time.perf_counter() - t
            self._pending += nbytes
            self._peak = max(self._peak, self._pending)
        fut = self._pool.submit(self._run, write, nbytes, done)
        self._futures.append(fut)
        if len(self._futures) > 8 * self.threads:
            self._futures = [f for f in self._futures if not f.done()]
        return fut

    def _run(self, write: Callable[[], None], nbytes: int, done: Callable[[], None] | None) -> None:
        ok = False
        try:
            if self.error is None:  # after a failure nothing more is written
                write()
                ok = True
        except BaseException as e:  # noqa: BLE001 - raised on the appending thread
            if self.error is None:
                self.error = e
        finally:
            with self._cond:
                self._pending -= nbytes
                if ok:
                    self._written += nbytes
                    self._objects += 1
                self._cond.notify_all()
            if done is not None:
                done()

    def check(self) -> None:
        """Raise the first I/O error, if any."""
        if self.error is not None:
            raise self.error

    def wait(self, futures: Iterable[Future]) -> None:
        """Wait for these writes, the only ones in flight; raise the first I/O error and
        forget it (it concerned these writes alone: later ones go ahead)."""
        for f in futures:
            _wait(f)
        error, self.error = self.error, None
        if error is not None:
            raise error

    def drain(self) -> None:
        """Wait for every write submitted so far; raise the first I/O error."""
        futures, self._futures = self._futures, []
        for f in futures:
            _wait(f)
        self.check()

    def stats(self) -> IOStats:
        with self._cond:
            return IOStats(
                self._pending, self._peak, self.max_bytes, self._written, self._objects, self._waited, self.remote
            )

    def close(self) -> None:
        """Finish what was submitted (errors stay in `error`) and stop the threads."""
        self._pool.shutdown(wait=True)


def _wait(f: Future) -> None:
    """Wait for a write; its error, if any, is in the pipeline's `error`."""
    try:
        f.result()
    except BaseException:  # noqa: BLE001 - _run keeps errors; a cancelled future has none
        pass
