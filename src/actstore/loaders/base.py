"""BaseTokenStream: what every stream of token batches promises, whichever kind it is.

Three kinds, three classes, one base (isinstance(x, BaseTokenStream) holds for each):

- TokenStream(store, ...): a finalized store's token vectors, shuffled and resumable.
- TokenStream.aligned(stores, ...) -> AlignedTokenStream: several sources in step (a
  tuple of tensors per batch), resumable like a TokenStream.
- TokenStream.follow(path, ...) -> FollowStream: a store still being written, until it is
  finalized; it has no epochs and cannot resume (`position` is None, and what needs one
  says why it cannot).

`isinstance(x, TokenStream)` is true of the first kind only: the named constructors
return the class of the job they do (not a TokenStream pretending to be one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Unpack

from torch.utils.data import IterableDataset

from actstore.loaders.position import StreamPosition
from actstore.loaders.spec import LoaderOptions


class BaseTokenStream(IterableDataset):
    """An iterable torch dataset of token batches (see the module docstring).

    Attributes:
        position: where the stream stands (StreamPosition), or None for a stream
            without epochs (a FollowStream).
    """

    position: StreamPosition | None  # set by each kind's __init__

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves."""
        return self._positioned("has no epochs").epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of `epoch`."""
        self._positioned("has no epochs").start(epoch)

    def loader(self, num_workers: int = 0, **kwargs: Unpack[LoaderOptions]) -> Any:
        """A resumable loader over this stream with `num_workers` DataLoader workers."""
        from actstore.loaders.tokenloader import TokenLoader

        return TokenLoader(self, num_workers=num_workers, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last consumed batch (JSON-serialisable)."""
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position saved by state_dict() of an identically configured stream."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back what the stream holds between iterations (nothing, unless a kind says otherwise)."""

    def _positioned(self, what: str) -> StreamPosition:
        """The stream's position, or a ValueError saying that this kind of stream `what`."""
        if self.position is None:
            raise ValueError(f"a {type(self).__name__} {what}: it streams a store until it is finalized, once")
        return self.position
