"""TokenLoader: a torch DataLoader over a TokenStream that counts what the loop consumed,
so that `state_dict()` is exact with any number of workers.

With workers, the DataLoader's worker processes persist from epoch to epoch (they keep
the store open, its files mapped and their buffers): the loader writes the position into
a small tensor the workers share before each iteration (StreamPosition.shared). Each worker
gathers its batches into shared-memory slots it reuses (buffers.WorkerRing), in the
stored dtype with the rows' normalisation keys; the main process copies a batch out of
its slot at once (into a ring of its own, pinned with pin_memory, cast and normalised on
the way; or into the DeviceFeeder's pinned ring on its way to the device, cast and
normalised there: feed.py) and hands the slot back. So no batch costs fresh memory, in
the workers or here, and float16 crosses shared memory where a float32 output is asked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from actstore.loaders.assemble import device_step
from actstore.loaders.buffers import BufferRing, WorkerBatch, WorkerSlots, host_copy
from actstore.loaders.feed import DeviceFeeder
from actstore.loaders.state import StreamState
from actstore.read.normalize import normalize_into
from actstore.storage.forksafe import worker_context

DEFAULT_PREFETCH_FACTOR = 2  # the DataLoader's: batches each worker prepares ahead
SLOTS_BEYOND_PREFETCH = 5  # a worker's slots besides the prefetched ones (its queue, the one being made, sent)


class TokenLoader:
    """Iterate batches of `stream` through `num_workers` DataLoader worker processes.

    Each worker reads its own windows (disjoint); batches arrive round robin. The loader
    counts batches as the training loop receives them, so `state_dict()` taken between two
    steps resumes, with the same `num_workers`, at exactly the next batch.

    Args:
        stream: the TokenStream (or an AlignedTokenStream); its `position` is advanced here.
        num_workers: DataLoader worker processes (0: read in this process, with the
            stream's own background threads).
        pin_memory: copy batches into pinned memory (needs an accelerator).
        prefetch_factor: batches each worker prepares ahead (DataLoader's option).
        multiprocessing_context: e.g. "fork" or "spawn" (DataLoader's option). For a store in
            object storage the default is "forkserver" and "fork" is refused: obstore's
            client does not survive fork.
        timeout: seconds to wait for a worker's batch (0: forever).
        persistent_workers: keep the worker processes from epoch to epoch (default); False
            starts them anew each epoch (each reopens the store and maps its files again).
    """

    def __init__(
        self,
        stream: StreamState,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        persistent_workers: bool = True,
    ):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0. Got {num_workers!r}.")
        pos = stream.position
        if pos.batches_done and pos.num_workers != num_workers:
            raise ValueError(
                f"the stream's saved position was taken with num_workers={pos.num_workers}; "
                f"resume with the same number of workers (got {num_workers})"
            )
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=2)
            pin_memory = False
        self.stream = stream
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor or DEFAULT_PREFETCH_FACTOR
        self.persistent_workers = bool(persistent_workers)
        self._dl: DataLoader | None = None
        self._ring: BufferRing | None = None
        self._slots: WorkerSlots | None = None  # the workers' shared slots: busy flags and wake-ups
        self._position: torch.Tensor | None = None  # (epoch, batches_done, num_workers) for the workers
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}  # the last tensor received from each worker slot
        for source in getattr(stream, "streams", [stream]):  # an AlignedTokenStream streams several sources
            multiprocessing_context = worker_context(
                getattr(source.store, "storage", None), num_workers, multiprocessing_context
            )
        self.multiprocessing_context = multiprocessing_context
        self.timeout = timeout
        pos.num_workers = num_workers

    def __len__(self) -> int:
        return len(self.stream)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("num_workers") != self.num_workers and state.get("batches_done"):
            raise ValueError(
                f"this position was saved with num_workers={state.get('num_workers')}; "
                f"this loader has num_workers={self.num_workers}: resume with the same number"
            )
        self.stream.load_state_dict(state)
        self.stream.position.num_workers = self.num_workers

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        s = self.stream
        pos = s.position  # advanced here: the workers' copies of the stream never see the loop
        pos.num_workers = self.num_workers
        if self.num_workers == 0:
            for batch in s:  # the stream counts consumed batches itself
                yield _pin(batch) if self.pin_memory and s.device is None else batch
            return
        dl = self._loader()
        self._position[:] = torch.tensor(pos.ints())
        device = s.device  # workers yield CPU batches; the move happens here
        if device is None:
            batches: Any = (self._received(b) for b in dl)
        else:
            prefetch = getattr(s, "prefetch_batches", 2)
            batches = DeviceFeeder(
                (_as_sent(b) for b in dl),
                device,
                prefetch=prefetch,
                keys=("acts",),
                unwrap=lambda b: b.batch if isinstance(b, WorkerBatch) else b,
                on_copied=self._release,
                convert=self._device_step(device),
            )
        for batch in batches:
            pos.advance()
            yield batch
        pos.end_epoch()

    def _loader(self) -> DataLoader:
        """The DataLoader (made once: its workers persist), and what it shares with them."""
        if self._dl is not None and self.persistent_workers:
            return self._dl
        s = self.stream
        if self._slots is None:
            self._position = torch.zeros(3, dtype=torch.int64).share_memory_()
            n_slots = self.prefetch_factor + SLOTS_BEYOND_PREFETCH
            self._slots = WorkerSlots(self.num_workers, n_slots, self.multiprocessing_context)
        plain = not hasattr(s, "streams")  # a plain TokenStream (an aligned one combines its sources' batches)
        self._dl = DataLoader(
            _UnderLoader(s, self._position, self._slots if plain else None),
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context,
            timeout=self.timeout,
            persistent_workers=self.persistent_workers,
        )
        return self._dl

    def _received(self, item: Any) -> Any:
        """A worker's batch as the loop gets it: copied out of the worker's slot into this
        process's ring (pinned with pin_memory), the slot handed back."""
        item = _as_sent(item)
        if not isinstance(item, WorkerBatch):
            return _pin(item) if self.pin_memory else item
        acts = item.batch["acts"] if isinstance(item.batch, dict) else item.batch
        dtype, norm = self.stream.dtype, self.stream._norm  # the worker shipped the stored dtype
        if self._ring is None or self._ring.dtype != dtype:
            self._ring = BufferRing(self.prefetch_factor + 4, dtype, pin=self.pin_memory)
        out = self._ring.take(tuple(acts.shape))
        if dtype == acts.dtype and norm is None:
            host_copy(out, acts)  # copy: out of the worker's slot (no fresh memory on either side)
        else:  # copy: out of the worker's slot, cast and normalised on the way
            shift, scale = (torch.from_numpy(t) for t in norm) if norm is not None else (None, None)
            normalize_into(out, acts, shift, scale, item.keys)
        self._release(item)
        return {**item.batch, "acts": out} if isinstance(item.batch, dict) else out

    def _device_step(self, device: torch.device) -> Any:
        """The cast and normalisation of a worker's batch on the device, after its copy."""
        s = self.stream
        cache: dict[str, Any] = {}

        def tables() -> Any:
            if s._norm is not None and "norm" not in cache:
                cache["norm"] = tuple(torch.from_numpy(t).to(device) for t in s._norm)
            return cache.get("norm")

        def convert(item: Any, moved: list[torch.Tensor]) -> list[torch.Tensor]:
            if not isinstance(item, WorkerBatch):  # (already converted where it was made)
                return moved
            return device_step(s, device, tables, item.keys)(moved)

        return convert

    def _release(self, item: Any) -> None:
        """Hand a worker's slot back, keeping the received tensor: while it lives, torch
        maps the slot's shared memory once (its cache of received storages), instead of
        mapping it again, page by page, for every batch sent from it."""
        if isinstance(item, WorkerBatch):
            self._mapped[(item.worker, item.slot)] = item.batch["acts"] if isinstance(item.batch, dict) else item.batch
            self._slots.give_back(item.worker, item.slot)


class _UnderLoader(IterableDataset):
    """The stream as a TokenLoader's workers iterate it: with the loader's position and
    shared slots (in shared memory), set on the worker's own copy of the stream, so
    that the stream itself stays as it was for any other DataLoader."""

    def __init__(self, stream: Any, position: torch.Tensor, slots: WorkerSlots | None):
        self.stream, self.position, self.slots = stream, position, slots

    def __iter__(self) -> Iterator[Any]:
        s = self.stream
        s.position.shared, s._worker_slots = self.position, self.slots
        return iter(s)


def _as_sent(batch: Any) -> Any:
    """The batch as the worker yielded it: the DataLoader turns an aligned stream's tuple into a list."""
    if isinstance(batch, WorkerBatch):
        return batch
    if isinstance(batch, list):
        return tuple(batch)
    if isinstance(batch, dict) and isinstance(batch.get("acts"), list):
        return {**batch, "acts": tuple(batch["acts"])}
    return batch


def _pin(batch: Any) -> Any:
    """The batch in pinned memory (a tensor already pinned, e.g. from a pinned ring, as it is)."""
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(_pin(t) for t in batch)
    return batch if batch.is_pinned() else batch.pin_memory()
