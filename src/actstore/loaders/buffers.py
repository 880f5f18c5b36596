"""Output buffers for the loaders: reused when safe, in workers too.

Writing a batch into memory that was written before costs no page faults (about 1.5 ms
per 6 MB on a VM); a fresh allocation does. A slot of the ring is reused only when no
tensor or array viewing it is alive anywhere in the process, so a batch the caller keeps
is never overwritten.

In a DataLoader worker, a batch goes to shared memory, which the DataLoader hands to the
main process by handle. Under a TokenLoader (WorkerRing) a worker's shared slots are
allocated once and reused once the main process has copied a batch out of its slot (it
says so in a flags tensor shared with the workers); a worker under a plain DataLoader
takes fresh shared memory for every batch (BufferRing(shared=True)), since nothing tells
it when the main process is done with one.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from actstore.hostmem import HostBuffer, shared_empty, unreferenced

TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for CPU tensors of one dtype and shape, on this thread (numpy's copy:
    torch's copy_ of a large tensor wakes its OpenMP pool, whose spinning threads cost
    several times the copy itself, on the cores the workers and the training loop use)."""
    if dst.dtype == torch.bfloat16:
        dst, src = dst.view(torch.int16), src.view(torch.int16)
    np.copyto(dst.numpy(), src.numpy())


class BufferRing:
    """`n` reusable slots of one dtype; `take(shape)` gives a tensor of that shape.

    Args:
        n: slots (how many batches may be in flight before one is reused).
        dtype: element type.
        pin: allocate slots in pinned memory.
        shared: always hand out fresh shared memory (inside DataLoader workers).
    """

    def __init__(self, n: int, dtype: torch.dtype, *, pin: bool = False, shared: bool = False):
        self.slots: list[torch.Tensor | None] = [None] * n  # each a whole HostBuffer's tensor
        self.events: list = [None] * n  # per slot: an event that must complete before reuse
        self.dtype, self.pin, self.shared = dtype, pin, shared
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.next = 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.shared:
            return shared_empty(shape, self.dtype)
        numel = int(np.prod(shape))
        i = self.next % len(self.slots)
        self.next += 1
        if self.events[i] is not None:
            self.events[i].synchronize()  # an asynchronous copy out of this slot may still run
            self.events[i] = None
        t = self.slots[i]
        if t is None or t.numel() < numel or not unreferenced(t):
            # The batch this slot held is still alive somewhere: leave it, take new memory.
            nbytes = numel * self.itemsize
            t = HostBuffer(nbytes, "pinned" if self.pin else "plain").tensor.view(self.dtype)
            self.slots[i] = t
        return t[:numel].view(shape)

    def hold(self, event: object) -> None:
        """The slot last taken is not reused before `event` (anything with synchronize(),
        e.g. a CUDA event recorded after a non_blocking copy from it) has completed."""
        if not self.shared:
            self.events[(self.next - 1) % len(self.slots)] = event


class WorkerBatch(NamedTuple):
    """A batch a worker sent from its slot `slot` (the main process copies it out, then
    frees the slot: actstore.loaders.tokenloader), in the stored dtype; `keys`: its rows'
    normalisation keys when the stream normalises with several (else None)."""

    worker: int
    slot: int
    batch: Any
    keys: Any = None


class WorkerRing:
    """A DataLoader worker's reused shared-memory slots, under a TokenLoader.

    Slot i of worker w is free when flags[w, i] is 0; `take` marks it busy (1) and the main
    process sets it back to 0 once it has copied the batch out (TokenLoader). A worker
    clears its flags when it starts an iteration: the DataLoader has then discarded every
    batch of the previous one.

    Args:
        flags: (workers, slots) int8 tensor in shared memory.
        worker: this worker's id.
        dtype: element type.
    """

    POLL_S = 0.0005  # wait between looks at a busy slot (the main process is copying it out)

    def __init__(self, flags: torch.Tensor, worker: int, dtype: torch.dtype):
        self.flags, self.worker, self.dtype = flags, worker, dtype
        self.slots: list[torch.Tensor | None] = [None] * flags.shape[1]
        self.next = 0
        self.last = -1  # the slot last taken (its batch carries the number to the main process)
        self.stop: threading.Event | None = None  # set: stop waiting (the iteration ended)
        self.pin, self.shared = False, False  # what BatchMaker compares with a BufferRing's

    def clear(self) -> None:
        self.flags[self.worker].zero_()

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        i = self.next % len(self.slots)
        self.next += 1
        flag = self.flags[self.worker, i]
        while int(flag):  # still being copied out by the main process: wait (backpressure)
            if self.stop is not None and self.stop.is_set():
                raise Stopped()
            time.sleep(self.POLL_S)
        numel = int(np.prod(shape))
        t = self.slots[i]
        if t is None or t.numel() < numel:
            t = self.slots[i] = shared_empty((numel,), self.dtype)
        flag.fill_(1)
        self.last = i
        return t[:numel].view(shape)

    def hold(self, event: Any) -> None:
        """Nothing to wait for: worker batches never go to a device from the worker."""


class Stopped(Exception):
    """A worker's iteration ended while it waited for a slot."""
