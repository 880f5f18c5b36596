"""The streaming pass's per-batch update compiled with numba, for float32 batches (encoded
features; neurons of bfloat16 and float32 stores): per step of a feature's row one
vectorised scan (positive count, NaN), then only the positive values (sum, histogram bin,
and the few that beat the top-k or pool bar); the top k and the pool are heaps. The float16
rows of a neurons pass have their own integer loop (actstore.features.topk.kernel16), which
shares the heaps and the threads here. The state and its meaning are those of
actstore.features.topk.accum, which holds the numpy reference of the same update; tests compare
the two on the same batches.

Features are split into contiguous ranges, a few a thread (the loops hold no GIL); a
feature's values are always visited in token order, so results do not depend on the number
of threads.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

try:
    import numba
except ImportError:  # the numpy reference does the work (actstore.features.topk.accum)
    numba = None

AVAILABLE = numba is not None
_TILE = 1024  # tokens per step of a feature's row: the dense / sparse choice is made per step
_MIN_PARALLEL = 1 << 18  # values per batch below which one thread does it all
_WARNED = False
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child makes its own


def warn_missing() -> None:
    """Once a process: the pass runs the numpy reference, which is much slower."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            "numba is not installed: the feature pass runs its numpy reference, about 20x slower; "
            "pip install 'actstore[views]' (or numba) for the compiled pass",
            RuntimeWarning,
            stacklevel=3,
        )


def _threads() -> int:
    """The threads the update uses: ACTSTORE_FEATURE_THREADS when set, else the cores this
    process may run on (at most 32)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    given = os.environ.get("ACTSTORE_FEATURE_THREADS")
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:
            from actstore.errors import FeatureError

            raise FeatureError(f"ACTSTORE_FEATURE_THREADS must be a whole number >= 1. Got {given!r}.")
        n = int(given)
    return max(1, min(n, 32))


def njit(fn: Any) -> Any:
    return numba.njit(nogil=True, cache=True)(fn) if numba is not None else fn


@njit
def _scan(bits):
    """Vectorised over a float32 slice's bits: the count of positive values (+inf included),
    and whether a NaN is there. (A loop over a slice's own range: numba then vectorises it.)"""
    cnt = np.int32(0)
    nans = np.int32(0)
    for t in range(bits.shape[0]):
        x = bits[t]
        cnt += np.int32((x > 0) & (x <= 0x7F800000))
        nans += np.int32((x & 0x7FFFFFFF) > 0x7F800000)
    return cnt, nans > 0


@njit
def _above(pa, oa, pb, ob, sign):
    """(pa, oa) above (pb, ob) in a max-heap on (sign * p, ord)."""
    return sign * pa > sign * pb or (pa == pb and oa > ob)


@njit
def heap_offer(f, p, o, val, prim, vals, ords, count, sign):
    """Offer (p, ord o, value val) to row f of a max-heap on (sign * p, ord) that keeps the
    m = prim.shape[1] lowest entries, over its first count[f] slots; vals and ords move
    with prim. The root is the entry that goes first, so a newcomer (the largest ord yet)
    enters a full heap only with sign * p below the root's. Top k: sign -1 on the values
    (the root is the smallest value, the latest of equal ones); pool: sign +1 on the keys."""
    m = prim.shape[1]
    n = count[f]
    if n < m:  # room: append, sift up
        i = n
        count[f] = n + 1
        while i > 0:
            q = (i - 1) // 2
            if _above(prim[f, q], ords[f, q], p, o, sign):
                break
            prim[f, i], vals[f, i], ords[f, i] = prim[f, q], vals[f, q], ords[f, q]
            i = q
    else:
        if not sign * p < sign * prim[f, 0]:
            return False
        i = 0  # replace the root, sift down
        while True:
            c = 2 * i + 1
            if c >= m:
                break
            if c + 1 < m and _above(prim[f, c + 1], ords[f, c + 1], prim[f, c], ords[f, c], sign):
                c += 1
            if _above(p, o, prim[f, c], ords[f, c], sign):
                break
            prim[f, i], vals[f, i], ords[f, i] = prim[f, c], vals[f, c], ords[f, c]
            i = c
    prim[f, i] = p
    vals[f, i] = val
    ords[f, i] = o
    return True


@njit
def _positives(a, bits, h, lo_code, n_bins, dense, thr, pkeys, pthr, top_c, pool_c):
    """The positive values of the slice a: their sum and histogram; the positions of the
    values above thr (>= 0) and of the positive ones with a key below pthr go into top_c
    and pool_c (candidates: the caller checks them against the bars, which rise as it
    inserts). Branch-free where most values are positive (neurons), with a predictable
    branch where few are (encoded features). No calls in the loop: numba optimises it whole.
    Returns (sum, number of top candidates, number of pool candidates)."""
    s = 0.0
    n_top = 0
    n_pool = 0
    if dense:
        for t in range(a.shape[0]):
            v = a[t]
            pos = v > 0
            s += v if pos else np.float32(0)
            h[min(max((bits[t] >> 21) - lo_code + 1, 0), n_bins - 1)] += pos
            top_c[n_top] = t
            n_top += v > thr
            pool_c[n_pool] = t
            n_pool += (pkeys[t] < pthr) & pos
    else:
        for t in range(a.shape[0]):
            v = a[t]
            if v > 0:
                s += v
                h[min(max((bits[t] >> 21) - lo_code + 1, 0), n_bins - 1)] += 1
                top_c[n_top] = t
                n_top += v > thr
                pool_c[n_pool] = t
                n_pool += pkeys[t] < pthr
    return s, n_top, n_pool


@njit
def _update_block(
    acts, bits, ords, keys, f0, f1, lo_code, n_bins,
    nan, n_pos, sum_pos, hist, top_val, top_ord, top_n, pool_key, pool_val, pool_ord, pool_n,
):  # fmt: skip
    n = acts.shape[1]
    k = top_val.shape[1]
    m = pool_key.shape[1]
    top_c = np.empty(_TILE, np.int64)
    pool_c = np.empty(_TILE, np.int64)
    for f in range(f0, f1):  # a feature's row is contiguous: one feature at a time, all its tokens
        a = acts[f]
        bb = bits[f]
        h = hist[f]
        thr = top_val[f, 0] if top_n[f] == k else np.float32(0)  # the bar to enter the top k
        pthr = -1 if m == 0 else np.int64(pool_key[f, 0]) if pool_n[f] == m else np.int64(1 << 32)
        for t0 in range(0, n, _TILE):
            t1 = min(n, t0 + _TILE)
            cnt, has_nan = _scan(bb[t0:t1])
            nan[f] |= has_nan
            if not cnt:
                continue
            n_pos[f] += cnt
            dense = 4 * cnt > t1 - t0
            s, n_top, n_pool = _positives(
                a[t0:t1], bb[t0:t1], h, lo_code, n_bins, dense, thr, keys[t0:t1], pthr, top_c, pool_c
            )
            sum_pos[f] += s
            for i in range(n_top):  # in token order, against the rising bar
                t = t0 + top_c[i]
                if a[t] > thr and heap_offer(f, a[t], ords[t], a[t], top_val, top_val, top_ord, top_n, -1):
                    thr = top_val[f, 0] if top_n[f] == k else np.float32(0)
            for i in range(n_pool):
                t = t0 + pool_c[i]
                if keys[t] < pthr and heap_offer(f, keys[t], ords[t], a[t], pool_key, pool_val, pool_ord, pool_n, 1):
                    pthr = np.int64(pool_key[f, 0]) if pool_n[f] == m else np.int64(1 << 32)


def update(
    acc: Any, acts: np.ndarray, ords: np.ndarray, keys: np.ndarray, lo_code: int, n_bins: int, clipped: bool = False
) -> None:
    """Apply one batch, acts (F, n) float32 C-contiguous with order keys ords and sampling
    keys keys (n,), to the accumulator's arrays in place (clipped: the batch is max(acts, 0)).
    The top-k and pool arrays are heaps here (FeatureAccumulator.as_heaps). The features are
    split over threads for a large batch."""
    nan = np.zeros(acts.shape[0], np.bool_)
    top_n, pool_n = acc.as_heaps()
    state = (nan, acc.n_pos, acc.sum_pos, acc.hist, acc.top_val, acc.top_ord, top_n)
    state += (acc.pool_key, acc.pool_val, acc.pool_ord, pool_n)
    head = (acts, acts.view(np.int32), ords, keys.astype(np.int64))
    run_blocks(_update_block, acts.shape[0], acts.shape[1], head, (lo_code, n_bins, *state))
    batch_max = (
        (lambda rows: np.maximum(acts[rows].max(axis=1), 0)) if clipped else (lambda rows: acts[rows].max(axis=1))
    )
    update_max(acc, nan, batch_max, top_n)


def update_max(acc: Any, nan: np.ndarray, batch_max: Any, top_n: np.ndarray) -> None:
    """The max after a batch: the largest kept value where a feature has a positive value
    (the top k holds it); else the batch's own max (batch_max(rows), for the few features
    with none); NaN where one was seen."""
    filled = np.arange(acc.top_val.shape[1]) < top_n[:, None]  # a heap's filled slots are its first top_n
    kept = np.where(filled, acc.top_val, -np.inf).max(axis=1).astype(np.float32)
    np.maximum(acc.max, kept, out=acc.max)
    dead = np.flatnonzero(kept == -np.inf)
    if len(dead):
        with np.errstate(invalid="ignore"):  # a NaN there is the answer
            np.maximum.at(acc.max, dead, np.asarray(batch_max(dead), np.float32))
    acc.max[nan] = np.nan


def run_blocks(fn: Any, F: int, n: int, head: tuple, tail: tuple, align: int = 1) -> None:
    """fn(*head, f0, f1, *tail) over contiguous feature ranges (multiples of `align`), on
    the threads when the batch is large (the compiled loops hold no GIL): a few ranges a
    thread, taken as threads come free, so a thread the read-ahead slows holds no one up."""
    global _POOL
    n_threads = _threads() if F * n >= _MIN_PARALLEL else 1
    blocks = -(-F // align)
    n_jobs = min(blocks, 4 * n_threads) if n_threads > 1 else 1
    cuts = np.minimum(np.linspace(0, blocks, n_jobs + 1).astype(np.int64) * align, F)
    if n_jobs == 1:
        fn(*head, 0, F, *tail)
        return
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers != n_threads:
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="actstore-features"))
    jobs = [_POOL[1].submit(fn, *head, int(a), int(b), *tail) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    for j in jobs:
        j.result()
