"""The writer thread of a capture: batches queue (bounded) while the forward pass runs on.

`record()` (actstore.capture.loop) hands each staged batch to a `Drain`, whose thread runs
the writer side (actstore.capture.sink: append, commit) with a lowered priority.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from actstore.errors import CaptureError
from actstore.hostmem import ENDED, BoundedQueue


class Drain:
    """A bounded queue drained by one background thread running `work`."""

    def __init__(
        self,
        work: Callable[[Any], None],
        maxsize: int,
        start: Callable[[], None] | None = None,
        nice: int = 0,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        if maxsize < 1:
            raise ValueError(f"queue_size must be a positive int. Got {maxsize!r}.")
        self._q = BoundedQueue(maxsize)  # a put waits for room, woken by the writer's get or error
        self._on_error = on_error  # also told the writer's error (a wait for a free slot ends with it)
        self._work = work
        self._start = start
        self._nice = nice
        self.error: BaseException | None = None
        self.wait_seconds = 0.0
        self.busy_seconds = 0.0
        self.cpu_seconds = 0.0  # the writer thread's own CPU time
        self._thread = threading.Thread(target=self._loop, name="actstore-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        c0 = time.thread_time()
        try:
            self._run()
        finally:
            self.cpu_seconds = time.thread_time() - c0

    def _run(self) -> None:
        lower_priority(self._nice)
        if self._start is not None:
            t = time.perf_counter()
            try:
                self._start()
            except BaseException as e:  # noqa: BLE001 - handed to the forward thread
                self._fail(e)
            self.busy_seconds += time.perf_counter() - t
        while True:
            item = self._q.get()
            if item is ENDED:
                return
            if self.error is None:
                t = time.perf_counter()
                try:
                    self._work(item)
                except BaseException as e:  # noqa: BLE001 - handed to the forward thread
                    self._fail(e)
                self.busy_seconds += time.perf_counter() - t
            elif hasattr(item, "release"):
                item.release()  # skipped after an error: its buffer goes back

    def _fail(self, error: BaseException) -> None:
        """The writer thread's error: kept, and waking the forward thread's waits."""
        self.error = error
        self._q.fail(error)
        if self._on_error is not None:
            self._on_error(error)

    def check(self) -> None:
        """Raise the writer thread's error, if any."""
        if self.error is not None:
            raise self.error

    def put(self, item: Any) -> None:
        if self.error is not None:
            raise self.error
        t = time.perf_counter()
        self._q.put(item)  # raises the writer's error, at once if it comes while waiting
        self.wait_seconds += time.perf_counter() - t

    def close(self) -> None:
        self._q.close()
        self._thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        if self.error is None:
            self.error = CaptureError("aborted")
        for item in self._q.clear():
            if hasattr(item, "release"):
                item.release()  # never written: its buffer goes back
        self._q.close()
        self._thread.join()


def lower_priority(nice: int) -> None:
    """Lower the calling (writer) thread's priority by `nice` (Linux: per thread) so that it
    yields the cores to the model's threads and runs in their gaps; the bounded queue keeps
    it from falling behind (when it is full, the model waits and the writer gets the cores)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass  # not permitted here: run at the normal priority
