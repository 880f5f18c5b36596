"""Batch assembly for TokenStream: a batch's rows gathered from its window's source
straight into the batch buffer (a ring of reused buffers, pinned for an accelerator),
then, only when asked, converted, normalised and moved to the device.

The gather is the only copy of a token on the warm mapped path (page cache -> batch
buffer). It runs in numpy (`np.take` of opaque rows: one memcpy per row, without the
GIL, no OpenMP pool), split over `gather_threads` threads.

Device batches: the rows go to a pinned buffer, which is copied to the device with
`non_blocking=True` on a side stream (actstore.hostmem.DeviceCopy); a CUDA event recorded
after the copy (and after any conversion there) is waited on by the consumer's current
stream before it sees the batch, and the pinned buffer is reused only once that event has
completed.

In a TokenLoader's DataLoader worker the batch stays in the stored dtype (float16 for
most stores: half the bytes of float32 cross shared memory) and goes with the rows'
normalisation keys; the main process casts and normalises it (TokenLoader._received), on
the device when there is one. Elsewhere the cast and normalisation run here
(actstore.read.normalize.normalize_into).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from actstore.hostmem import DeviceCopy, hand_over
from actstore.loaders.buffers import TORCH_DTYPES, BufferRing, WorkerBatch, WorkerRing
from actstore.loaders.state import StreamState
from actstore.loaders.windows import WindowSlot, void_rows
from actstore.read.normalize import normalize_into

SPLIT_ROWS = 256  # rows one gather thread takes at a time


class OnDevice(NamedTuple):
    """A batch on an accelerator and the event its copy (and conversion) recorded."""

    acts: torch.Tensor
    ready: Any

    def handed_over(self) -> torch.Tensor:
        """The tensor, made safe for the calling thread's current stream."""
        hand_over([self.acts], self.ready)
        return self.acts


class BatchMaker:
    """Builds one consumer's batches (see the module docstring).

    Args:
        ts: the stream (batch size, dtypes, normalisation, pin_memory, device).
        in_worker: inside a DataLoader worker: batches go to fresh shared memory, on the CPU.
        ring: the ring of a previous epoch of this stream, to reuse.
    """

    def __init__(self, ts: StreamState, in_worker: bool, ring: BufferRing | WorkerRing | None = None):
        self.ts, self.in_worker = ts, in_worker
        dev = None if in_worker else ts.device
        self.device = dev if dev is not None and dev.type != "cpu" else None
        stored = TORCH_DTYPES[ts.store.dtype]
        info = get_worker_info() if in_worker else None
        # Under a TokenLoader a worker ships the stored dtype and the keys; the main process converts.
        self.ships_stored = info is not None and ts._worker_slots is not None
        dtype = stored if self.device is not None or self.ships_stored else ts.dtype
        self.norm = None if self.ships_stored else ts._norm
        self.last_keys: np.ndarray | None = None
        self.worker = info.id if info is not None else None
        if info is not None and ts._worker_slots is not None:  # under a TokenLoader: reused shared slots
            if not (isinstance(ring, WorkerRing) and ring.dtype == dtype and ring.shared_slots is ts._worker_slots):
                ring = WorkerRing(ts._worker_slots, info.id, dtype)
        else:
            pin = self.device is not None or (ts.pin_memory and not in_worker)
            if not isinstance(ring, BufferRing) or ring.dtype != dtype or ring.pin != pin or ring.shared != in_worker:
                ring = BufferRing(ts.prefetch_batches + 4, dtype, pin=pin, shared=in_worker)
        self.ring = ring
        self.scratch = torch.empty((ts.batch_size, ts.d_model), dtype=stored) if dtype != stored else None
        n_gather = _gather_threads(ts.gather_threads, info.num_workers if info is not None else 0)
        self.helper = ThreadPoolExecutor(n_gather - 1, thread_name_prefix="actstore-gather") if n_gather > 1 else None
        self.n_gather = n_gather
        self.copy = DeviceCopy(self.device) if self.device is not None else None
        self._norm_dev: tuple[torch.Tensor, torch.Tensor] | None = None

    def started(self, stop: threading.Event) -> None:
        """A new iteration of this consumer: a worker's slots are all free again (the
        DataLoader discarded the last iteration's batches), and waiting for one ends with `stop`."""
        if isinstance(self.ring, WorkerRing):
            self.ring.clear()
            self.ring.stop = stop

    def wake(self) -> None:
        """End a worker's wait for a free slot (the iteration's `stop` is set)."""
        if isinstance(self.ring, WorkerRing):
            self.ring.wake()

    def sent(self, batch: Any) -> Any:
        """The batch as the consumer hands it on: from a worker's reused slot, with its number."""
        if isinstance(self.ring, WorkerRing):
            return WorkerBatch(self.worker, self.ring.last, batch, self.last_keys)
        return batch

    def close(self) -> None:
        if self.helper is not None:
            self.helper.shutdown(wait=True)

    def make(self, slot: WindowSlot, rows: np.ndarray, keys: np.ndarray | None) -> torch.Tensor | OnDevice:
        """The batch of window rows `rows` (keys: per window row normalisation keys)."""
        ts = self.ts
        out = self.ring.take((len(rows), ts.d_model))
        dst = out if self.scratch is None else self.scratch[: len(rows)]
        self.gather(slot, rows, void_rows(_numpy_view(dst)))
        if self.ships_stored:  # the main process converts: it needs the rows' keys
            several = ts._norm is not None and len(ts._norm[0]) > 1
            self.last_keys = keys[rows] if several and keys is not None else None
            return out
        if self.device is not None:
            return self._to_device(out, rows, keys)
        if self.scratch is None and self.norm is None:
            return out
        shift, scale = (torch.from_numpy(t) for t in self.norm) if self.norm is not None else (None, None)
        k_rows = torch.from_numpy(keys[rows]) if keys is not None and shift is not None else None
        return normalize_into(out, dst, shift, scale, k_rows)

    def gather(self, slot: WindowSlot, rows: np.ndarray, dst: np.ndarray) -> None:
        """dst[j] = the row of window row rows[j]: one memcpy per row, from the page cache
        (mapped windows) or the window buffer (read windows)."""
        src = slot.rows
        idx = rows if slot.index is None else slot.index[rows]
        if self.helper is None or len(idx) < 2 * SPLIT_ROWS:
            np.take(src, idx, axis=0, out=dst, mode="clip")  # rows are in range: no check needed
            return
        job = _Split(src, idx, dst)
        for _ in range(self.n_gather - 1):
            self.helper.submit(job.work)
        job.work()
        job.wait()

    def _to_device(self, out: torch.Tensor, rows: np.ndarray, keys: np.ndarray | None) -> OnDevice:
        k = torch.from_numpy(keys[rows]) if keys is not None and self.norm is not None else None
        convert = device_step(self.ts, self.device, self._norm_cache, k)
        (acts,), ready = self.copy.to_device([out], then=convert)  # from pinned memory: asynchronous
        self.ring.hold(ready)  # the pinned buffer is reused only once the copy is done
        return OnDevice(acts, ready)

    def _norm_cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.norm is not None and self._norm_dev is None:
            self._norm_dev = tuple(torch.from_numpy(t).to(self.device) for t in self.norm)
        return self._norm_dev


def device_step(ts: StreamState, device: Any, tables: Any, keys: torch.Tensor | None) -> Any:
    """What runs on the device after a batch's copy (on the copy's side stream): the cast to
    the stream's dtype and the normalisation, with `tables()` the (shift, scale) on the
    device (or None) and `keys` the rows' normalisation keys (CPU, or None)."""

    def convert(moved: list[torch.Tensor]) -> list[torch.Tensor]:
        acts = moved[0]
        if acts.dtype != ts.dtype:
            acts = acts.to(ts.dtype)
        norm = tables()
        if norm is not None:
            k = keys.to(device) if keys is not None else None  # (small: from pageable memory)
            normalize_into(acts, acts, norm[0], norm[1], k)
        return [acts, *moved[1:]]

    return convert


class _Split:
    """One batch's gather in pieces of SPLIT_ROWS rows, taken by whichever thread is free:
    a helper that is not scheduled soon leaves its pieces to the others instead of
    holding the batch back (wait() waits only for pieces already taken)."""

    def __init__(self, src: np.ndarray, idx: np.ndarray, dst: np.ndarray):
        self.src, self.idx, self.dst = src, idx, dst
        self.next, self.n = 0, -(-len(idx) // SPLIT_ROWS)
        self.running = 0
        self.cond = threading.Condition()

    def work(self) -> None:
        while True:
            with self.cond:
                k = self.next
                if k >= self.n:
                    return
                self.next, self.running = k + 1, self.running + 1
            a, b = k * SPLIT_ROWS, (k + 1) * SPLIT_ROWS
            try:
                np.take(self.src, self.idx[a:b], axis=0, out=self.dst[a:b], mode="clip")
            finally:
                with self.cond:
                    self.running -= 1
                    self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            while self.running:
                self.cond.wait()


def _gather_threads(asked: int, n_workers: int) -> int:
    """Gather threads of one consumer: as asked in the main process; in a DataLoader worker
    at most the cores per worker (the workers are the parallelism: more threads than cores
    only crowd out each other, the main process and the training loop)."""
    if not n_workers:
        return asked
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(asked, cores // (n_workers + 1)))


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """The numpy array sharing `t`'s memory (bfloat16 as its uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
