"""What the loaders need from a store, through the Reader interface only
(actstore.read.interface), so that they work on any reader (an actstore store, a saev
directory from actstore.open): `len`, `layers`, `d_model`, `dtype`, `config.segments`,
`segment(name).lengths()`, `field`, `read_into(ex, layer, segment, out)` and `stats()`.

Per-token masks (the option hook): `token_mask` selects which tokens inside each
example's length are kept. It is one of
- "default" (every loader's default; actstore.read.masks): "content" for a text store
  whose labels mark token kinds (BOS, special and chat-template tokens left out: every
  --pack/--chunk window's BOS is an attention-sink outlier), every token otherwise (image
  stores, stores without labels);
- "all" or None: keep every token up to the length (only padding is skipped);
- "content": keep tokens whose stored token label is 0. `actstore write` with special
  tokens masked stores labels 0 = content, 1 = special token, 2 = chat template;
- another str NAME: the per-token array `store.field(f"{segment}_{NAME}")`, shape
  (N, T_max), nonzero = keep (e.g. "token_labels" on a saev directory keeps tokens whose
  labels.bin class is not 0, CLS included as 0; a future per-token uint8 field
  `<segment>_token_mask` would be used with "token_mask");
- a mapping {segment: array (N, T_max)} (segments left out are not masked);
- a callable segment_name -> array (N, T_max) or None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.errors import LayerNotFoundError, SegmentNotFoundError, TokenMaskError
from actstore.layout import spec
from actstore.read.interface import Reader
from actstore.read.layers import resolve_layer
from actstore.read.masks import CONTENT, effective_token_mask
from actstore.read.normalize import norm_tables as stats_tables  # noqa: F401 - the stream's name for it

TokenMask = None | str | Mapping[str, Any] | Callable[[str], Any]


@dataclass(frozen=True)
class SegmentGeometry:
    """A segment as the loaders see it: `t_pad` rows are read, `t_max` are meaningful."""

    name: str
    t_max: int
    t_pad: int


def segment_geometry(store: Reader) -> dict[str, SegmentGeometry]:
    out = {}
    for s in store.config.segments:
        t_pad = s.t_pad
        out[s.name] = SegmentGeometry(name=s.name, t_max=int(s.t_max), t_pad=int(t_pad))
    return out


def stored_numpy_dtype(store: Reader) -> np.dtype:
    return np.dtype(spec.ACT_DTYPES[store.dtype])


def pick_layers(store: Reader, layers: Sequence[Any] | int | str | None) -> tuple[int, ...]:
    """The model layer numbers asked for (numbers, -1, names: actstore.read.layers), checked against the store's."""
    have = tuple(int(x) for x in store.layers)
    if layers is None:
        return have
    one = isinstance(layers, (int, np.integer, str))
    names = store.layer_names()
    picked = tuple(resolve_layer(x, have, names) for x in ((layers,) if one else layers))
    if not picked:
        raise ValueError(f"layers must name at least one of the store's layers {list(have)}")
    missing = [x for x in picked if x not in have]
    if missing:
        raise LayerNotFoundError(f"layers {missing} are not stored; this store holds layers {list(have)}")
    if len(set(picked)) != len(picked):
        raise ValueError(f"layers must be distinct. Got {list(picked)}.")
    return picked


def pick_segments(store: Reader, segments: Sequence[str] | str | None) -> tuple[SegmentGeometry, ...]:
    geo = segment_geometry(store)
    if segments is None:
        return tuple(geo.values())
    names = (segments,) if isinstance(segments, str) else tuple(segments)
    missing = [n for n in names if n not in geo]
    if missing or not names:
        raise SegmentNotFoundError(f"segments {missing or names} are not in this store; it has segments {list(geo)}")
    if len(set(names)) != len(names):
        raise ValueError(f"segments must be distinct. Got {list(names)}.")
    return tuple(geo[n] for n in names)


def segment_lengths(store: Reader, seg: SegmentGeometry) -> np.ndarray:
    lens = np.asarray(store.segment(seg.name).lengths()).astype(np.int64).reshape(-1)
    if lens.shape != (len(store),):
        raise ValueError(f"segment {seg.name!r}: the store gives {lens.shape} lengths for {len(store)} examples")
    return lens


def resolve_mask(store: Reader, seg: SegmentGeometry, token_mask: TokenMask) -> np.ndarray | None:
    """The (N, t_max) bool keep-mask of one segment, or None (keep all)."""
    token_mask = effective_token_mask(store, token_mask)
    if token_mask is None:
        return None
    if isinstance(token_mask, str):
        content = token_mask == CONTENT
        name = f"{seg.name}_{'token_labels' if content else token_mask}"
        try:
            arr = store.field(name)
        except KeyError as e:
            raise TokenMaskError(
                f"token_mask={token_mask!r} reads the per-token array {name!r}, which this store lacks "
                f"({e.args[0] if e.args else e}); "
                "pass token_mask='all', another name, or {segment: array (N, T_max)}"
            ) from None
        if content:
            arr = np.asarray(arr) == 0
    elif isinstance(token_mask, Mapping):
        unknown = sorted(set(token_mask) - set(segment_geometry(store)))
        if unknown:
            raise SegmentNotFoundError(f"token_mask names segments {unknown} that are not in this store")
        arr = token_mask.get(seg.name)
    elif callable(token_mask):
        arr = token_mask(seg.name)
    else:
        raise TypeError(
            f"token_mask must be 'default', 'all' (or None), 'content', a per-token field name, a mapping {{segment: array}} or a callable. Got {type(token_mask).__name__}."
        )
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.shape != (len(store), seg.t_max):
        raise ValueError(
            f"token mask of segment {seg.name!r} must have shape (n_examples, T_max) = ({len(store)}, {seg.t_max}); "
            f"got {arr.shape}"
        )
    return arr != 0


class TokenUnits:
    """The stream's units: unit u is (example, layer, segment) with u = (ex*L + li)*S + si.

    Args:
        store: a Reader (an ActStore, a SaevStore).
        layers: model layer numbers (each unit's layer is layers[li]).
        segments: the segments streamed.
        token_mask: see the module docstring.
    """

    def __init__(
        self, store: Reader, layers: tuple[int, ...], segments: tuple[SegmentGeometry, ...], token_mask: TokenMask
    ):
        self.n_examples = len(store)
        self.layers = layers
        self.segments = segments
        self.n_layers, self.n_segments = len(layers), len(segments)
        self.lengths = np.stack([segment_lengths(store, s) for s in segments], axis=1) if segments else np.zeros((0, 0))
        self.masks = [resolve_mask(store, s, token_mask) for s in segments]
        kept = self.lengths.copy()
        for si, m in enumerate(self.masks):
            if m is not None:
                within = np.arange(segments[si].t_max)[None, :] < self.lengths[:, si : si + 1]
                kept[:, si] = (m & within).sum(axis=1)
        self.kept_ex = kept  # (N, S) kept tokens per example and segment
        self.counts = np.broadcast_to(kept[:, None, :], (self.n_examples, self.n_layers, self.n_segments)).reshape(-1)

    def decode(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(example, layer position, segment position) of each unit id."""
        units = np.asarray(units, dtype=np.int64)
        ex, rest = np.divmod(units, self.n_layers * self.n_segments)
        li, si = np.divmod(rest, self.n_segments)
        return ex, li, si

    def kept_rows(self, ex: int, si: int) -> np.ndarray | None:
        """Rows kept inside the length of (ex, segment), or None when all of 0..len are."""
        m = self.masks[si]
        if m is None:
            return None
        return np.flatnonzero(m[ex, : self.lengths[ex, si]])


def request_objects(store: Reader) -> Callable[[int, int, str], Any] | None:
    """store.object_of(ex, layer, segment), the object holding a unit, when the store's
    requests are worth saving (object storage: units of one object read together, as one
    request); None otherwise (a local disk)."""
    return store.object_of if store.groups_requests else None
