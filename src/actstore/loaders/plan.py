"""Pure index math of the token stream: the epoch's token order, its split over ranks and
DataLoader workers, shuffle windows, and resume positions. No I/O, no torch, no state
(where a stream stands is its StreamPosition: actstore/loaders/position.py).

A *unit* is one (example, layer, segment) slice: the token vectors that one whole-chunk
read returns. `counts[u]` is how many of its tokens the stream yields (its length, less
masked tokens). One epoch is defined by these steps, each a pure function of
(counts, seed, epoch) and the sizes:

1. Unit order: runs of `run` consecutive units (in store order, which is their order on
   disk) permuted by `rng(seed, epoch)` (natural order when shuffle is off); units with
   no token are left out. Laying their tokens end to end gives the epoch's token
   sequence of `n_tokens` tokens, cut into global batches of `batch_size`.
2. Ranks: rank r takes a contiguous run of global batches, so ranks differ by at most
   one batch (none with drop_last) and read disjoint units (but the two at a boundary).
3. Windows: a rank's run is cut into windows of `window_batches` batches. A window's
   tokens are read into one buffer and permuted there by `rng(seed, epoch, window start)`;
   that buffer is the memory-versus-randomness knob.
4. Workers: DataLoader worker w of W takes windows w, w + W, ... The DataLoader hands
   out their batches round robin (skipping exhausted workers), which fixes the order
   that the training loop sees and lets a resumed run skip exactly what was consumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ORDER_KEY = 0x6F72  # separate random streams for the unit order and the window shuffles
_WINDOW_KEY = 0x7769


@dataclass(frozen=True)
class WindowSlice:
    """The units that make up one window, in window order.

    units[i] contributes its kept tokens lo[i]:hi[i] at window rows dest[i]:dest[i]+hi[i]-lo[i].
    """

    index: int
    start: int  # first token of the window in the epoch's token sequence
    n_tokens: int
    n_batches: int
    units: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    dest: np.ndarray


class EpochPlan:
    """The token order of one epoch, as seen by one rank.

    Args:
        counts: kept tokens of every unit (ints >= 0).
        batch_size: tokens per batch.
        window_batches: batches per shuffle window (>= 1).
        seed, epoch: the random state; the order is a pure function of both.
        rank, world_size: this process's share of the epoch.
        shuffle: permute units and tokens (False: natural order, for evaluation).
        run: units are shuffled in runs of this many consecutive units, so that a window
            reads longer stretches of the disk (1: every unit on its own).
        drop_last: drop the last partial batch and trim so that every rank gets the same
            number of full batches (what DistributedDataParallel needs).
    """

    def __init__(
        self,
        counts: np.ndarray,
        *,
        batch_size: int,
        window_batches: int,
        seed: int,
        epoch: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        run: int = 1,
    ):
        counts = np.asarray(counts)
        assert counts.ndim == 1 and batch_size > 0 and window_batches > 0 and 0 <= rank < world_size and run > 0
        self.counts = counts
        self.batch_size = batch_size
        self.window_batches = window_batches
        self.window_tokens = window_batches * batch_size
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        # One pass of each kind over the units (at 10^7 units a random gather costs more than
        # the arithmetic): the counts gathered once, the units without tokens dropped once.
        if shuffle:
            n_runs = -(-len(counts) // run)
            order = np.random.default_rng([seed, epoch, _ORDER_KEY]).permutation(n_runs)
            if run > 1:
                order = (order[:, None] * run + np.arange(run)).reshape(-1)
                order = order[order < len(counts)]
            kept = counts[order]
        else:
            order, kept = np.arange(len(counts)), counts
        has = kept > 0
        if not has.all():
            order, kept = order[has], kept[has]
        self.order = order
        self.ends = np.cumsum(kept, dtype=np.int64)
        self.n_tokens = int(self.ends[-1]) if len(self.ends) else 0
        b0, b1 = rank_batches(self.n_tokens, batch_size, rank, world_size, drop_last)
        self.n_batches = b1 - b0
        self.token_start = b0 * batch_size
        self.token_stop = min(b1 * batch_size, self.n_tokens)
        self.n_windows = -(-self.n_batches // window_batches)

    # ---- windows and workers --------------------------------------------------------
    def window_n_batches(self, j: int) -> int:
        return min(self.window_batches, self.n_batches - j * self.window_batches)

    def worker_windows(self, worker: int, n_workers: int) -> range:
        return range(worker, self.n_windows, n_workers)

    def worker_batches(self, n_workers: int) -> np.ndarray:
        """Batches each of `n_workers` workers yields this epoch."""
        out = np.zeros(n_workers, dtype=np.int64)
        for w in range(n_workers):
            js = self.worker_windows(w, n_workers)
            out[w] = len(js) * self.window_batches
            if len(js) and js[-1] == self.n_windows - 1:
                out[w] -= self.window_batches - self.window_n_batches(js[-1])
        return out

    def window(self, j: int) -> WindowSlice:
        """The units of window j and which of their tokens it takes."""
        a = self.token_start + j * self.window_tokens
        b = min(a + self.window_tokens, self.token_stop)
        p0 = int(np.searchsorted(self.ends, a, side="right"))
        p1 = int(np.searchsorted(self.ends, b - 1, side="right")) + 1
        ends = self.ends[p0:p1]
        units = self.order[p0:p1]
        starts = ends - self.counts[units]
        lo = np.maximum(a, starts) - starts
        hi = np.minimum(b, ends) - starts
        dest = np.maximum(a, starts) - a
        return WindowSlice(
            index=j, start=a, n_tokens=b - a, n_batches=self.window_n_batches(j), units=units, lo=lo, hi=hi, dest=dest
        )

    def window_permutation(self, window: WindowSlice) -> np.ndarray:
        """Row order of a window's tokens (identity without shuffle)."""
        if not self.shuffle:
            return np.arange(window.n_tokens, dtype=np.int64)
        return np.random.default_rng([self.seed, self.epoch, _WINDOW_KEY, window.start]).permutation(window.n_tokens)


def rank_batches(n_tokens: int, batch_size: int, rank: int, world_size: int, drop_last: bool) -> tuple[int, int]:
    """The global batches [b0, b1) of one rank: contiguous shares differing by at most one
    (drop_last: the last partial batch dropped and the count trimmed to equal shares)."""
    nb = n_tokens // batch_size if drop_last else -(-n_tokens // batch_size)
    if drop_last:
        nb -= nb % world_size
    return rank * nb // world_size, (rank + 1) * nb // world_size


def consumed_per_worker(worker_batches: np.ndarray, consumed: int) -> tuple[np.ndarray, int]:
    """Where a DataLoader that serves its workers round robin (skipping exhausted ones)
    stands once `consumed` batches were taken: the batches each worker had delivered, and
    the worker whose batch comes next. A resumed DataLoader starts its cycle at worker 0,
    so worker i of the resumed run plays worker (i + next) % W: the cycle is the same."""
    n = np.asarray(worker_batches, dtype=np.int64)
    if not 0 <= consumed <= int(n.sum()):
        raise ValueError(f"consumed must be in 0..{int(n.sum())} (batches this epoch). Got {consumed}.")
    done = np.zeros_like(n)
    left, nxt = consumed, 0
    while left > 0:
        alive = np.flatnonzero(done < n)
        rounds = int((n[alive] - done[alive]).min())
        if left >= rounds * len(alive):
            done[alive] += rounds
            left -= rounds * len(alive)
        else:
            q, r = divmod(left, len(alive))
            done[alive] += q
            done[alive[:r]] += 1
            nxt = int(alive[r])
            left = 0
    return done, nxt


def round_robin_order(worker_batches: np.ndarray) -> list[tuple[int, int]]:
    """(worker, batch of that worker) in the order a DataLoader yields them (for tests)."""
    n = list(int(x) for x in worker_batches)
    out = []
    for r in range(max(n, default=0)):
        out.extend((w, r) for w in range(len(n)) if n[w] > r)
    return out
