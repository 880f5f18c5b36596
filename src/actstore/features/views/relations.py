"""How features relate, from what a pass and its encoder hold (no second pass):

- decoder-cosine neighbours: the features whose decoder directions point most nearly the
  same way (SAEs and other sources with a decoder), among the features of the pass;
- co-occurrence: the features whose own top activations or interval samples fall on the same
  (example, token) as this feature's top activations, with how many of them;
- the tokens most often active: the token ids at this feature's top activations and
  interval samples, by count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

N_NEIGHBOURS = 10
N_COOCCURRING = 10
N_COMMON = 10
MAX_PER_POSITION = 256  # a position shared by more features counts for the first 256 (bounds the pairs)
BLOCK = 1024  # rows of the cosine matrix computed at a time


def neighbours(W_dec: np.ndarray, n: int = N_NEIGHBOURS, *, progress: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(F, n) indices (into W_dec's rows) and cosines of each row's nearest other rows, most
    similar first; a zero row's cosines are 0. `progress`: True for a bar on stderr, or a
    callable taking the rows done."""
    from actstore.progress import updater

    F = len(W_dec)
    n = min(n, max(F - 1, 0))
    W = np.asarray(W_dec, np.float32)
    norms = np.linalg.norm(W, axis=1)
    Wn = W / np.where(norms > 0, norms, 1.0)[:, None]
    idx = np.zeros((F, n), np.int64)
    cos = np.zeros((F, n), np.float32)
    if n == 0:
        return idx, cos
    try:
        import torch
    except ImportError:
        torch = None
    bar = updater(progress, F, "neighbours", "feature")
    for b0 in range(0, F, BLOCK):
        if bar is not None:
            bar(min(BLOCK, F - b0))
        S = Wn[b0 : b0 + BLOCK] @ Wn.T  # (b, F)
        rows = np.arange(len(S))
        S[rows, b0 + rows] = -np.inf  # never its own neighbour
        if torch is not None:  # topk on every core
            v, top = torch.topk(torch.from_numpy(S), n, dim=1, sorted=True)
            idx[b0 : b0 + len(S)], cos[b0 : b0 + len(S)] = top.numpy(), v.numpy()
            continue
        part = np.argpartition(-S, n - 1, axis=1)[:, :n]
        order = np.argsort(-np.take_along_axis(S, part, axis=1), axis=1, kind="stable")
        top = np.take_along_axis(part, order, axis=1)
        idx[b0 : b0 + len(S)] = top
        cos[b0 : b0 + len(S)] = np.take_along_axis(S, top, axis=1)
    cos[~np.isfinite(cos)] = 0.0
    return idx, cos


def _top_n(owner: np.ndarray, other: np.ndarray, count: np.ndarray, n: int) -> dict[int, list[tuple[int, int]]]:
    """Per owner: the n (other, count) pairs of largest count, ties by `other` (the input is
    sorted by (owner, other), as np.unique of owner * K + other gives it)."""
    if not len(owner):
        return {}
    top = np.int64(count.max()) + 1
    order = np.argsort(owner.astype(np.int64) * top + (top - 1 - count), kind="stable")
    owner, other, count = owner[order], other[order], count[order]
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    rank = np.arange(len(owner)) - np.repeat(starts, np.diff(np.r_[starts, len(owner)]))
    keep = rank < n
    out: dict[int, list[tuple[int, int]]] = {}
    for o, t, c in zip(owner[keep].tolist(), other[keep].tolist(), count[keep].tolist()):
        out.setdefault(o, []).append((t, c))
    return out


def cooccurring(
    top_features: np.ndarray,
    top_positions: np.ndarray,
    all_features: np.ndarray,
    all_positions: np.ndarray,
    n: int = N_COOCCURRING,
) -> dict[int, list[tuple[int, int]]]:
    """Per feature f of `top_features`: the other features g (of `all_features`) at the most of
    f's top positions, with that count. Positions are int64 keys of (example, token)."""
    keys, pos_of = np.unique(all_positions, return_inverse=True)
    feats, feat_of = np.unique(all_features, return_inverse=True)
    n_f = np.int64(len(feats))
    pair = np.unique(pos_of.astype(np.int64) * n_f + feat_of)  # each (position, feature) once, by position
    pos_s, feat_s = pair // n_f, pair % n_f
    starts = np.searchsorted(pos_s, np.arange(len(keys)))
    ends = np.minimum(np.searchsorted(pos_s, np.arange(len(keys)), side="right"), starts + MAX_PER_POSITION)
    where = np.searchsorted(keys, top_positions)
    found = (where < len(keys)) & (keys[np.minimum(where, len(keys) - 1)] == top_positions)
    at = where[found]
    own = np.searchsorted(feats, top_features[found])
    lens = (ends - starts)[at]
    if not lens.sum():
        return {}
    owner = np.repeat(own, lens)
    take = np.repeat(starts[at] - np.cumsum(np.r_[0, lens[:-1]]), lens) + np.arange(lens.sum())
    other = feat_s[take]
    keep = other != owner
    if not keep.any():
        return {}
    pairs, counts = np.unique(owner[keep] * n_f + other[keep], return_counts=True)
    return _top_n(feats[pairs // n_f], feats[pairs % n_f], counts, n)


def common_tokens(features: np.ndarray, token_ids: np.ndarray, n: int = N_COMMON) -> dict[int, list[tuple[int, int]]]:
    """Per feature: the n token ids that occur most among its rows, with their counts."""
    ok = token_ids >= 0
    if not ok.any():
        return {}
    ids, id_of = np.unique(token_ids[ok], return_inverse=True)
    m = np.int64(len(ids))
    pairs, counts = np.unique(features[ok].astype(np.int64) * m + id_of, return_counts=True)
    return _top_n(pairs // m, ids[pairs % m], counts, n)
