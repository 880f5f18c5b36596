"""Host buffers reused batch after batch: the one copy of a captured batch lands here.

A `Ring` holds up to `n` slots, each one flat byte buffer (pinned memory for a CUDA
model, so that the device-to-host copies run asynchronously) carved into the batch's
arrays: per segment (L, b, T_pad, D) in the stored dtype, and the batch's statistics.
The forward thread takes a slot and fills it; the writer lends its rows to the shard
files and gives the slot back once they are written (a Zarr shard file of S examples
holds the slots of its batches: the stage adds three shard files' worth of slots to
the queue's). A slot is allocated once and reused; one too
small for a batch is replaced; a finished ring's slots serve the process's next one
(allocating pinned memory, or faulting in fresh pages, costs more than copying into
them). Beyond those, n = queue_size + 2 (one filling, queue_size queued, one being
appended): the forward thread waits here only while the storage is behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


SPARE_BYTES = 4 * 2**30  # slots kept for the next ring of this process (allocating pinned memory is slow)
_spare: list[Slot] = []
_spare_lock = threading.Lock()


class Slot:
    """One flat buffer and the views of the batch it holds."""

    def __init__(self, nbytes: int, pinned: bool):
        import torch

        self.nbytes = nbytes
        self.pinned = pinned
        if pinned:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # CUDA: page-locked
        else:  # numpy's large allocations are advised to use huge pages: faulted in far faster
            self.buf = torch.from_numpy(np.empty(nbytes, np.uint8))

    def carve(self, shapes: list[tuple[tuple[int, ...], Any]]) -> list[Any]:
        """Tensors of (shape, torch dtype), laid one after another (64-byte aligned)."""
        out, at = [], 0
        for shape, dtype in shapes:
            n = int(np.prod(shape)) * dtype.itemsize
            out.append(self.buf[at : at + n].view(dtype).view(shape))
            at += -(-n // 64) * 64
        return out


def slot_bytes(shapes: list[tuple[tuple[int, ...], Any]]) -> int:
    return sum(-(-int(np.prod(s)) * d.itemsize // 64) * 64 for s, d in shapes)


class Ring:
    """Up to `n` reusable slots (pinned when `pinned`)."""

    def __init__(self, n: int, pinned: bool):
        self.n = n
        self.pinned = pinned
        self._made = 0
        self._free: queue.Queue[Slot] = queue.Queue()

    def take(self, nbytes: int, check: Callable[[], None] = lambda: None) -> Slot:
        """A free slot of at least `nbytes`; waits while all are in use, calling `check`
        (which raises the writer's error) every half second."""
        slot = None
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            if self._made < self.n:
                self._made += 1
                return _reuse(nbytes, self.pinned) or Slot(nbytes, self.pinned)
        while slot is None:
            try:
                slot = self._free.get(timeout=0.5)
            except queue.Empty:
                check()
        return slot if slot.nbytes >= nbytes else Slot(nbytes, self.pinned)  # (the small one is freed)

    def give_back(self, slot: Slot) -> None:
        self._free.put(slot)

    def close(self) -> None:
        """Keep the free slots for this process's next ring (up to SPARE_BYTES)."""
        while True:
            try:
                slot = self._free.get_nowait()
            except queue.Empty:
                return
            with _spare_lock:
                if sum(x.nbytes for x in _spare) + slot.nbytes <= SPARE_BYTES:
                    _spare.append(slot)


def _reuse(nbytes: int, pinned: bool) -> Slot | None:
    """A spare slot of a finished ring that fits (the smallest), or None."""
    with _spare_lock:
        fits = [x for x in _spare if x.pinned == pinned and x.nbytes >= nbytes]
        if not fits:
            return None
        slot = min(fits, key=lambda x: x.nbytes)
        _spare.remove(slot)
        return slot
