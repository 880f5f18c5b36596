"""Normalisation constants from a store's running statistics."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from actstore.errors import CaptureError
from actstore.stats import stats_key


@dataclass(frozen=True)
class Normalization:
    """Per-dimension mean and standard deviation and the mean L2 norm of one layer's vectors."""

    mean: np.ndarray
    std: np.ndarray
    mean_norm: float
    count: int


def normalization(store: object, layer: int, segment: str | None = None) -> Normalization:
    """Statistics of `layer` (and `segment`; the only one by default) for normalising inputs:
    over the tokens the loaders' default mask keeps (content tokens only for a text store
    whose labels mark token kinds: actstore.read.masks).

    Args:
        store: an ActStore or the path of a finalized store written with statistics.
        layer: a stored layer number.
        segment: a segment name; needed when the store has several.

    Example: `(x - n.mean) / n.std`, or `x * sqrt(d_model) / n.mean_norm` (saev's scaling).
    """
    from actstore.read.store import ActStore

    st_obj = store if isinstance(store, ActStore) else ActStore(os.fspath(store))  # type: ignore[arg-type]
    stats = st_obj.stats()
    if stats is None:
        raise CaptureError(
            f"{st_obj.path} has no statistics; write it with statistics on (the default of actstore write)"
        )
    segs = st_obj.segments
    if segment is None:
        if len(segs) != 1:
            raise CaptureError(f"{st_obj.path} has segments {list(segs)}; say which one")
        segment = segs[0]
    key = stats_key(layer, segment)
    if key not in stats.keys:
        raise CaptureError(f"no statistics for layer {layer}, segment {segment!r}; the store has {stats.keys}")
    k = stats.keys.index(key)
    n = int(stats.count[k])
    return Normalization(
        mean=stats.mean[k].copy(),
        std=np.sqrt(stats.m2[k] / max(n, 1)),
        mean_norm=float(stats.norm_sum[k] / max(n, 1)),
        count=n,
    )
