"""Output buffers for the loaders: reused when safe, fresh shared memory in workers.

Writing a batch into memory that was written before costs no page faults (about 1.5 ms
per 6 MB on a VM); a fresh allocation does. A slot of the ring is reused only when no
tensor or array viewing it is alive anywhere in the process, so a batch the caller keeps
is never overwritten. In a DataLoader worker every batch goes to fresh shared memory,
which the DataLoader hands to the main process by handle: reusing it would overwrite
batches the main process still reads.
"""

from __future__ import annotations

import numpy as np
import torch


TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


try:
    _FREE_REFS = _storage_refs(torch.empty(1))  # references of a storage only its tensor holds
except Exception:  # noqa: BLE001 - private API gone: never reuse a buffer
    _FREE_REFS = None


def unreferenced(t: torch.Tensor) -> bool:
    """True when no view of `t` (a returned batch, a numpy array of it) is alive."""
    return _FREE_REFS is not None and _storage_refs(t) == _FREE_REFS


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory: the DataLoader sends it by handle, no copy."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
    except AttributeError:  # pragma: no cover - older torch
        return torch.empty(shape, dtype=dtype).share_memory_()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class BufferRing:
    """`n` reusable slots of one dtype; `take(shape)` gives a tensor of that shape.

    Args:
        n: slots (how many batches may be in flight before one is reused).
        dtype: element type.
        pin: allocate slots in pinned memory.
        shared: always hand out fresh shared memory (inside DataLoader workers).
    """

    def __init__(self, n: int, dtype: torch.dtype, *, pin: bool = False, shared: bool = False):
        self.slots: list[torch.Tensor | None] = [None] * n
        self.events: list = [None] * n  # per slot: an event that must complete before reuse
        self.dtype, self.pin, self.shared = dtype, pin, shared
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
            t = torch.empty(numel, dtype=self.dtype, pin_memory=self.pin)
            self.slots[i] = t
        return t[:numel].view(shape)

    def hold(self, event: object) -> None:
        """The slot last taken is not reused before `event` (anything with synchronize(),
        e.g. a CUDA event recorded after a non_blocking copy from it) has completed."""
        if not self.shared:
            self.events[(self.next - 1) % len(self.slots)] = event
