"""Output buffers for the loaders: reused when safe, in workers too.

Writing a batch into memory that was written before costs no page faults (about 1.5 ms
per 6 MB on a VM); a fresh allocation does. A slot of the ring is reused only when no
tensor or array viewing it is alive anywhere in the process, so a batch the caller keeps
is never overwritten.

In a DataLoader worker, a batch goes to shared memory, which the DataLoader hands to the
main process by handle. Under a TokenLoader (WorkerRing) a worker's shared slots are
allocated once and reused once the main process has copied a batch out of its slot (it
says so in a flags tensor shared with the workers, and wakes a worker waiting for the
slot: WorkerSlots); a worker under a plain DataLoader
takes fresh shared memory for every batch (BufferRing(shared=True)), since nothing tells
it when the main process is done with one.
"""

from __future__ import annotations

import multiprocessing
import threading
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


class WorkerSlots:
    """Which of a TokenLoader's workers' shared-memory slots are busy, and a wait for one.

    Slot i of worker w is busy while flags[w, i] is 1 (a worker's WorkerRing sets it, the
    main process clears it once it has copied the batch out: `give_back`). A worker that
    finds its next slot busy blocks on its semaphore, which every `give_back` of one of its
    slots releases (and its own `wake`: its iteration ended); nothing is polled. The flags
    stay the truth: a wake-up for another reason only makes the worker look again.
    Semaphores, not a shared lock: a process killed mid-call can block no other.

    Made in the main process with the DataLoader's start method (`context`), and handed to
    the workers when they start.

    Args:
        n_workers, n_slots: the DataLoader's workers, and slots per worker.
        context: a multiprocessing context, start method name or None (the default one).
    """

    def __init__(self, n_workers: int, n_slots: int, context: Any = None):
        if context is None or isinstance(context, str):
            context = multiprocessing.get_context(context)
        self.flags = torch.zeros((n_workers, n_slots), dtype=torch.int8).share_memory_()
        self.freed = [context.Semaphore(0) for _ in range(n_workers)]  # one release per slot given back

    @property
    def n_slots(self) -> int:
        return int(self.flags.shape[1])

    def busy(self) -> int:
        """Slots of all workers not handed back."""
        return int(self.flags.sum())

    def give_back(self, worker: int, slot: int) -> None:
        """The main process copied the batch out of `slot`: the worker may reuse it."""
        self.flags[worker, slot] = 0
        self.freed[worker].release()  # after the flag: a woken worker sees the slot free

    def wait(self, worker: int, slot: int, stop: threading.Event | None) -> None:
        """Block until `slot` of `worker` is free; Stopped once `stop` is set (and woken)."""
        flag = self.flags[worker, slot]
        while int(flag):  # still being copied out by the main process: wait (backpressure)
            if stop is not None and stop.is_set():
                raise Stopped()
            self.freed[worker].acquire()  # woken by a give_back of this worker's slots, or by wake()
        self._drain(worker)  # wake-ups for slots found free without waiting: none left to spin on

    def wake(self, worker: int) -> None:
        """Wake `worker`'s wait (from the worker itself: its iteration ended, `stop` is set)."""
        self.freed[worker].release()

    def clear(self, worker: int) -> None:
        """A new iteration of `worker`: every slot free (the DataLoader dropped the last one's batches)."""
        self.flags[worker].zero_()
        self._drain(worker)

    def _drain(self, worker: int) -> None:
        while self.freed[worker].acquire(False):
            pass


class WorkerRing:
    """A DataLoader worker's reused shared-memory slots, under a TokenLoader (see WorkerSlots).

    `take` gives the next slot in turn, waiting (blocked, not polling) while the main
    process is still copying a batch out of it; marks it busy. A worker clears its flags
    when it starts an iteration: the DataLoader has then discarded every batch of the
    previous one.

    Args:
        slots: the loader's WorkerSlots (in shared memory).
        worker: this worker's id.
        dtype: element type.
    """

    def __init__(self, slots: WorkerSlots, worker: int, dtype: torch.dtype):
        self.shared_slots, self.worker, self.dtype = slots, worker, dtype
        self.slots: list[torch.Tensor | None] = [None] * slots.n_slots
        self.next = 0
        self.last = -1  # the slot last taken (its batch carries the number to the main process)
        self.stop: threading.Event | None = None  # set (then `wake`): stop waiting (the iteration ended)
        self.pin, self.shared = False, False  # what BatchMaker compares with a BufferRing's

    def clear(self) -> None:
        self.shared_slots.clear(self.worker)

    def wake(self) -> None:
        """End a wait for a slot (after setting `stop`)."""
        self.shared_slots.wake(self.worker)

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        i = self.next % len(self.slots)
        self.next += 1
        self.shared_slots.wait(self.worker, i, self.stop)
        numel = int(np.prod(shape))
        t = self.slots[i]
        if t is None or t.numel() < numel:
            t = self.slots[i] = shared_empty((numel,), self.dtype)
        self.shared_slots.flags[self.worker, i] = 1
        self.last = i
        return t[:numel].view(shape)

    def hold(self, event: Any) -> None:
        """Nothing to wait for: worker batches never go to a device from the worker."""


class Stopped(Exception):
    """A worker's iteration ended while it waited for a slot."""
