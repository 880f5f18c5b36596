"""`top_activations`: one sequential pass over a layer's real tokens, many features at once.

Examples are read in store order (`read_many_into` of a few examples at a time, so an
object store answers with batched range requests), padding is never encoded, and the
tokens that the loaders' default mask leaves out (token label != 0: BOS, special and chat
template tokens) are left out unless `keep_special`. Memory is O(features x (k + pool))
plus one batch of `batch_elements` feature values, never tokens x features.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.dtypes import bf16_bits_to_f32
from actstore.layout import spec
from actstore.features.accum import HIST_EDGES, NO_KEY, NO_ORD, TOKEN_BITS, FeatureAccumulator, hash_keys, split_order
from actstore.features.encoders import Encoder
from actstore.errors import FeatureError
from actstore.errors import LayerNotFoundError, SegmentNotFoundError
from actstore.read.api import Reader, ReaderLike, as_reader
from actstore.read.masks import leaves_out_special

MAX_TOP_K = 10_000
DEFAULT_BATCH_ELEMENTS = 1 << 22  # feature values per encoded batch (16 MiB of float32)
READ_BYTES = 16 << 20  # activations read per group of examples (bounds the read buffers)


@dataclass
class FeatureTables:
    """What the pass found, as columns (numpy arrays), ready for parquet or pandas.

    top: feature, rank, example, token, activation (one row per (feature, rank), only
    positive activations); features: feature, max, density, mean_active, n_active,
    n_tokens, histogram ((F, N_BINS) counts on `hist_edges`); intervals: feature, interval,
    lo, hi, sample, example, token, activation, exact (False where the pool could not
    guarantee a uniform sample of the interval); meta: what was run.
    """

    top: dict[str, np.ndarray]
    features: dict[str, np.ndarray]
    intervals: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    hist_edges: np.ndarray = field(default_factory=lambda: HIST_EDGES.copy())


@dataclass(frozen=True)
class _Seg:
    name: str
    t_pad: int  # rows read_into fills: whole chunks


def _geometry(store: Reader) -> dict[str, _Seg]:
    return {s.name: _Seg(s.name, -(-s.t_max // s.t_chunk) * s.t_chunk) for s in store.config.segments}


def parse_features(spec: str | Sequence[int] | None, n_features: int) -> np.ndarray | None:
    """`0-4095,5000` or a list of ids -> sorted unique int64 ids (None: all)."""
    if spec is None:
        return None
    ids: list[int] = []
    if isinstance(spec, str):
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            try:
                lo, hi = int(a), int(b) if b else int(a)
            except ValueError:
                raise FeatureError(f"--features takes ids and ranges like '0-4095,5000'. Got {spec!r}.") from None
            ids.extend(range(lo, hi + 1))
    else:
        ids = [int(x) for x in spec]
    out = np.unique(np.asarray(ids, np.int64))
    if not len(out) or out[0] < 0 or out[-1] >= n_features:
        raise FeatureError(f"features must be ids in 0..{n_features - 1} (the encoder has {n_features}); got {spec!r}")
    return out


def top_activations(
    store: ReaderLike,
    layer: Any,
    encoder: Encoder,
    *,
    k: int = 20,
    features: str | Sequence[int] | None = None,
    segments: Sequence[str] | str | None = None,
    keep_special: bool = False,
    n_intervals: int = 5,
    per_interval: int = 5,
    pool: int | None = None,
    seed: int = 0,
    batch_elements: int = DEFAULT_BATCH_ELEMENTS,
    device: str | None = "auto",
    progress: bool | Callable[[int], Any] = False,
    kernel: str = "auto",
) -> FeatureTables:
    """Top-k activations, statistics and interval samples of many features, in one pass.

    Args:
        store: a Reader (actstore.open), or a store's path or URL (opened here).
        layer: a stored layer number or name.
        encoder: the directions (actstore.features.encoders / sources).
        k: top activations per feature (1..MAX_TOP_K).
        features: the feature ids (`"0-4095"` or a list); None: all.
        segments: segment names to read (default all); token positions stay those of `store[ex, layer]`.
        keep_special: include the tokens with a nonzero token label (BOS, specials, template).
        n_intervals, per_interval: SAEDashboard's equal-width intervals of the max, and the
            samples drawn in each (seeded).
        pool: the uniform sample kept per feature for the intervals (default 4 x their total).
        seed: the sampling seed.
        batch_elements: feature values encoded at once (memory: 4 bytes each, a few times).
        device: where the encode runs: "cpu", "cuda", "cuda:N" (torch), None (numpy), or
            "auto" (torch on the CPU when torch is installed, else numpy).
        progress: True for a bar on stderr, or a callable taking the examples done.
        kernel: the per-batch update: "numba" (compiled, one read of each value), "numpy"
            (the reference), or "auto" (numba when installed). The same tables either way.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_TOP_K:
        raise FeatureError(f"--top-k must be an int in 1..{MAX_TOP_K}. Got {k!r}.")
    if not (isinstance(n_intervals, int) and n_intervals >= 1 and isinstance(per_interval, int) and per_interval >= 0):
        raise FeatureError(
            f"intervals need n_intervals >= 1 and per_interval >= 0. Got {n_intervals!r}, {per_interval!r}."
        )
    store = as_reader(store)
    layer = store.layer_number(layer)
    if int(layer) not in [int(x) for x in store.layers]:
        raise LayerNotFoundError(f"layers [{layer}] are not stored; this store holds layers {list(store.layers)}")
    layer = int(layer)
    encoder.check_input(int(store.d_model), f"layer {layer} of {store.path}")
    ids = parse_features(features, encoder.n_features)
    device = _pick_device(device)
    n_f = encoder.n_features if ids is None else len(ids)
    pool = 4 * n_intervals * per_interval if pool is None else int(pool)
    acc = FeatureAccumulator(n_f, int(k), pool, int(seed), kernel=kernel)
    all_geo = _geometry(store)
    names = [segments] if isinstance(segments, str) else list(segments or all_geo)
    unknown = [x for x in names if x not in all_geo]
    if unknown or not names:
        raise SegmentNotFoundError(
            f"segments {unknown or names} are not in this store; it has segments {list(all_geo)}"
        )
    segs = [g for x, g in all_geo.items() if x in names]  # store order: order keys increase along the pass
    # the loaders' "content" mask: keep token label 0 (text stores with labels), unless keep_special
    use_mask = leaves_out_special(store) and not keep_special
    masks = [np.asarray(store.field(s.name + spec.TOKEN_LABELS_SUFFIX)) == 0 if use_mask else None for s in segs]
    lens = {name: np.asarray(store.field(name + spec.LEN_SUFFIX), np.int64) for name in all_geo}
    names = list(all_geo)
    before = {
        s.name: sum((lens[o] for o in names[: names.index(s.name)]), np.zeros(len(store), np.int64)) for s in segs
    }  # token offset of each segment
    dtype = np.dtype(spec.ACT_DTYPES[store.dtype])
    d = int(store.d_model)
    n_ex = len(store)
    offs = np.cumsum([0] + [s.t_pad for s in segs])  # each segment's rows within an example's block
    t_all = int(offs[-1])
    group = max(1, READ_BYTES // max(1, t_all * d * dtype.itemsize))
    tok_batch = max(1, batch_elements // max(1, n_f))
    bar = _bar(progress, n_ex)
    arange = np.arange(max((s.t_pad for s in segs), default=0), dtype=np.int64)
    direct = acc.fused and encoder.kind == "neurons"  # the kernel reads the stored rows in place

    def read_group(g0: int) -> tuple[range, np.ndarray, np.ndarray, np.ndarray]:
        exs = range(g0, min(n_ex, g0 + group))
        buf = np.empty((len(exs), t_all, d), dtype)
        items = [
            (e, layer, s.name, buf[i, offs[j] : offs[j] + s.t_pad])
            for i, e in enumerate(exs)
            for j, s in enumerate(segs)
        ]
        store.read_many_into(items)
        return exs, buf, *tokens(exs)  # on the read-ahead thread too: the kernel holds no GIL

    def tokens(exs: range) -> tuple[np.ndarray, np.ndarray]:
        """The kept tokens of a group: their rows in its buffer and their order keys (store
        order: by example, then segment, then position)."""
        e = np.arange(exs.start, exs.stop, dtype=np.int64)
        rows, ords = [], []
        for j, s in enumerate(segs):
            keep = arange[None, : s.t_pad] < lens[s.name][e][:, None]  # real tokens, never padding
            if masks[j] is not None:
                w = min(s.t_pad, masks[j].shape[1])
                keep[:, :w] &= masks[j][e, :w]
            r, c = np.nonzero(keep)
            rows.append(r * t_all + int(offs[j]) + c)
            ords.append((e[r] << TOKEN_BITS) + before[s.name][e[r]] + c)
        if len(segs) == 1:
            return rows[0], ords[0]
        order = np.argsort(np.concatenate(rows), kind="stable")  # buffer rows run in store order
        return np.concatenate(rows)[order], np.concatenate(ords)[order]

    pending_x: list[np.ndarray] = []
    pending_o: list[np.ndarray] = []
    n_pending = 0
    with ThreadPoolExecutor(1, thread_name_prefix="actstore-features-read") as reader:
        nxt = reader.submit(read_group, 0) if n_ex else None
        for g0 in range(0, n_ex, group):
            exs, buf, rows, ords = nxt.result()
            nxt = (
                reader.submit(read_group, g0 + group) if g0 + group < n_ex else None
            )  # read ahead while this one is encoded
            flat = buf.reshape(-1, d)
            if store.dtype == "bfloat16":
                flat = bf16_bits_to_f32(flat)
            if direct:
                acc.update((flat if ids is None else flat[:, ids]).T, ords, rows)
            elif len(rows):
                pending_x.append(flat[rows])
                pending_o.append(ords)
                n_pending += len(rows)
                while n_pending >= tok_batch:
                    n_pending = _flush(acc, encoder, ids, pending_x, pending_o, tok_batch, device)
            del buf, flat
            if bar is not None:
                bar(len(exs))
    while n_pending:
        n_pending = _flush(acc, encoder, ids, pending_x, pending_o, tok_batch, device)
    feat_ids = np.arange(n_f, dtype=np.int64) if ids is None else ids
    return _tables(acc, feat_ids, n_intervals, per_interval)


def _pick_device(device: str | None) -> str | None:
    if device != "auto":
        if device is not None:
            from actstore.features.torchenc import _device

            _device(device)  # a missing torch or accelerator is refused before the pass
        return device
    import importlib.util

    return "cpu" if importlib.util.find_spec("torch") is not None else None


def _flush(
    acc: FeatureAccumulator,
    encoder: Encoder,
    ids: np.ndarray | None,
    xs: list[np.ndarray],
    os_: list[np.ndarray],
    n: int,
    device: str | None,
) -> int:
    """Encode the first n pending tokens (all if fewer) and feed them; returns what remains."""
    x = np.concatenate(xs) if len(xs) > 1 else xs[0]
    o = np.concatenate(os_) if len(os_) > 1 else os_[0]
    xs.clear()
    os_.clear()
    if len(x) > n:
        xs.append(x[n:])
        os_.append(o[n:])
        x, o = x[:n], o[:n]
    lazy = acc.fused and encoder.activation == "relu"  # the kernel reads values <= 0 as 0: no ReLU pass
    acc.update(encoder.encode(x, ids, feature_major=True, device=device, relu_later=lazy), o, clipped=lazy)
    return sum(len(a) for a in xs)


def _bar(progress: Any, total: int) -> Callable[[int], Any] | None:
    if callable(progress):
        return progress
    if progress:
        from actstore.progress import bar

        b = bar(total=total, desc="features", unit="ex", file=sys.stderr)
        return b.update
    return None


def _tables(acc: FeatureAccumulator, ids: np.ndarray, n_intervals: int, per_interval: int) -> FeatureTables:
    acc.finish()
    filled = acc.top_val > 0
    r, c = np.nonzero(filled)
    ex, tok = split_order(acc.top_ord[r, c])
    top = {
        "feature": ids[r].astype(np.int32),
        "rank": c.astype(np.int32),
        "example": ex.astype(np.int64),
        "token": tok,
        "activation": acc.top_val[r, c].astype(np.float32),
    }
    n_tok = max(acc.n_tokens, 1)
    mean = np.divide(acc.sum_pos, acc.n_pos, out=np.zeros(len(ids)), where=acc.n_pos > 0)
    feats = {
        "feature": ids.astype(np.int32),
        "max": np.where(np.isfinite(acc.max), acc.max, 0).astype(np.float32),
        "density": (acc.n_pos / n_tok).astype(np.float64),
        "mean_active": mean.astype(np.float32),
        "n_active": acc.n_pos.copy(),
        "n_tokens": np.full(len(ids), acc.n_tokens, np.int64),
        "histogram": acc.hist,
    }
    return FeatureTables(top=top, features=feats, intervals=_intervals(acc, ids, n_intervals, per_interval))


def _intervals(acc: FeatureAccumulator, ids: np.ndarray, n_int: int, per: int) -> dict[str, np.ndarray]:
    """Equal-width intervals (lo, hi] of each feature's max, `per` samples each: the tokens
    with the smallest (key, ord) among the pool and the top-k (the keys the pool used).
    Exact when the pool holds all active tokens, or >= per of the interval's, or the top-k
    holds every token of the interval. Vectorised over features; a loop over intervals."""
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
    out: dict[str, list[np.ndarray]] = {
        n: [] for n in ("feature", "interval", "lo", "hi", "sample", "example", "token", "activation", "exact")
    }
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
        for name, col in (
            ("feature", ids[r]),
            ("interval", np.full(len(r), i)),
            ("lo", lo[r]),
            ("hi", hi[r]),
            ("sample", j),
            ("example", ex),
            ("token", tok),
            ("activation", vals[r, cols]),
            ("exact", exact[r]),
        ):
            out[name].append(col)
    types = {
        "feature": np.int32,
        "interval": np.int32,
        "lo": np.float32,
        "hi": np.float32,
        "sample": np.int32,
        "example": np.int64,
        "token": np.int32,
        "activation": np.float32,
        "exact": bool,
    }
    cat = {n: np.concatenate(out[n]).astype(types[n]) if out[n] else np.zeros(0, types[n]) for n in out}
    order = np.lexsort((cat["sample"], cat["interval"], cat["feature"]))
    return {n: a[order] for n, a in cat.items()}
