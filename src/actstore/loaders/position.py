"""StreamPosition: where a resumable token stream stands, the one value its loaders advance.

A TokenStream (and an AlignedTokenStream) holds one as `stream.position`. The stream
iterated in this process advances it batch by batch; a TokenLoader with DataLoader
workers advances it itself (the workers' copies of the stream never see the loop), and
before each iteration writes it into a small tensor in shared memory that each worker
reads when its iteration starts (`shared`, `from_loader`): persistent workers keep their
copy of the stream from epoch to epoch. `state()` is the part of `state_dict()` that
moves; the rest of a state names the sizes that fix the order (actstore/loaders/plan.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

POSITION_KEYS = ("seed", "epoch", "batches_done", "num_workers")


@dataclass
class StreamPosition:
    """The position after the last batch the training loop consumed.

    Attributes:
        seed: the shuffle seed (a loaded state brings its own).
        epoch: the epoch the next iteration serves.
        batches_done: batches of that epoch already consumed (the next iteration skips them).
        num_workers: the DataLoader worker count the position refers to (0: in process).
        shared: under a TokenLoader, in a worker: the loader's (epoch, batches_done,
            num_workers) int64 tensor in shared memory (None elsewhere).
    """

    seed: int
    epoch: int = 0
    batches_done: int = 0
    num_workers: int = 0
    shared: Any = field(default=None, repr=False, compare=False)

    def advance(self) -> None:
        """The loop consumed one more batch."""
        self.batches_done += 1

    def end_epoch(self) -> None:
        """The loop consumed the whole epoch: the next iteration starts the next one."""
        self.epoch += 1
        self.batches_done = 0

    def start(self, epoch: int, batches_done: int = 0) -> None:
        """The next iteration starts at batch `batches_done` of `epoch`."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0. Got {epoch!r}.")
        if isinstance(batches_done, bool) or not isinstance(batches_done, int) or batches_done < 0:
            raise ValueError(f"batches_done must be an int >= 0. Got {batches_done!r}.")
        self.epoch, self.batches_done = epoch, batches_done

    def ints(self) -> tuple[int, int, int]:
        """(epoch, batches_done, num_workers): what a loader hands its workers."""
        return (self.epoch, self.batches_done, self.num_workers)

    def from_loader(self) -> None:
        """In a worker: take the position the loader wrote for this iteration."""
        if self.shared is not None:
            self.epoch, self.batches_done, self.num_workers = (int(v) for v in self.shared.tolist())

    def copy_from(self, other: StreamPosition) -> None:
        """Stand where `other` stands (an aligned stream's sources follow it)."""
        self.seed, self.epoch, self.batches_done, self.num_workers = (
            other.seed,
            other.epoch,
            other.batches_done,
            other.num_workers,
        )

    def state(self) -> dict[str, int]:
        """The moving part of a state_dict (JSON-serialisable)."""
        return {k: int(getattr(self, k)) for k in POSITION_KEYS}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Stand where `state` (a state_dict, already checked to be this stream's) says."""
        for k in POSITION_KEYS:
            setattr(self, k, int(state[k]))
