"""The pass's results as columns: from the per-feature accumulators (host arrays, in rank
order) to the rows of top.parquet, features.parquet and intervals.parquet, for one tail or
both.

The negative tail is the positive pass over the negated values (actstore.features.topk.layerpass):
its accumulator holds |value| for the negative values, so its rows here are negated back:
`activation`, `lo` and `hi` are negative (rank 0 = the lowest value; interval 0 the one
nearest zero, holding values in [lo, hi)), and the statistics become `min`, `n_negative`,
`density_negative`, `mean_negative` and `histogram_negative` (counts of |value| on the same
edges as the positive histogram).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.features.topk.accum import HIST_EDGES, NO_KEY, NO_ORD, FeatureAccumulator, hash_keys, split_order

SIGNS = ("positive", "negative", "both")
INTERVAL_COLUMNS = ("feature", "sign", "interval", "lo", "hi", "sample", "example", "token", "activation", "exact")
_INTERVAL_TYPES = {
    "feature": np.int32,
    "sign": np.int8,
    "interval": np.int32,
    "lo": np.float32,
    "hi": np.float32,
    "sample": np.int32,
    "example": np.int64,
    "token": np.int32,
    "activation": np.float32,
    "exact": bool,
}


@dataclass
class FeatureTables:
    """What the pass found, as columns (numpy arrays), ready for parquet or pandas.

    top: feature, sign, rank, example, token, activation (one row per (feature, sign,
    rank); sign +1 rows hold positive values, rank 0 the highest; sign -1 rows negative
    values, rank 0 the lowest). features: feature, max, density, mean_active, n_active,
    n_tokens, histogram ((F, N_BINS) counts on `hist_edges`), all of the positive side;
    with the negative tail also min, n_negative, density_negative, mean_negative,
    histogram_negative (counts of |value| on the same edges). intervals: feature, sign,
    interval, lo, hi, sample, example, token, activation, exact (False where the pool could
    not guarantee a uniform sample of the interval). sign: "positive", "negative" or "both".
    """

    top: dict[str, np.ndarray]
    features: dict[str, np.ndarray]
    intervals: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    hist_edges: np.ndarray = field(default_factory=lambda: HIST_EDGES.copy())
    sign: str = "positive"


def build_tables(
    pos: FeatureAccumulator,
    neg: FeatureAccumulator | None,
    ids: np.ndarray,
    n_intervals: int,
    per_interval: int,
    sign: str,
) -> FeatureTables:
    """The tables of a finished pass: `pos` the positive side's accumulator (with sign
    "negative" only its statistics are used), `neg` the negated values' (None for "positive")."""
    pos.finish()
    feats = _statistics(pos, ids)
    tops, ivs = [], []
    if sign != "negative":
        tops.append(_top(pos, ids, 1))
        ivs.append(_intervals(pos, ids, n_intervals, per_interval, 1))
    if neg is not None:
        neg.finish()
        stats = _statistics(neg, ids)
        feats |= {
            "min": -stats["max"],
            "n_negative": stats["n_active"],
            "density_negative": stats["density"],
            "mean_negative": -stats["mean_active"],
            "histogram_negative": stats["histogram"],
        }
        tops.append(_top(neg, ids, -1))
        ivs.append(_intervals(neg, ids, n_intervals, per_interval, -1))
    top = _sorted(tops, ("rank", "sign", "feature"))
    intervals = _sorted(ivs, ("sample", "interval", "sign", "feature"))
    return FeatureTables(top=top, features=feats, intervals=intervals, sign=sign)


def _sorted(parts: list[dict[str, np.ndarray]], keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The parts' rows together, ordered by feature, then sign +1 before -1, then the rest
    (lexsort's keys, last = primary; sign sorted descending)."""
    cat = {n: np.concatenate([p[n] for p in parts]) for n in parts[0]}
    order = np.lexsort(tuple(-cat[k] if k == "sign" else cat[k] for k in keys))
    return {n: a[order] for n, a in cat.items()}


def _top(acc: FeatureAccumulator, ids: np.ndarray, sign: int) -> dict[str, np.ndarray]:
    r, c = np.nonzero(acc.top_val > 0)
    ex, tok = split_order(acc.top_ord[r, c])
    return {
        "feature": ids[r].astype(np.int32),
        "sign": np.full(len(r), sign, np.int8),
        "rank": c.astype(np.int32),
        "example": ex.astype(np.int64),
        "token": tok,
        "activation": (sign * acc.top_val[r, c]).astype(np.float32),
    }


def _statistics(acc: FeatureAccumulator, ids: np.ndarray) -> dict[str, np.ndarray]:
    n_tok = max(acc.n_tokens, 1)
    mean = np.divide(acc.sum_pos, acc.n_pos, out=np.zeros(len(ids)), where=acc.n_pos > 0)
    return {
        "feature": ids.astype(np.int32),
        "max": np.where(np.isfinite(acc.max), acc.max, 0).astype(np.float32),
        "density": (acc.n_pos / n_tok).astype(np.float64),
        "mean_active": mean.astype(np.float32),
        "n_active": acc.n_pos.copy(),
        "n_tokens": np.full(len(ids), acc.n_tokens, np.int64),
        "histogram": acc.hist,
    }


def _intervals(acc: FeatureAccumulator, ids: np.ndarray, n_int: int, per: int, sign: int) -> dict[str, np.ndarray]:
    """Equal-width intervals (lo, hi] of each feature's max, `per` samples each: the tokens
    with the smallest (key, ord) among the pool and the top-k (the keys the pool used).
    Exact when the pool holds all active tokens, or >= per of the interval's, or the top-k
    holds every token of the interval. Vectorised over features; a loop over intervals.
    sign -1: the accumulator holds negated values; the rows are negated back."""
    F, M = acc.pool_ord.shape
    ords = np.concatenate([acc.pool_ord, acc.top_ord], axis=1)  # (F, M + k)
    vals = np.concatenate([acc.pool_val, acc.top_val], axis=1)
    in_pool = np.zeros(ords.shape, bool)
    in_pool[:, :M] = True
    valid = ords != NO_ORD
    # a top-k token already in the pool is dropped (the pool copy stays): equal ords sit side
    # by side once each row is sorted by ord, the pool's copy first (a stable sort)
    by_ord = np.argsort(ords, axis=1, kind="stable")
    o_sorted = np.take_along_axis(ords, by_ord, axis=1)
    dup = np.zeros(ords.shape, bool)
    rows_idx = np.arange(F)[:, None]
    dup[rows_idx, by_ord[:, 1:]] = (o_sorted[:, 1:] == o_sorted[:, :-1]) & (o_sorted[:, 1:] != NO_ORD)
    valid &= ~dup
    keys = np.where(valid, hash_keys(np.where(valid, ords, 0), acc.seed), NO_KEY).astype(np.uint64)
    ord_rank = np.empty(ords.shape, np.uint64)
    ord_rank[rows_idx, by_ord] = np.arange(ords.shape[1], dtype=np.uint64)
    rank_key = keys << np.uint64(32) | ord_rank  # (key, ord) as one sortable number
    m = np.where(np.isfinite(acc.max) & (acc.max > 0), acc.max, 0).astype(np.float64)
    pool_all = acc.n_pos <= M
    kth = acc.top_val[:, -1]
    out: dict[str, list[np.ndarray]] = {n: [] for n in INTERVAL_COLUMNS}
    for i in range(n_int):
        lo, hi = m * i / n_int, m * (i + 1) / n_int
        inside = valid & (vals > lo[:, None]) & (vals <= hi[:, None]) & (acc.n_pos > 0)[:, None]
        if per == 0 or not inside.any():
            continue
        score = np.where(inside, rank_key, np.iinfo(np.uint64).max)
        take = np.argsort(score, axis=1, kind="stable")[:, :per]
        ok = np.take_along_axis(inside, take, axis=1)
        exact = pool_all | ((inside & in_pool).sum(axis=1) >= per) | (lo >= kth)
        r, j = np.nonzero(ok)
        cols = take[r, j]
        ex, tok = split_order(ords[r, cols])
        bounds = (lo[r], hi[r]) if sign > 0 else (-hi[r], -lo[r])  # negative: [lo, hi), lo the farther from 0
        for name, col in (
            ("feature", ids[r]),
            ("sign", np.full(len(r), sign)),
            ("interval", np.full(len(r), i)),
            ("lo", bounds[0]),
            ("hi", bounds[1]),
            ("sample", j),
            ("example", ex),
            ("token", tok),
            ("activation", sign * vals[r, cols]),
            ("exact", exact[r]),
        ):
            out[name].append(col)
    return {n: np.concatenate(out[n]).astype(t) if out[n] else np.zeros(0, t) for n, t in _INTERVAL_TYPES.items()}
