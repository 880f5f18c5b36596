"""The compiled update for float16 rows read as they are stored (neurons of a float16
store): token-major (N, F) bit patterns, no conversion and no transpose.

Per value the loop does integer work only. A float16's top byte (sign, exponent and the top
2 mantissa bits) is a histogram code; one packed uint32 counter per (feature, code) adds
`1 << 20` plus the value's low mantissa byte, unpacked into int64 totals every CHUNK
tokens. From the totals, after the batch (numpy, F x 256): the positive count, the exact sum
of the positive values (a normal float16 in code c with low byte l is
2**(e - 25) * (1024 + (c & 3) * 256 + l), e = c >> 2) and the float32 histogram bins
(actstore.features.topk.accum: exponent and 2 mantissa bits, the same edges). Entry into the top
k is one int16 compare against the bar's bits (a positive float16 orders as its int16),
which vectorises; the max is the top k's largest (or, for a feature without a positive
value, the batch's max). What the codes cannot tell (positive subnormals, infinities, NaN)
takes a rare branch. The heaps and threads are actstore.features.topk.kernel's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.dtypes import f32_to_f16
from actstore.features.topk.kernel import heap_offer, njit

BLOCK = 32  # features per block: a block's counters (32 x 256 uint32) stay in L1 over the batch
ONE = 1 << 20  # a packed uint32 counter: count << 20 | sum of low bytes (< 2**20 for up to CHUNK tokens)
CHUNK = 4096  # tokens between unpacking the counters into int64 totals
STEP = 256  # tokens between updates of the bars (the top-k and pool entries are checked after each step)
POS_CODES = np.arange(4, 0x7C)  # codes of positive normal float16 values (exponent 1..30)


def sort_key(u: np.ndarray) -> np.ndarray:
    """float16 bits -> uint16 key with the values' order (NaN aside)."""
    u = u.astype(np.uint16)
    return u ^ (np.uint16(0x8000) | ((u >> 15) * np.uint16(0x7FFF)))


def f16_tables(lo_code: int, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Every float16 bit pattern's float32 value and histogram bin (the bin of a value <= 0
    is never counted)."""
    lut = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    code = (lut.view(np.int32) >> 21) - lo_code + 1
    return lut, np.clip(code, 0, n_bins - 1).astype(np.int32)


@njit
def _pool_thr(pool_key, pool_n, b0, b1):
    """The largest pool bar of features b0..b1 (2**32 when a pool has room, 0 without pools):
    a token whose key is not below it enters no pool of the block."""
    m = pool_key.shape[1]
    gthr = 0
    if m == 0:
        return gthr
    for f in range(b0, b1):
        gthr = max(gthr, np.int64(pool_key[f, 0]) if pool_n[f] == m else (1 << 32))
    return gthr


@njit
def _rare_row(row, b0, lut, lut_bin, nan, rare_cnt, rare_sum, rare_hist):
    """What the codes cannot tell, in one token's row: NaN, +inf, positive subnormals."""
    for j in range(row.shape[0]):
        u = np.int64(row[j]) & 0xFFFF
        if (u & 0x7FFF) > 0x7C00:
            nan[b0 + j] = True
        elif u == 0x7C00 or (0 < u < 0x400):
            rare_cnt[b0 + j] += 1
            rare_sum[b0 + j] += lut[u]
            rare_hist[b0 + j, lut_bin[u]] += 1


@njit
def _hot(acts, cols, i0, i1, b0, b1, thr, packed, hits, rares):
    """The hot loop over tokens i0..i1 of features b0..b1: vectorised compares (top-k entry,
    rare values) noting the tokens to look at again, then the packed counters. Its own
    compiled function, so that it is optimised (vectorised) alone."""
    n_hits = 0
    n_rares = 0
    th = thr[: b1 - b0]
    for i in range(i0, i1):
        row = acts[cols[i], b0:b1]
        hit = np.int32(0)
        rare = np.int32(0)
        for j in range(row.shape[0]):
            v = row[j]
            hit |= np.int32(v > th[j])
            rare |= np.int32(((v > 0) & (v < 0x400)) | ((v & 0x7FFF) >= 0x7C00))  # subnormal > 0, inf, NaN
        hits[n_hits] = i
        n_hits += hit
        rares[n_rares] = i
        n_rares += rare
        for j in range(row.shape[0]):
            u = np.int64(row[j]) & 0xFFFF
            packed[j, u >> 8] += np.uint32(ONE + (u & 0xFF))
    return n_hits, n_rares


@njit
def _block(
    acts, cols, ords, keys, f0, f1, lut, lut_bin,
    counts, lows, nan, rare_cnt, rare_sum, rare_hist, top_key, top_val, top_ord, top_n, pool_key, pool_val, pool_ord, pool_n,
):  # fmt: skip
    n = cols.shape[0]
    k = top_val.shape[1]
    m = pool_key.shape[1]
    packed = np.zeros((BLOCK, 256), np.uint32)
    thr = np.zeros(BLOCK, np.int16)
    hits = np.empty(STEP, np.int64)
    rares = np.empty(STEP, np.int64)
    for b0 in range(f0, f1, BLOCK):
        b1 = min(f1, b0 + BLOCK)
        w = b1 - b0
        # the bars as int16 bits (0, +0, while there is room): a float16 beats one iff its int16 is larger
        for j in range(w):
            thr[j] = np.int16(np.int64(top_key[b0 + j, 0]) ^ 0x8000) if top_n[b0 + j] == k else 0
        since = 0  # tokens counted since the counters were unpacked
        for i0 in range(0, n, STEP):  # steps of STEP tokens: the bars rise between steps
            i1 = min(n, i0 + STEP)
            n_hits, n_rares = _hot(acts, cols, i0, i1, b0, b1, thr, packed, hits, rares)
            for h in range(n_rares):
                _rare_row(acts[cols[rares[h]], b0:b1], b0, lut, lut_bin, nan, rare_cnt, rare_sum, rare_hist)
            for h in range(n_hits):  # tokens where some feature beat its bar (stale bars: a superset)
                i = hits[h]
                row = acts[cols[i], b0:b1]
                for j in range(w):
                    u = np.int64(row[j]) & 0xFFFF
                    if row[j] > thr[j] and u <= 0x7C00:  # a positive value (+inf included, NaN not) above the bar
                        f = b0 + j
                        heap_offer(f, np.uint16(u ^ 0x8000), ords[i], lut[u], top_key, top_val, top_ord, top_n, -1)
                        thr[j] = np.int16(np.int64(top_key[f, 0]) ^ 0x8000) if top_n[f] == k else 0
            if m:  # the pool: the m smallest (key, ord) of each feature's positive tokens
                gthr = _pool_thr(pool_key, pool_n, b0, b1)
                n_c = 0
                for i in range(i0, i1):
                    if keys[i] < gthr:
                        hits[n_c] = i
                        n_c += 1
                # smallest keys first (the pool is a set: the order does not change it): once the
                # pools fill, the bar drops below the rest and the loop ends
                order = np.argsort(keys[hits[:n_c]], kind="mergesort")
                for h in range(n_c):
                    i = hits[order[h]]
                    if keys[i] >= gthr:
                        break
                    row = acts[cols[i], b0:b1]
                    _pool_token(row, b0, keys[i], ords[i], lut, pool_key, pool_val, pool_ord, pool_n)
                    gthr = _pool_thr(pool_key, pool_n, b0, b1)
            since += i1 - i0
            if since + STEP <= CHUNK and i1 < n:
                continue
            since = 0
            for j in range(w):  # unpack
                q = packed[j]
                for c in range(256):
                    if q[c]:
                        counts[b0 + j, c] += q[c] >> 20
                        lows[b0 + j, c] += q[c] & (ONE - 1)
                        q[c] = 0


@njit
def _pool_token(row, b0, key, o, lut, pool_key, pool_val, pool_ord, pool_n):
    m = pool_key.shape[1]
    for j in range(row.shape[0]):
        u = np.int64(row[j]) & 0xFFFF
        f = b0 + j
        if lut[u] > 0 and (pool_n[f] < m or key < pool_key[f, 0]):
            heap_offer(f, key, o, lut[u], pool_key, pool_val, pool_ord, pool_n, 1)


def code_bins(lo_code: int, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """For POS_CODES: the start of each run of codes with one float32 bin (reduceat), and those bins."""
    e16, mant = POS_CODES >> 2, POS_CODES & 3
    code32 = ((e16 - 15 + 127) << 2) | mant
    bins = np.clip(code32 - lo_code + 1, 0, n_bins - 1)
    starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    return starts, bins[starts]


def code_values() -> tuple[np.ndarray, np.ndarray]:
    """For POS_CODES: (scale, base) with sum = scale * (count * base + low-byte sum)."""
    e16, mant = POS_CODES >> 2, POS_CODES & 3
    return np.ldexp(1.0, e16 - 25), (1024 + mant * 256).astype(np.float64)


_TABLES: dict[str, np.ndarray] = {}


def _totals(acc: Any, F: int, n_bins: int) -> tuple[np.ndarray, ...]:
    """A batch's totals, zeroed: arrays the accumulator keeps from batch to batch (1.3 MB
    for 256 features: fresh memory for each would cost page faults, about 2 ms a MB on a VM)."""
    kept = getattr(acc, "_totals16", None)
    if kept is None or kept[0].shape != (F, 256) or kept[5].shape != (F, n_bins):
        kept = acc._totals16 = (
            np.zeros((F, 256), np.int64),
            np.zeros((F, 256), np.int64),
            np.zeros(F, np.bool_),
            np.zeros(F, np.int64),
            np.zeros(F, np.float64),
            np.zeros((F, n_bins), np.int64),
        )
        return kept
    for a in kept:
        a.fill(0)
    return kept


def update(
    acc: Any, acts: np.ndarray, cols: np.ndarray, ords: np.ndarray, keys: np.ndarray, lo_code: int, n_bins: int
) -> None:
    """Apply a batch of float16 rows: token i is row cols[i] of acts (N, F) float16,
    C-contiguous; everything else as actstore.features.topk.kernel.update."""
    from actstore.features.topk import kernel

    if not _TABLES:
        _TABLES["lut"], _TABLES["lut_bin"] = f16_tables(lo_code, n_bins)
        _TABLES["starts"], _TABLES["bins"] = code_bins(lo_code, n_bins)
        _TABLES["scale"], _TABLES["base"] = code_values()
    F = acts.shape[1]
    i16 = np.ascontiguousarray(acts).view(np.int16)
    counts, lows, nan, rare_cnt, rare_sum, rare_hist = _totals(acc, F, n_bins)
    top_n, pool_n = acc.as_heaps()
    filled = np.arange(acc.top_val.shape[1]) < top_n[:, None]
    top_key = np.where(filled, sort_key(f32_to_f16(acc.top_val).view(np.uint16)), 0x8000).astype(np.uint16)
    head = (i16, cols, ords, keys.astype(np.int64))
    tail = (_TABLES["lut"], _TABLES["lut_bin"], counts, lows, nan, rare_cnt, rare_sum, rare_hist)
    tail += (top_key, acc.top_val, acc.top_ord, top_n, acc.pool_key, acc.pool_val, acc.pool_ord, pool_n)
    kernel.run_blocks(_block, F, len(cols), head, tail, align=BLOCK)
    count, low = counts[:, POS_CODES], lows[:, POS_CODES]
    acc.n_pos += count.sum(axis=1) + rare_cnt
    acc.sum_pos += (count * _TABLES["base"] + low) @ _TABLES["scale"] + rare_sum
    acc.hist[:, _TABLES["bins"]] += np.add.reduceat(count, _TABLES["starts"], axis=1)
    acc.hist += rare_hist
    kernel.update_max(acc, nan, lambda rows: acts[cols[:, None], rows[None, :]].max(axis=0), top_n)
