"""Per-feature accumulators of the streaming pass, in memory O(features x k): the state, its
numpy reference update, and the dispatch to the compiled updates (actstore.features.topk.kernel,
kernel16), which keep the top k and the pool as heaps until `finish` sorts them.

Tokens arrive in store order; each carries an order key `ord = example * 2**31 + token`,
increasing along the pass. Every state here is a function of the multiset of (ord, value)
seen, not of how the pass cut it into batches, so the results are deterministic:

- top-k: the k largest positive values, ties broken by (example, token);
- statistics: max, count and sum of the positive values, a histogram on fixed log bins;
- a uniform sample of each feature's positive tokens: the `pool` tokens with the smallest
  seeded hash keys (a key depends on the token only, so a feature's pool is a uniform sample
  of its own active tokens), from which the interval samples are drawn (actstore.features.topk.layerpass).
"""

from __future__ import annotations

import numpy as np

# Histogram bins from a float32's bits: exponent and the top 2 mantissa bits, i.e. 4 bins an
# octave with edges 2**e * (1, 1.25, 1.5, 1.75), from 2**-20 (~1e-6) to 2**14 (16384).
# Bin 0 holds the positive values below 2**-20; the last bin those >= 2**14.
_SHIFT = 21
_LO_CODE = (127 - 20) << 2  # bits >> 21 of 2**-20
_HI_CODE = (127 + 14) << 2  # bits >> 21 of 2**14
N_BINS = _HI_CODE - _LO_CODE + 2
HIST_EDGES = np.array(
    [(2.0 ** ((c >> 2) - 127)) * (1 + (c & 3) / 4) for c in range(_LO_CODE, _HI_CODE + 1)], np.float32
)
NO_ORD = np.iinfo(np.int64).max
NO_KEY = np.iinfo(np.uint32).max
TOKEN_BITS = 31


def order_keys(example: np.ndarray, token: np.ndarray) -> np.ndarray:
    return example.astype(np.int64) << TOKEN_BITS | token.astype(np.int64)


def split_order(ords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ords >> TOKEN_BITS, (ords & ((1 << TOKEN_BITS) - 1)).astype(np.int32)


def hash_keys(ords: np.ndarray, seed: int) -> np.ndarray:
    """The high 32 bits of splitmix64(ord, seed): a token's sampling key (uint32), the same
    for every feature. Samples take the smallest (key, ord): equal keys go by order."""
    with np.errstate(over="ignore"):
        z = ords.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return ((z ^ (z >> np.uint64(31))) >> np.uint64(32)).astype(np.uint32)


def histogram_bins(values: np.ndarray) -> np.ndarray:
    """The bin of each positive float32 value (numpy's searchsorted on HIST_EDGES, right side)."""
    codes = np.ascontiguousarray(values, np.float32).view(np.int32) >> _SHIFT
    return np.clip(codes - _LO_CODE + 1, 0, N_BINS - 1)


def sort_code(neg: np.ndarray) -> np.ndarray:
    """float32 -> uint32 whose unsigned order is the floats' order."""
    bits = np.ascontiguousarray(neg, np.float32).view(np.uint32)
    return np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))


def _merge_rows(
    score: np.ndarray,
    ords: np.ndarray,
    vals: np.ndarray,
    r: np.ndarray,
    c_score: np.ndarray,
    c_ord: np.ndarray,
    c_val: np.ndarray,
) -> None:
    """Merge candidates (row r, uint32 score, ord, value) into the per-row lists (F, m), each
    kept sorted by (score, ord) ascending, empty slots (ord NO_ORD) last: in place. The
    candidates come row by row in ord order and after every kept entry in ord, so one
    stable sort on (row, score) orders ties by ord."""
    m = score.shape[1]
    rows = np.unique(r)
    old = ords[rows] != NO_ORD
    R = np.concatenate([np.repeat(rows, m)[old.ravel()], r])
    S = np.concatenate([score[rows][old], c_score])
    O = np.concatenate([ords[rows][old], c_ord])
    V = np.concatenate([vals[rows][old], c_val])
    order = np.argsort(R.astype(np.uint64) << np.uint64(32) | S.astype(np.uint64), kind="stable")
    R, S, O, V = R[order], S[order], O[order], V[order]
    first = np.flatnonzero(np.r_[True, R[1:] != R[:-1]])
    rank = np.arange(len(R)) - np.repeat(first, np.diff(np.r_[first, len(R)]))
    keep = rank < m
    ords[rows] = NO_ORD
    vals[rows] = 0
    score[rows] = NO_KEY
    score[R[keep], rank[keep]] = S[keep]
    ords[R[keep], rank[keep]] = O[keep]
    vals[R[keep], rank[keep]] = V[keep]


class FeatureAccumulator:
    """The state of the pass for F features (rows) and top-k / pool sizes.

    Args:
        n_features: F (rows).
        k: top activations kept per feature.
        pool: sample pool per feature (0: none).
        seed: the sampling seed.
        kernel: "numba" (actstore.features.topk.kernel: one compiled pass over the batch), "numpy"
            (the reference below), or "auto" (numba when it is installed). Both give the
            same state, but for the last bits of the float64 sums (another summation order).
    """

    def __init__(self, n_features: int, k: int, pool: int, seed: int, kernel: str = "auto"):
        from actstore.features.topk import kernel as fused

        if kernel not in ("auto", "numba", "numpy"):
            raise ValueError(f"kernel must be 'auto', 'numba' or 'numpy'. Got {kernel!r}.")
        if kernel == "numba" and not fused.AVAILABLE:
            raise ImportError("the numba kernel needs numba: pip install numba")
        self.fused = fused.AVAILABLE and kernel != "numpy"
        if kernel == "auto" and not fused.AVAILABLE:
            fused.warn_missing()
        self.k, self.pool, self.seed = k, pool, seed
        self.top_val = np.zeros((n_features, k), np.float32)  # 0: empty slot (only values > 0 enter)
        self.top_code = np.full((n_features, k), NO_KEY, np.uint32)  # sort_code(-value): the sort score
        self.top_ord = np.full((n_features, k), NO_ORD, np.int64)
        self.max = np.full(n_features, -np.inf, np.float32)
        self.n_pos = np.zeros(n_features, np.int64)
        self.sum_pos = np.zeros(n_features, np.float64)
        self.hist = np.zeros((n_features, N_BINS), np.int64)
        self.pool_key = np.full((n_features, pool), NO_KEY, np.uint32)
        self.pool_val = np.zeros((n_features, pool), np.float32)
        self.pool_ord = np.full((n_features, pool), NO_ORD, np.int64)
        self.n_tokens = 0
        self._heaps = False  # the fused kernels keep heaps; finish() sorts them

    def update(
        self, acts_ft: np.ndarray, ords: np.ndarray, cols: np.ndarray | None = None, clipped: bool = False
    ) -> None:
        """Add a batch: acts_ft (F, n) float32, or float16 with the fused kernel (any memory
        layout: a transposed token-major array is fine), ords (n,) increasing and all greater
        than those of earlier batches. With cols, the tokens are the columns cols of acts_ft
        (F, N) (the kernel reads them in place: no gather copy). clipped: the values are a ReLU's
        input, the batch is max(acts_ft, 0) (only the max of a feature without positive values
        differs, and the update takes care of it)."""
        if not self.fused:
            if cols is not None:
                acts_ft = acts_ft[:, cols]
            if clipped:
                acts_ft = np.maximum(acts_ft, 0)
            self.finish()
            return self._update_numpy(np.ascontiguousarray(acts_ft, np.float32), ords)
        from actstore.features.topk import kernel

        n = acts_ft.shape[1] if cols is None else len(cols)
        if not n:
            return
        self.n_tokens += n
        keys = hash_keys(ords, self.seed) if self.pool else np.zeros(0, np.uint32)
        ords = np.ascontiguousarray(ords, np.int64)
        if acts_ft.dtype == np.float16 and acts_ft.T.flags.c_contiguous:  # stored float16 rows, read in place
            from actstore.features.topk import kernel16

            rows = np.arange(n, dtype=np.int64) if cols is None else np.ascontiguousarray(cols, np.int64)
            kernel16.update(self, acts_ft.T, rows, ords, keys, _LO_CODE, N_BINS)
        else:
            x = acts_ft if cols is None else acts_ft[:, cols]
            kernel.update(self, np.ascontiguousarray(x, np.float32), ords, keys, _LO_CODE, N_BINS, clipped)

    def as_heaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Put the top-k and pool rows in the fused kernels' heap order (a min-heap on
        (value, -ord), a max-heap on (key, ord), the filled slots first); returns the filled
        counts per feature, which the kernels keep up to date."""
        top_filled, pool_filled = self.top_ord != NO_ORD, self.pool_ord != NO_ORD
        if not self._heaps:
            self._reorder(np.lexsort((-self.top_ord, np.where(top_filled, self.top_val, np.inf)), axis=1), None)
            primary = np.where(pool_filled, -self.pool_key.astype(np.int64), 1 << 33)
            self._reorder(None, np.lexsort((-self.pool_ord, primary), axis=1))
            self._heaps = True
        return top_filled.sum(axis=1), pool_filled.sum(axis=1)

    def finish(self) -> None:
        """Rows in rank order (what the numpy update and the tables read): the top k by value
        descending, then ord; the pool by (key, ord); empty slots last."""
        if self._heaps:
            self._reorder(
                np.lexsort((self.top_ord, -self.top_val), axis=1), np.lexsort((self.pool_ord, self.pool_key), axis=1)
            )
            filled = self.top_ord != NO_ORD
            self.top_code = np.where(filled, sort_code(-self.top_val), NO_KEY).astype(np.uint32)
            self._heaps = False

    def _reorder(self, top: np.ndarray | None, pool: np.ndarray | None) -> None:
        if top is not None:
            self.top_val = np.take_along_axis(self.top_val, top, axis=1)
            self.top_ord = np.take_along_axis(self.top_ord, top, axis=1)
        if pool is not None and self.pool:
            self.pool_key = np.take_along_axis(self.pool_key, pool, axis=1)
            self.pool_val = np.take_along_axis(self.pool_val, pool, axis=1)
            self.pool_ord = np.take_along_axis(self.pool_ord, pool, axis=1)

    def _update_numpy(self, acts_ft: np.ndarray, ords: np.ndarray) -> None:
        """The reference update on a C-contiguous (F, n) float32 batch: three passes over the
        batch (max, > 0, the positions of the positive values); everything else works on
        those positions only."""
        n = acts_ft.shape[1]
        if n == 0:
            return
        self.n_tokens += n
        np.maximum(self.max, acts_ft.max(axis=1), out=self.max)
        r, c = np.nonzero(acts_ft > 0)  # row-major: rows ascending, then tokens in ord order
        if not len(r):
            return
        v = acts_ft[r, c]
        F = len(self.n_pos)
        self.n_pos += np.bincount(r, minlength=F)
        self.sum_pos += np.bincount(r, weights=v, minlength=F)
        self.hist += np.bincount(r * N_BINS + histogram_bins(v), minlength=self.hist.size).reshape(self.hist.shape)
        cand = v > self.top_val[r, -1]  # only values above the row's k-th can enter
        if (
            cand.sum() > 4 * F * self.k and n > self.k
        ):  # early batches: first cut each row to the batch's own top k (and ties)
            finite = np.where(np.isnan(acts_ft), -np.inf, acts_ft)  # NaN never enters; partition sorts it last
            kth = np.partition(finite, n - self.k, axis=1)[:, n - self.k]
            cand &= v >= kth[r]
        if cand.any():
            rc, vc = r[cand], v[cand]
            _merge_rows(self.top_code, self.top_ord, self.top_val, rc, sort_code(-vc), ords[c[cand]], vc)
        if self.pool:
            keys = hash_keys(ords, self.seed)[c]
            cand = (keys < self.pool_key[r, -1]) | (
                self.pool_ord[r, -1] == NO_ORD
            )  # a key equal to the m-th has a larger ord: out
            if (
                cand.sum() > 4 * F * self.pool and n > self.pool
            ):  # early batches: first cut each row to its pool-th smallest key
                kb = np.full(acts_ft.shape, NO_KEY, np.uint32)
                kb[r, c] = keys
                cut = np.partition(kb, self.pool - 1, axis=1)[:, self.pool - 1]
                cand &= keys <= cut[r]
            if cand.any():
                _merge_rows(self.pool_key, self.pool_ord, self.pool_val, r[cand], keys[cand], ords[c[cand]], v[cand])
