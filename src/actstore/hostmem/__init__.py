"""Host memory shared by the capture, the writer and the loaders (below all three).

- `pool`: flat host buffers (plain, pinned or shared memory), a bounded pool of reused
  slots, and the process's spare buffers kept for the next pool under a byte cap;
- `lent`: a buffer lent to several holders, handed back once every one is done;
- `devcopy`: the one device copy in each direction (side stream, event, `record_stream`);
- `waits`: a bounded queue whose waits are woken by a condition (an item, room, an error
  or a stop), never by polling.

Nothing here imports torch at its top: a CUDA or pinned buffer imports it when made.
"""

from __future__ import annotations

from actstore.hostmem.devcopy import DONE, DeviceCopy, hand_over
from actstore.hostmem.lent import Lent
from actstore.hostmem.pool import HostBuffer, SlotPool, Spare, carve_bytes, shared_empty, unreferenced
from actstore.hostmem.waits import ENDED, BoundedQueue

__all__ = [
    "DONE",
    "ENDED",
    "BoundedQueue",
    "DeviceCopy",
    "HostBuffer",
    "Lent",
    "SlotPool",
    "Spare",
    "carve_bytes",
    "hand_over",
    "shared_empty",
    "unreferenced",
]
