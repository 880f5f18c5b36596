"""TokenLoader: a torch DataLoader over a TokenStream that counts what the loop consumed,
so that `state_dict()` is exact with any number of workers."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from actstore.loaders.state import StreamState
from actstore.storage.forksafe import worker_context


class TokenLoader:
    """Iterate batches of `stream` through `num_workers` DataLoader worker processes.

    Each worker reads its own windows (disjoint); batches arrive round robin. The loader
    counts batches as the training loop receives them, so `state_dict()` taken between two
    steps resumes, with the same `num_workers`, at exactly the next batch.

    Args:
        stream: the TokenStream (or an AlignedTokenStream).
        num_workers: DataLoader worker processes (0: read in this process, with the
            stream's own background threads).
        pin_memory: copy batches into pinned memory (needs an accelerator).
        prefetch_factor: batches each worker prepares ahead (DataLoader's option).
        multiprocessing_context: e.g. "fork" or "spawn" (DataLoader's option). For a store in
            object storage the default is "forkserver" and "fork" is refused: obstore's
            client does not survive fork.
        timeout: seconds to wait for a worker's batch (0: forever).
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
    ):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0. Got {num_workers!r}.")
        if stream._batches_done and stream._num_workers != num_workers:
            raise ValueError(
                f"the stream's saved position was taken with num_workers={stream._num_workers}; "
                f"resume with the same number of workers (got {num_workers})"
            )
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=2)
            pin_memory = False
        self.stream = stream
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        for source in getattr(stream, "streams", [stream]):  # an AlignedTokenStream streams several sources
            multiprocessing_context = worker_context(
                getattr(source.store, "storage", None), num_workers, multiprocessing_context
            )
        self.multiprocessing_context = multiprocessing_context
        self.timeout = timeout
        stream._num_workers = num_workers

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
        self.stream._num_workers = self.num_workers

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        s = self.stream
        s._num_workers = self.num_workers
        if self.num_workers == 0:
            for batch in s:  # the stream counts consumed batches itself
                yield _pin(batch) if self.pin_memory and s.device is None else batch
            return
        device = s.device  # workers yield CPU batches; the move happens here, from pinned memory
        dl = DataLoader(
            s,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory or device is not None,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context,
            timeout=self.timeout,
            persistent_workers=False,
        )
        for batch in dl:
            s._batches_done += 1
            batch = _as_sent(batch)
            yield batch if device is None else _to(batch, device)
        s._end_epoch()


def _as_sent(batch: Any) -> Any:
    """The batch as the worker yielded it: the DataLoader turns an aligned stream's tuple into a list."""
    if isinstance(batch, list):
        return tuple(batch)
    if isinstance(batch, dict) and isinstance(batch.get("acts"), list):
        return {**batch, "acts": tuple(batch["acts"])}
    return batch


def _to(batch: Any, device: torch.device) -> Any:
    """The batch's activations on `device` (an asynchronous copy from pinned memory)."""
    if isinstance(batch, dict):
        return {**batch, "acts": _to(batch["acts"], device)}
    if isinstance(batch, (tuple, list)):  # an aligned stream's tensors, one per source
        return tuple(t.to(device, non_blocking=True) for t in batch)
    return batch.to(device, non_blocking=True)


def _pin(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(t.pin_memory() for t in batch)
    return batch.pin_memory()
