"""Pure index math: global example <-> (shard position, local index); layer -> position."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from actstore.errors import ExampleIndexError, LayerNotFoundError


class ExampleIndex:
    """Maps global example indices to (shard position, local index), shard-major order.

    Args:
        counts: examples in each shard, in the manifest's shard order.
    """

    def __init__(self, counts: Sequence[int]):
        counts_arr = np.asarray(counts, dtype=np.int64)
        if counts_arr.ndim != 1 or (counts_arr < 0).any():
            raise ValueError(f"shard counts must be a list of non-negative ints, got {list(counts)}")
        self.counts = counts_arr
        self.starts = np.zeros(len(counts_arr) + 1, dtype=np.int64)
        np.cumsum(counts_arr, out=self.starts[1:])
        self.n_examples = int(self.starts[-1])
        self._starts = self.starts.tolist()  # for locate: bisect on a list beats numpy on one value

    def __len__(self) -> int:
        return self.n_examples

    def locate(self, ex: int) -> tuple[int, int]:
        """Return (shard position, local index) of global example `ex` (negative counts from the end)."""
        n = self.n_examples
        if not isinstance(ex, (int, np.integer)) or isinstance(ex, (bool, np.bool_)):
            raise ExampleIndexError(f"example index must be an int (negative counts from the end); got {ex!r}")
        if not -n <= ex < n:
            raise ExampleIndexError(f"example {ex} is out of range: this store holds {n} examples (0..{n - 1})")
        if ex < 0:
            ex += n
        pos = bisect.bisect_right(self._starts, ex) - 1
        return pos, int(ex) - self._starts[pos]

    def locate_many(self, exs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate` for an int array of non-negative indices."""
        exs = np.asarray(exs, dtype=np.int64)
        if exs.size and (exs.min() < 0 or exs.max() >= self.n_examples):
            bad = exs[(exs < 0) | (exs >= self.n_examples)][0]
            raise ExampleIndexError(f"example {int(bad)} is out of range: this store holds {self.n_examples} examples")
        pos = np.searchsorted(self.starts, exs, side="right") - 1
        return pos, exs - self.starts[pos]

    def global_index(self, pos: int, local: int) -> int:
        """Inverse of `locate`."""
        if not 0 <= local < int(self.counts[pos]):
            raise ExampleIndexError(f"local index {local} is out of range for shard position {pos}")
        return int(self.starts[pos]) + local


def layer_position(layers: Sequence[int], layer: int) -> int:
    """Position of model layer number `layer` in the stored `layers` list."""
    try:
        return list(layers).index(int(layer))
    except (ValueError, TypeError):
        raise LayerNotFoundError(
            f"layer {layer} is not stored; this store holds layers {list(layers)} "
            "(layer numbers are the model's block indices)"
        ) from None
