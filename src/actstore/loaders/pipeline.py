"""TokenPipeline: one consumer's background reading and batch assembly for TokenStream.

A reader thread fills windows (actstore/loaders/windows.py: mapped from the page cache
on a local disk, or read into window buffers through a thread pool) while an assembler
thread gathers batches from the previous window straight into a ring of reused buffers
(actstore/loaders/assemble.py) and queues them, so the training loop finds a batch
waiting. The window slots (their buffers), the batch maker (its ring of batch buffers),
the file mappings and the next epoch's first window, read ahead, are the stream's
`Spares` in this process: each pipeline takes them when it starts and hands them back
when it ends, for the next epoch to reuse (memory written before costs no page faults).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actstore.hostmem import ENDED, BoundedQueue
from actstore.loaders.assemble import BatchMaker, OnDevice
from actstore.loaders.buffers import Stopped
from actstore.loaders.plan import EpochPlan, WindowSlice
from actstore.loaders.source import TokenUnits
from actstore.loaders.state import StreamState
from actstore.loaders.windows import MappedFill, ReadFill, WindowSlot
from actstore.storage.mapping import FileRegion

_STOP = object()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # pipelines whose threads may still run
EXIT_WAIT_S = 30.0  # at interpreter exit, the longest wait for all of them together


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, stop every pipeline's threads and wait for them. A reader
    still reading the next epoch's first window when a script ends would otherwise be
    frozen inside native code during finalization, which can abort the process
    ("terminate called without an active exception", exit code 134)."""
    live = list(_LIVE)
    for p in live:
        p.halt()
    deadline = time.monotonic() + EXIT_WAIT_S  # a read stuck on a network gives up the wait, not the exit
    for p in live:
        for t in p.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


@dataclass
class Kept:
    """What an ended pipeline leaves to the next one of its stream in this process."""

    slots: list[WindowSlot] = field(default_factory=list)  # window slots, each keeping its buffer
    maker: BatchMaker | None = None  # the batch maker, with its ring of batch buffers
    ahead: tuple | None = None  # (plan key, window, slot): the next epoch's first window, read
    region: FileRegion | None = None  # the store's files, mapped (kept from epoch to epoch)

    @property
    def empty(self) -> bool:
        return not self.slots and self.maker is None and self.ahead is None and self.region is None


class Spares:
    """One stream's spare buffers in this process, handed from each of its pipelines to the
    next: what the last one kept, or the last one itself while it is still reading the
    next epoch's first window (the spares then wait for it when they are taken)."""

    def __init__(self) -> None:
        self._kept = Kept()
        self._reading: TokenPipeline | None = None  # an ended epoch's pipeline, still reading ahead

    @property
    def reading_ahead(self) -> bool:
        """A pipeline is still reading the next epoch's first window in the background."""
        return self._reading is not None

    def kept(self) -> Kept:
        """What is kept now (waiting for a pipeline still reading ahead)."""
        if self._reading is not None:
            pipe, self._reading = self._reading, None
            self._kept = pipe.finish()
        return self._kept

    def take(self) -> Kept:
        """Everything kept, for a new pipeline; the spares are empty until it hands them back."""
        kept, self._kept = self.kept(), Kept()
        return kept

    def keep(self, kept: Kept) -> None:
        """A stopped pipeline's buffers, unless another pipeline handed its own back first."""
        if self._reading is None and self._kept.empty:
            self._kept = kept

    def keep_reading(self, pipe: TokenPipeline) -> None:
        """The epoch's pipeline ended while reading the next epoch's first window: its buffers
        come when it is done (the next `take` waits for it)."""
        self._reading = pipe

    def discard_read_ahead(self) -> None:
        """Forget the next epoch's first window, read ahead; its slot is kept for reuse."""
        kept = self.kept()
        if kept.ahead is not None:
            kept.ahead[2].release()
            kept.ahead = None

    def release(self) -> None:
        """Give back everything: the buffers go, the batch maker's threads end, the files are unmapped."""
        self.discard_read_ahead()
        kept = self.take()
        if kept.maker is not None:
            kept.maker.close()
        if kept.region is not None:
            kept.region.close()


class TokenPipeline:
    """One consumer's reader and assembler threads, with bounded queues between them.

    Args:
        ts: the stream.
        plan: the epoch's plan.
        windows: the windows this consumer reads.
        skip: batches of those already consumed.
        in_worker: in a DataLoader worker.
        spares: the stream's spare buffers in this process: taken now, handed back at the end.
    """

    def __init__(self, ts: StreamState, plan: EpochPlan, windows: range, skip: int, in_worker: bool, spares: Spares):
        self.ts, self.plan, self.spares = ts, plan, spares
        spare = spares.take()  # (waits for the last epoch's reader, reading this epoch's first window)
        self.maker = spare.maker
        if self.maker is None or self.maker.in_worker != in_worker:
            self.maker = BatchMaker(ts, in_worker)
        self.pool = ThreadPoolExecutor(ts.threads, thread_name_prefix="actstore-read")
        cap = plan.window_tokens + max(s.t_pad for s in ts.segments)
        self.region = _region(ts, spare.region)
        self.mapped = MappedFill(ts, self.region, self.pool) if self.region is not None else None
        self.reads = ReadFill(ts, self.pool, cap)
        n_slots = ts.prefetch + 2  # one being served, one being read, `prefetch` waiting
        # Skip whole windows already consumed; `first` batches of the next are skipped too.
        todo = list(windows)
        while todo and skip >= plan.window_n_batches(todo[0]):
            skip -= plan.window_n_batches(todo.pop(0))
        self.windows, self.first_skip = todo, skip
        # The last epoch's reader may have read this epoch's first window already.
        ahead = spare.ahead
        self.in_main = not in_worker
        use_ahead = (
            ahead is not None and self.in_main and ahead[0] == _plan_key(ts, plan) and todo[:1] == [0] and skip == 0
        )
        if ahead is not None and not use_ahead:
            ahead[2].release()
        kept = [s for s in spare.slots if not (use_ahead and s is ahead[2])]
        kept = [s if s.buf is None or s.buf.shape == (cap, ts.d_model) else WindowSlot() for s in kept]
        self.slots = [
            kept.pop() if kept else WindowSlot()
            for _ in range(min(n_slots, max(len(windows), 1)) - (1 if use_ahead else 0))
        ]
        # Waits on these queues are woken by the other side or by halt(), never polled.
        self.free = BoundedQueue()
        for s in self.slots:
            self.free.put(s)
        self.full = BoundedQueue(ts.prefetch + 1)
        if use_ahead:
            self.slots.append(ahead[2])
            self.full.put((ahead[1], ahead[2]))
            self.windows = todo[1:]
        self.ahead: tuple | None = None
        self.epoch_read = False  # the reader has read every window of this epoch
        self.served = False  # the loop has taken every batch of this epoch
        self.out = BoundedQueue(ts.prefetch_batches)
        self.stop = threading.Event()
        self.maker.started(self.stop)
        self.threads = [
            threading.Thread(
                target=self._guard, args=(self._read_windows, self.full), daemon=True, name="actstore-reader"
            ),
            threading.Thread(target=self._guard, args=(self._assemble, self.out), daemon=True, name="actstore-batches"),
        ]
        _LIVE.add(self)
        for t in self.threads:
            t.start()

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._get(self.out)
            if item is _STOP:
                self.served = not self.stop.is_set()  # every batch of the epoch went out
                return
            if isinstance(item, BaseException):
                raise item
            yield _handed_over(item)

    def close(self) -> None:
        if self.served and self.epoch_read and not self.stop.is_set():
            # The whole epoch was served: the reader may still be reading the next epoch's
            # first window. Let it finish in the background; the next pipeline of this
            # stream waits for it (finish) and takes its buffers.
            self.threads[1].join(timeout=30)
            if not self.threads[1].is_alive():
                self.spares.keep_reading(self)
                return
        self.halt()
        self.spares.keep(self.finish())  # stopped mid-epoch: the next iteration reuses its slots and mappings

    def finish(self) -> Kept:
        """Wait for the threads and return what the next pipeline may reuse: the slots,
        the batch maker and the mappings (nothing when a thread is stuck); windows not
        served are released."""
        for t in self.threads:
            t.join(timeout=30)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if any(t.is_alive() for t in self.threads):
            self.maker.close()
            return Kept()
        ahead_slot = self.ahead[2] if self.ahead is not None else None
        for s in self.slots:
            if s is not ahead_slot:
                s.release()
        return Kept(slots=self.slots, maker=self.maker, ahead=self.ahead, region=self.region)

    # ---- threads ------------------------------------------------------------------
    def halt(self) -> None:
        """Stop the threads: every wait on the queues (and a worker's wait for a slot) ends."""
        self.stop.set()
        for q in (self.free, self.full, self.out):
            q.stop()
        self.maker.wake()

    @staticmethod
    def _get(q: BoundedQueue) -> Any:
        item = q.get()
        return _STOP if item is ENDED else item

    @staticmethod
    def _put(q: BoundedQueue, item: Any) -> bool:
        return q.put(item)

    def _guard(self, target: Any, q: BoundedQueue) -> None:
        try:
            signalled = target()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(q, e)
        else:
            if not signalled:
                self._put(q, _STOP)

    def _read_windows(self) -> bool:
        for j in self.windows:
            slot = self._get(self.free)
            if slot is _STOP:
                return False
            w = self.plan.window(j)
            self._fill(w, slot)
            if not self._put(self.full, (w, slot)):
                slot.release()
                return False
        if not self.in_main:
            return False
        # This epoch is read: tell the assembler, then read the next epoch's first window
        # while the last batches are served, so the next epoch starts without waiting.
        self.epoch_read = True  # before the assembler can end the epoch: close() reads it
        self._put(self.full, _STOP)
        nxt = self.ts.plan(self.plan.epoch + 1)
        if nxt.n_windows and not self.stop.is_set():
            slot = self._get(self.free)
            if slot is not _STOP:
                w = nxt.window(0)
                self._fill(w, slot)
                self.ahead = (_plan_key(self.ts, nxt), w, slot)
        return True

    def _fill(self, w: WindowSlice, slot: WindowSlot) -> None:
        """Window w into `slot`: mapped when the store's files can be, else read."""
        if self.mapped is None or not self.mapped.fill(w, slot):
            self.reads.fill(w, slot)

    def _assemble(self) -> None:
        ts = self.ts
        first = self.first_skip
        while True:
            item = self._get(self.full)
            if item is _STOP or isinstance(item, BaseException):
                if isinstance(item, BaseException):
                    raise item
                return
            w, slot = item
            perm = self.plan.window_permutation(w)
            keys = index = None
            if (ts._norm is not None and len(ts._norm[0]) > 1) or ts.return_index:
                index = _window_index(ts.units, w)
                keys = index[1] * ts.units.n_segments + index[2]
            try:
                for b in range(first, w.n_batches):
                    rows = perm[b * ts.batch_size : (b + 1) * ts.batch_size]
                    batch = self.maker.make(slot, rows, keys)
                    if ts.return_index:
                        batch = _index_dict(batch, ts.units, index, rows)
                    if not self._put(self.out, self.maker.sent(batch)):
                        return
            except Stopped:
                return  # the iteration ended while a worker waited for a free slot
            finally:
                slot.release()
            first = 0
            self.free.put(slot)
            if self.stop.is_set():
                return


def _plan_key(ts: StreamState, plan: EpochPlan) -> tuple[int, int]:
    """What fixes an epoch's windows for one stream (whose store, layers, sizes and ranks
    never change): a window read ahead serves only the same seed and epoch."""
    return (ts.seed, plan.epoch)


def _window_index(units: TokenUnits, w: WindowSlice) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(example, layer position, segment position, token row) of every row of window w."""
    n = (w.hi - w.lo).astype(np.int64)
    ex, li, si = units.decode(w.units)
    rep = lambda a: np.repeat(a, n)  # noqa: E731
    offs = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    tok = rep(w.lo.astype(np.int64)) + offs
    for i in range(len(w.units)):
        rows = units.kept_rows(int(ex[i]), int(si[i]))
        if rows is not None:
            d = int(w.dest[i])
            tok[d : d + n[i]] = rows[w.lo[i] : w.hi[i]]
    return rep(ex), rep(li), rep(si), tok


def _index_dict(acts: Any, units: TokenUnits, index: tuple, rows: np.ndarray) -> dict[str, Any]:
    ex, li, si, tok = (a[rows] for a in index)
    layers = np.asarray(units.layers, dtype=np.int64)
    return {
        "acts": acts,
        "example": torch.from_numpy(ex),
        "layer": torch.from_numpy(layers[li]),
        "segment": torch.from_numpy(si),
        "token": torch.from_numpy(tok),
    }


def _handed_over(batch: Any) -> Any:
    """A batch as the loop receives it: device tensors made safe for its current stream."""
    if isinstance(batch, OnDevice):
        return batch.handed_over()
    if isinstance(batch, dict) and isinstance(batch.get("acts"), OnDevice):
        return {**batch, "acts": batch["acts"].handed_over()}
    return batch


def _region(ts: StreamState, region: FileRegion | None) -> FileRegion | None:
    """The stream's file mappings in this process (kept from epoch to epoch), or None when
    its store's files cannot be mapped (reads then)."""
    if region is not None and region.pid == os.getpid() and region.base is not None:
        return region
    if not ts.mmap or not FileRegion.supported():
        return None
    files = ts.store.mappable_files([s.name for s in ts.segments])
    if files is None:
        return None
    try:
        return FileRegion(ts.d_model * ts.stored_dtype.itemsize, files[1], files[0])
    except OSError:
        return None  # no address space to reserve (ulimit -v): read instead
