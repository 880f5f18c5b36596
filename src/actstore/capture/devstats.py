"""A batch's activation statistics, computed where the activations are (the model's device).

`moments(x, keep)` reduces one (layer, segment) of a batch, in the stored dtype, to one
float64 vector: the fields of actstore.stats.RunningStats for that batch (count of vectors
kept, of vectors holding a non-finite value, the sum of their L2 norms, min, max,
per-dimension mean and M2). The writer thread folds it into the shard's RunningStats with
the same exact merge (Chan's formula, float64) as every other batch: `running_stats`.

On a GPU the batch is reduced in float64, masked (no host synchronisation), in a handful
of kernels. On a CPU it is reduced in blocks of about BLOCK_VALUES values that stay in the
cache, in float32 (each block's own mean subtracted before its squares: no cancellation),
and the blocks' moments merged exactly in float64; a batch holding a non-finite or huge
value takes the float64 path. The float32 blocks agree with float64 to about 1e-8
relative (tests/test_capture_pipeline.py checks <= 1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from actstore.stats import RunningStats

BLOCK_VALUES = 2**18  # values per CPU block: 1 MiB in float32, within a core's L2 or L3 cache
HEAD = 6  # count, nonfinite, overflow, norm_sum, min, max; then mean (D) and m2 (D)


def width(d_model: int) -> int:
    """Length of one moments vector."""
    return HEAD + 2 * d_model


def moments(x: Any, keep: Any = None, overflow: Any = 0) -> Any:
    """The statistics of the vectors x (..., D) (those where `keep` (...) is True) as one
    float64 vector on x's device; `overflow` (a count, int or device scalar) is carried along."""
    import torch

    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    k2 = None if keep is None else keep.reshape(-1)
    if x.device.type != "cpu":
        head, mean, m2 = _masked_f64(x2, k2)
    else:
        head, mean, m2 = _blocks_f32(x2, k2)
    head[2] = overflow
    return torch.cat([head, mean, m2])


def _masked_f64(x: Any, keep: Any) -> tuple[Any, Any, Any]:
    """Exact float64 moments of the kept finite rows, without a host synchronisation."""
    import torch

    xf = x.double()
    finite = torch.isfinite(xf).all(1)
    rows = finite if keep is None else finite & keep
    bad = (~finite).sum() if keep is None else (keep & ~finite).sum()
    w = rows[:, None]
    n = rows.sum()
    xz = torch.where(w, xf, 0.0)
    norm_sum = torch.linalg.vector_norm(xz, dim=1).sum()
    lo = torch.where(w, xf, torch.inf).amin()
    hi = torch.where(w, xf, -torch.inf).amax()
    mean = xz.sum(0) / n.clamp(min=1)
    dev = torch.where(w, xf - mean, 0.0)
    m2 = (dev * dev).sum(0)
    head = torch.stack(
        [n.double(), bad.double(), torch.zeros((), dtype=torch.float64, device=x.device), norm_sum, lo, hi]
    )
    return head, mean, m2


def _blocks_f32(x: Any, keep: Any) -> tuple[Any, Any, Any]:
    """CPU: float32 blocks in cache, merged exactly in float64 (see the module docstring).
    A batch holding a non-finite (or huge) value takes the float64 path whole."""
    import torch

    n_rows, d = x.shape
    step = max(16, BLOCK_VALUES // max(d, 1))
    buf = torch.empty((min(step, n_rows), d), dtype=torch.float32)  # one block's values, reused
    counts: list[int] = []
    means, m2s, lows, highs, norms = [], [], [], [], []
    for r0 in range(0, n_rows, step):
        b = x[r0 : r0 + step]
        if keep is not None:
            kb = keep[r0 : r0 + step]
            if not bool(kb.all()):
                b = b[kb]
        nb = b.shape[0]
        if nb == 0:
            continue
        bf = buf[:nb]
        bf.copy_(b)  # the block's own float32 copy, turned into deviations
        norms.append(torch.linalg.vector_norm(bf, dim=1).sum(dtype=torch.float64))
        lo, hi = torch.aminmax(bf)
        lows.append(lo)
        highs.append(hi)
        mean = bf.mean(0)
        m2s.append(bf.sub_(mean).square_().sum(0))
        means.append(mean)
        counts.append(nb)
    if not counts:
        zeros = torch.zeros(d, dtype=torch.float64)
        return torch.tensor([0.0, 0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64), zeros, zeros.clone()
    norm_sum = torch.stack(norms).sum()
    if not math.isfinite(float(norm_sum)):  # a non-finite (or huge) value: the exact path, whole
        return _masked_f64(x, keep)
    c = torch.tensor(counts, dtype=torch.float64)[:, None]
    mb, qb = torch.stack(means).double(), torch.stack(m2s).double()
    mean = (c * mb).sum(0) / c.sum()
    m2 = qb.sum(0) + (c * (mb - mean) ** 2).sum(0)  # the blocks merged exactly (Chan, all at once)
    lo, hi = torch.stack(lows).min().double(), torch.stack(highs).max().double()
    head = torch.stack(
        [c.sum(), torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64), norm_sum, lo, hi]
    )
    return head, mean, m2


def running_stats(keys: Sequence[str], d_model: int, packed: np.ndarray) -> RunningStats:
    """A RunningStats of one batch from its moments vectors (one row per key)."""
    st = RunningStats(keys, d_model)
    for k in range(len(keys)):
        row = packed[k]
        n, nonfinite, overflow, norm_sum, lo, hi = (float(v) for v in row[:HEAD])
        st.nonfinite[k] += int(nonfinite)
        st.overflow[k] += int(overflow)
        if n:
            st._merge_one(k, int(n), row[HEAD : HEAD + d_model], row[HEAD + d_model :], norm_sum, lo, hi)
    return st
