"""Per-feature accumulators of the streaming pass, in memory O(features x k): pure numpy.

Tokens arrive in store order; each carries an order key `ord = example * 2**31 + token`,
increasing along the pass. Every state here is a function of the multiset of (ord, value)
seen, not of how the pass cut it into batches, so the results are deterministic:

- top-k: the k largest positive values, ties broken by (example, token);
- statistics: max, count and sum of the positive values, a histogram on fixed log bins;
- a uniform sample of each feature's positive tokens: the `pool` tokens with the smallest
  seeded hash keys (a key depends on the token only, so a feature's pool is a uniform sample
  of its own active tokens), from which the interval samples are drawn (actstore.features.topk).
"""

from __future__ import annotations

import numpy as np

HIST_EDGES = (10.0 ** np.linspace(-6, 4, 81)).astype(np.float32)  # 8 bins a decade, 1e-6 .. 1e4
N_BINS = len(HIST_EDGES) + 1  # bin 0: (0, 1e-6); bin i: [edge i-1, edge i); last: >= 1e4
NO_ORD = np.iinfo(np.int64).max
NO_KEY = np.iinfo(np.uint64).max
TOKEN_BITS = 31


def order_keys(example: np.ndarray, token: np.ndarray) -> np.ndarray:
    return example.astype(np.int64) << TOKEN_BITS | token.astype(np.int64)


def split_order(ords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ords >> TOKEN_BITS, (ords & ((1 << TOKEN_BITS) - 1)).astype(np.int32)


def hash_keys(ords: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of (ord, seed): a token's sampling key, the same for every feature."""
    with np.errstate(over="ignore"):
        z = ords.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _select_largest(vals: np.ndarray, k: int) -> np.ndarray:
    """A (r, c) bool mask of exactly k entries per row: the k largest, ties to the leftmost
    (the caller lays candidates out so that leftmost means smallest order key)."""
    kth = np.partition(vals, vals.shape[1] - k, axis=1)[:, vals.shape[1] - k, None]
    gt = vals > kth
    need = k - gt.sum(axis=1, keepdims=True)
    eq = vals == kth
    return gt | (eq & (np.cumsum(eq, axis=1) <= need))


class FeatureAccumulator:
    """The state of the pass for F features (rows) and top-k / pool sizes.

    Args:
        n_features: F (rows).
        k: top activations kept per feature.
        pool: sample pool per feature (0: none).
        seed: the sampling seed.
    """

    def __init__(self, n_features: int, k: int, pool: int, seed: int):
        self.k, self.pool, self.seed = k, pool, seed
        self.top_val = np.zeros((n_features, k), np.float32)  # 0: empty slot (only values > 0 enter)
        self.top_ord = np.full((n_features, k), NO_ORD, np.int64)
        self.max = np.full(n_features, -np.inf, np.float32)
        self.n_pos = np.zeros(n_features, np.int64)
        self.sum_pos = np.zeros(n_features, np.float64)
        self.hist = np.zeros((n_features, N_BINS), np.int64)
        self.pool_key = np.full((n_features, pool), NO_KEY, np.uint64)
        self.pool_val = np.zeros((n_features, pool), np.float32)
        self.pool_ord = np.full((n_features, pool), NO_ORD, np.int64)
        self.n_tokens = 0

    def update(self, acts_ft: np.ndarray, ords: np.ndarray) -> None:
        """Add a batch: acts_ft (F, n) float32 feature-major, ords (n,) increasing and all
        greater than those of earlier batches."""
        n = acts_ft.shape[1]
        if n == 0:
            return
        self.n_tokens += n
        np.maximum(self.max, acts_ft.max(axis=1), out=self.max)
        pos = acts_ft > 0
        rows, cols = np.nonzero(pos)
        vals = acts_ft[rows, cols]
        self.n_pos += np.bincount(rows, minlength=len(self.n_pos))
        self.sum_pos += np.bincount(rows, weights=vals, minlength=len(self.n_pos))
        bins = np.searchsorted(HIST_EDGES, vals, side="right")
        self.hist += np.bincount(rows * N_BINS + bins, minlength=self.hist.size).reshape(self.hist.shape)
        self._merge_top(acts_ft, ords)
        if self.pool:
            self._merge_pool(pos, acts_ft, ords)

    def _merge_top(self, acts_ft: np.ndarray, ords: np.ndarray) -> None:
        r = np.flatnonzero(acts_ft.max(axis=1) > self.top_val[:, -1])  # rows where a value can enter
        if not len(r):
            return
        k, n = self.k, acts_ft.shape[1]
        # Candidates: the kept slots (sorted by (-value, ord)), then the batch in ord order, so
        # that among equal values the leftmost has the smallest ord.
        cv = np.concatenate([self.top_val[r], acts_ft[r]], axis=1)  # copy: the candidates
        co = np.concatenate([self.top_ord[r], np.broadcast_to(ords, (len(r), n))], axis=1)
        sel = _select_largest(cv, k)
        v, o = cv[sel].reshape(len(r), k), co[sel].reshape(len(r), k)
        idx = np.argsort(-v, axis=1, kind="stable")
        self.top_val[r] = np.take_along_axis(v, idx, axis=1)
        self.top_ord[r] = np.take_along_axis(o, idx, axis=1)

    def _merge_pool(self, pos: np.ndarray, acts_ft: np.ndarray, ords: np.ndarray) -> None:
        keys = hash_keys(ords, self.seed)
        kb = np.where(pos, keys[None, :], NO_KEY)  # (F, n): inactive tokens never sampled
        r = np.flatnonzero(kb.min(axis=1) < self.pool_key[:, -1])
        if not len(r):
            return
        n, m = acts_ft.shape[1], self.pool
        ck = np.concatenate([self.pool_key[r], kb[r]], axis=1)
        cv = np.concatenate([self.pool_val[r], acts_ft[r]], axis=1)
        co = np.concatenate([self.pool_ord[r], np.broadcast_to(ords, (len(r), n))], axis=1)
        # smallest keys = largest of the bitwise complement (keys are distinct per token)
        sel = _select_largest(~ck, m)
        k2, v2, o2 = (a[sel].reshape(len(r), m) for a in (ck, cv, co))
        idx = np.argsort(k2, axis=1, kind="stable")
        self.pool_key[r] = np.take_along_axis(k2, idx, axis=1)
        self.pool_val[r] = np.take_along_axis(v2, idx, axis=1)
        self.pool_ord[r] = np.take_along_axis(o2, idx, axis=1)
