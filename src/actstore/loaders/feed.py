"""DeviceFeeder: batches that arrive on the device while the previous one trains.

A thread takes each CPU batch of a source (a DataLoader's, say), copies its tensors into a
ring of pinned buffers (a batch already in pinned memory is used as it is), and issues
their copy to the device with non_blocking on a side stream, recording an event after it;
up to `prefetch` batches wait in a queue. The loop's current stream waits for that event
before the loop sees the batch (`record_stream` keeps the memory from being reused while
that stream may use it), so the copy of batch i+1 overlaps the step on batch i. A pinned
buffer is refilled only once its copy's event has completed (BufferRing.hold), and only
when no tensor viewing it is alive.

The copy is actstore.hostmem.DeviceCopy's; on the CPU device it runs as host copies, so
that everything else runs in the tests of a CPU-only torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from actstore.devices import parse_device
from actstore.hostmem import ENDED, BoundedQueue, DeviceCopy, hand_over
from actstore.loaders.buffers import BufferRing, host_copy


class DeviceFeeder:
    """Iterate `source`'s batches on `device`, `prefetch` ahead.

    Args:
        source: an iterable of CPU batches: tensors, tuples or lists of tensors, or dicts.
        device: a torch.device ("cuda:N"; "cpu" runs the same steps with host copies).
        prefetch: batches copied ahead of the one the loop holds (>= 1).
        keys: for dict batches, the keys whose tensors go to the device (None: every tensor).
        unwrap: the batch inside a source item (default: the item itself).
        on_copied: called on the feeder's thread with each source item once its tensors
            have been copied out of it (a DataLoader worker's slot may then be reused).
        ring: pinned slots per tensor of a batch (at least prefetch + 2).
        convert: called on the copy's side stream with (the source item, its tensors on the
            device), returning them converted (a cast, a normalisation).
    """

    def __init__(
        self,
        source: Iterable[Any],
        device: torch.device,
        *,
        prefetch: int = 2,
        keys: tuple[str, ...] | None = None,
        unwrap: Callable[[Any], Any] | None = None,
        on_copied: Callable[[Any], None] | None = None,
        ring: int | None = None,
        convert: Callable[[Any, list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ):
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1. Got {prefetch!r}.")
        self.source, self.device, self.prefetch, self.keys = source, device, prefetch, keys
        self.unwrap, self.on_copied, self.convert = unwrap, on_copied, convert
        self.copy = DeviceCopy(device)
        self.n_slots = max(ring or 0, prefetch + 2)
        self.rings: list[BufferRing] = []

    def __iter__(self) -> Iterator[Any]:
        out = BoundedQueue(self.prefetch)  # the thread's put waits for room, woken by a get or the stop
        thread = threading.Thread(target=self._run, args=(out,), daemon=True, name="actstore-feeder")
        thread.start()
        try:
            while True:
                item = out.get()
                if item is ENDED:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                hand_over(_tensors(batch), event)
                yield batch
        finally:
            out.stop()  # a waiting put returns at once
            thread.join()

    def _run(self, out: BoundedQueue) -> None:
        try:
            for item in self.source:
                if out.stopped:
                    return
                if not out.put(self._move(item)):
                    return
            out.close()
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it
            out.put(e)

    def _move(self, item: Any) -> tuple[Any, Any]:
        """(the item's batch with its tensors on the device, the event after their copies)."""
        batch = item if self.unwrap is None else self.unwrap(item)
        tensors: list[torch.Tensor] = []
        _walk(batch, self.keys, tensors.append)
        while len(self.rings) < len(tensors):
            self.rings.append(None)  # type: ignore[arg-type]
        staged = []
        for i, t in enumerate(tensors):
            if self.copy.pinned and t.is_pinned():
                staged.append(t)  # already in pinned memory: copied from there
                continue
            ring = self.rings[i]
            if ring is None or ring.dtype != t.dtype:
                ring = self.rings[i] = BufferRing(self.n_slots, t.dtype, pin=self.copy.pinned)
            buf = ring.take(tuple(t.shape))
            host_copy(buf, t)  # copy: into the pinned ring (the source's memory may be reused now)
            staged.append(buf)
        if self.on_copied is not None:
            self.on_copied(item)
        then = (lambda moved: self.convert(item, moved)) if self.convert is not None else None
        on_device, event = self.copy.to_device(staged, then=then)
        for i, t in enumerate(tensors):
            if staged[i] is not t:
                self.rings[i].hold(event)  # refilled only once the copy out of it is done
        it = iter(on_device)
        return _walk(batch, self.keys, lambda t: next(it)), event


def cuda_device(device: str | torch.device | None) -> torch.device | None:
    """The device batches go to (None: the CPU), checked now rather than at the first batch."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device. Got {device!r} ({e})."
        ) from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(
            f"device={device!r}: a loader moves batches to 'cuda' devices (or leaves them on the CPU); "
            f"move them to {dev.type} yourself"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but torch.cuda.is_available() is False: install a CUDA build of torch, "
            "or leave device=None for CPU batches"
        )
    parse_device(str(dev))  # cuda:N among the devices torch sees
    return dev


def _tensors(batch: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _walk(batch, None, out.append)
    return out


def _walk(batch: Any, keys: tuple[str, ...] | None, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The batch with fn applied to its device-bound tensors (in a fixed order)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_walk(b, None, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: (_walk(v, None, fn) if keys is None or k in keys else v) for k, v in batch.items()}
    return batch


class DeviceLoader:
    """A DataLoader whose batches arrive on `device` through a DeviceFeeder; everything
    else (`sampler`, `len`, `dataset`) is the DataLoader's."""

    def __init__(self, loader: Any, device: torch.device, *, prefetch: int = 2):
        self.loader, self.device, self.prefetch = loader, device, prefetch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(DeviceFeeder(self.loader, self.device, prefetch=self.prefetch))
