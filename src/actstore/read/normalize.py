"""Normalisation from a store's statistics: the one home (the loaders, the capture's
`normalization`, and a user's own loop all come here).

A store keeps, per (layer, segment) key `layer{L}/{segment}`, the count, per-dimension
mean and m2 (the sum of squared deviations) and the L2 norms' sum (docs/capture.md,
"Statistics"). From them:

- `normalization(store, layer, segment)`: mean, std = sqrt(m2 / count) (the population
  standard deviation, no epsilon: a statistic), mean L2 norm, count;
- `norm_tables(...)`: per key a (shift, scale) so that normalised = (x - shift) * scale:
  "standardize" takes shift = mean, scale = 1 / sqrt(m2 / count + VAR_EPS) (the epsilon
  keeps a dimension that never varies finite); "scale" takes shift = 0 and one factor
  sqrt(D) / max(mean L2 norm, NORM_EPS) (saev's scaling: mean L2 norm sqrt(D));
- `normalize_into(dst, src, shift, scale, keys)`: the cast and the normalisation of rows,
  on the CPU in row blocks (no OpenMP pool woken) or on a device in one pass.

Every problem (no statistics, a key the statistics lack, a key that counted no vector,
several segments and none named) raises StatisticsError, a ValueError.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.dtypes import TORCH_GRAIN
from actstore.errors import StatisticsError
from actstore.read.interface import Reader
from actstore.stats import stats_key

MODES = ("standardize", "scale")
VAR_EPS = 1e-6  # added to the variance before 1/sqrt in "standardize"
NORM_EPS = 1e-12  # floor of the mean L2 norm in "scale"


@dataclass(frozen=True)
class Normalization:
    """Per-dimension mean and standard deviation and the mean L2 norm of one layer's vectors."""

    mean: np.ndarray
    std: np.ndarray
    mean_norm: float
    count: int


def normalization(store: Reader, layer: int, segment: str | None = None) -> Normalization:
    """Statistics of `layer` (and `segment`; the only one by default) for normalising inputs:
    over the tokens the loaders' default mask keeps (content tokens only for a text store
    whose labels mark token kinds: actstore.read.masks).

    Args:
        store: an ActStore (any Reader) or the path of a finalized store written with statistics.
        layer: a stored layer number.
        segment: a segment name; needed when the store has several.

    Example: `(x - n.mean) / n.std`, or `x * sqrt(d_model) / n.mean_norm` (saev's scaling).
    """
    if isinstance(store, (str, os.PathLike)):
        from actstore.read.store import ActStore

        store = ActStore(os.fspath(store))
    segs = list(store.segments)  # type: ignore[attr-defined]
    if segment is None:
        if len(segs) != 1:
            raise StatisticsError(f"{_name(store)} has segments {segs}; say which one (segment=...)")
        segment = segs[0]
    st, pos = _key(store, stats_key(layer, segment), "normalization()")
    n = int(st.count[pos])
    return Normalization(
        mean=st.mean[pos].copy(), std=np.sqrt(st.m2[pos] / n), mean_norm=float(st.norm_sum[pos] / n), count=n
    )


def norm_tables(
    store: Reader, layers: Sequence[int], segments: Sequence[Any], mode: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, segment) key k = li*S + si: (shift (K, D), scale (K, D)) float32 so that
    normalised = (x - shift) * scale (modes: the module docstring). `segments`: names, or
    objects with a `.name`."""
    if mode not in MODES:
        raise StatisticsError(f"normalize must be one of [None, 'standardize', 'scale']. Got {mode!r}.")
    names = [s if isinstance(s, str) else s.name for s in segments]
    d = int(store.d_model)
    shift = np.zeros((len(layers) * len(names), d), np.float32)
    scale = np.ones_like(shift)
    for li, layer in enumerate(layers):
        for si, seg in enumerate(names):
            st, pos = _key(store, stats_key(layer, seg), f"normalize={mode!r}")
            k, n = li * len(names) + si, int(st.count[pos])
            if mode == "standardize":
                shift[k] = st.mean[pos]
                scale[k] = 1.0 / np.sqrt(st.m2[pos] / n + VAR_EPS)
            else:
                scale[k] = np.sqrt(d) / max(float(st.norm_sum[pos]) / n, NORM_EPS)
    return shift, scale


def normalize_into(dst: Any, src: Any, shift: Any | None, scale: Any | None, keys: Any | None = None) -> Any:
    """dst = (src cast to dst's dtype - shift[k]) * scale[k] per row, k = keys[row] (None:
    key 0), in place; `dst` may be `src`. Torch tensors, (rows, D), on one device; shift and
    scale (K, D) from `norm_tables` (None: the cast alone). On the CPU in blocks of rows
    under torch's parallel grain: each op runs inline on this thread (whole-batch ops would
    wake torch's OpenMP pool, whose spinning threads cost several times the work itself, on
    the cores the readers and the trainer use). Returns dst."""
    one = keys is None or shift is None or len(shift) == 1
    step = len(dst) if dst.is_cuda else max(1, TORCH_GRAIN // max(dst.shape[-1], 1))
    for i in range(0, len(dst), step):
        o = dst[i : i + step]
        if src is not dst:
            o.copy_(src[i : i + step])  # copy: the dtype conversion
        if shift is not None:
            if one:
                o.sub_(shift[0]).mul_(scale[0])
            else:
                k = keys[i : i + step]  # index_select: advanced indexing wakes the OpenMP pool
                o.sub_(shift.index_select(0, k)).mul_(scale.index_select(0, k))
    return dst


def _key(store: Reader, key: str, what: str) -> tuple[Any, int]:
    """(the store's statistics, the position of `key`), or the StatisticsError saying why not."""
    st = store.stats()
    if st is None:
        raise StatisticsError(
            f"{what} needs the store's statistics, but this store kept none ({_name(store)}); write it with "
            "ShardWriter(..., stats=True) (or `actstore write` with statistics), or do without normalisation"
        )
    if key not in st.keys:
        raise StatisticsError(f"the store's statistics lack {key!r}; they hold {st.keys}")
    pos = st.keys.index(key)
    if int(st.count[pos]) == 0:
        raise StatisticsError(f"the store's statistics for {key!r} count no vectors; cannot normalise")
    return st, pos


def _name(store: Reader) -> str:
    return str(getattr(store, "path", "this store"))
