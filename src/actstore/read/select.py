"""Selections of many examples and layers: `store[0:100, 6]`, `store[[3, 9, 27], 6]`, `store[ex, :]`.

Keys, on the example axis: an int (negative counts from the end), a slice (any step), or
a list / 1-D array of ints. On the layer axis: a model layer number, a list of layer
numbers, `:` (every stored layer, in stored order), or a slice of layer numbers
(`4:10` selects the stored layers n with 4 <= n < 10; `::2` those in range(min, max + 1, 2)).

Results follow `store[ex, layer]` (padding removed, segments concatenated in config order,
bfloat16 widened to float32):

| key | every segment fixed-length | variable-length segments |
|---|---|---|
| many examples, one layer | ndarray (n, T, D) | list of n arrays (T_i, D) |
| one example, many layers | ndarray (L', T, D) | ndarray (L', T_i, D) |
| many examples, many layers | ndarray (n, L', T, D) | list of n arrays (L', T_i, D) |

Every (example, layer, segment) is read once, straight into one preallocated buffer
(`read_into`); no per-token Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from actstore.dtypes import bf16_bits_to_f32
from actstore.errors import ExampleIndexError
from actstore.index import layer_position
from actstore.layout import spec
from actstore.read.interface import Reader
from actstore.read.shard import UNCHECKED_READ_BYTES

_LIST_TYPES = (list, tuple, range, np.ndarray)


def is_pair(key: Any) -> bool:
    """True for `store[ex, layer]` with an int example and a scalar layer (the store's own
    one-array read); everything else is a selection for `select`."""
    if not isinstance(key, tuple) or len(key) != 2:
        return False
    ex, layer = key
    return _is_int(ex) and not isinstance(layer, (slice, *_LIST_TYPES))


def select(store: Reader, key: Any, segments: Sequence[Any] | None = None) -> np.ndarray | list[np.ndarray]:
    """Read `store[examples, layers]` for a selection key (see the module docstring).

    Args:
        store: an ActStore or SaevStore (anything with their reading API).
        key: (examples, layers).
        segments: the SegmentSpecs to read and concatenate; default every segment.

    Raises:
        ExampleIndexError: an example outside the store. LayerNotFoundError: a layer the
        store does not hold. TypeError: a key of another kind.
    """
    if not isinstance(key, tuple) or len(key) != 2:
        raise TypeError(
            "index the store as store[examples, layers]: examples an int, slice or list of ints, layers a layer "
            f"number, list of layer numbers or slice (e.g. store[0:100, 6], store[[3, 9], :]); got {key!r}"
        )
    exs, one_ex = parse_examples(key[0], len(store))
    layers, one_layer = parse_layers(key[1], store.layers)
    segs = tuple(store.config.segments if segments is None else segments)
    fixed = all(s.fixed for s in segs)
    if fixed:
        rows = np.broadcast_to(np.array([s.t_max for s in segs], dtype=np.int64), (len(exs), len(segs)))
    else:  # true lengths, so that the segments of each example are packed without padding
        rows = np.array([[lens[s.name] for s in segs] for lens in map(store.lengths, exs.tolist())], dtype=np.int64)
        rows = rows.reshape(len(exs), len(segs))
    flat = _exposed(store, gather(store, exs, layers, segs, rows))
    n, n_layers, d = len(exs), len(layers), store.d_model
    if fixed or one_ex:
        t = int(rows[0].sum()) if n else sum(s.t_max for s in segs)
        data = flat.reshape(n, n_layers, t, d)
        if one_ex and one_layer:
            return data.reshape(t, d)
        if one_ex:
            return data.reshape(n_layers, t, d)
        return data.reshape(n, t, d) if one_layer else data
    tokens = rows.sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(tokens * n_layers)])
    out = []
    for i in range(n):  # views into the one buffer, one per example
        part = flat[starts[i] : starts[i + 1]]
        out.append(part.reshape(int(tokens[i]), d) if one_layer else part.reshape(n_layers, int(tokens[i]), d))
    return out


def read_padded(
    store: Reader, examples: np.ndarray, layers: Sequence[int], needed: Sequence[bool] | None = None
) -> np.ndarray:
    """(n, L', T_total, D): every segment padded to t_max as stored, concatenated in config order.

    Args:
        store: an ActStore or SaevStore.
        examples: non-negative global example indices.
        layers: layer numbers.
        needed: per segment, whether to read it; segments left out hold undefined values.
    """
    segs = tuple(store.config.segments)
    exs = np.asarray(examples, dtype=np.int64).reshape(-1)
    rows = np.broadcast_to(np.array([s.t_max for s in segs], dtype=np.int64), (len(exs), len(segs)))
    flat = _exposed(store, gather(store, exs, [int(x) for x in layers], segs, rows, needed))
    return flat.reshape(len(exs), len(layers), sum(s.t_max for s in segs), store.d_model)


def gather(
    store: Reader,
    examples: np.ndarray,
    layers: Sequence[int],
    segs: Sequence[Any],
    rows: np.ndarray,
    needed: Sequence[bool] | None = None,
) -> np.ndarray:
    """Read into one (total rows, D) buffer of the stored dtype, in (example, layer, segment)
    order, segment k of example i taking rows[i, k] rows.

    read_into writes whole padded chunks (SegmentSpec.t_pad rows), so each read may spill
    past its rows: only into rows that a later read overwrites, or into a tail allocated
    for the last reads (cut off before returning).
    """
    n_layers, d = len(layers), store.d_model
    n_pad = np.array([s.t_pad for s in segs], dtype=np.int64)
    per_layer = rows.sum(axis=1)  # rows of one (example, layer)
    total = int(per_layer.sum()) * n_layers
    tail = 0
    if len(examples) and n_layers and len(segs):  # the furthest row any read touches, from its last layer
        base = np.concatenate([[0], np.cumsum(per_layer * n_layers)[:-1]]) + (n_layers - 1) * per_layer
        within = np.cumsum(rows, axis=1) - rows
        tail = max(0, int((base[:, None] + within + n_pad[None, :]).max()) - total)
    dtype = np.dtype(spec.ACT_DTYPES[store.dtype])
    if len(examples) and int(n_pad.sum()) * d * dtype.itemsize > UNCHECKED_READ_BYTES:
        store.check_backed(int(examples[0]), segs)  # metadata claiming huge token counts are refused before allocating
    buf = np.empty((total + tail, d), dtype=dtype)
    pos = 0
    for i, ex in enumerate(examples.tolist()):
        row = rows[i].tolist()
        for layer in layers:
            for k, s in enumerate(segs):
                if needed is None or needed[k]:
                    store.read_into(ex, layer, s.name, buf[pos : pos + int(n_pad[k])])
                pos += row[k]
    return buf[:total]


def parse_examples(key: Any, n: int) -> tuple[np.ndarray, bool]:
    """(non-negative int64 indices, whether the key was one int) for an example key."""
    if _is_int(key):
        ex = int(key)
        if not -n <= ex < n:
            raise ExampleIndexError(f"example {ex} is out of range: this store holds {n} examples (0..{n - 1})")
        return np.array([ex % n], dtype=np.int64), True
    if isinstance(key, slice):
        for part in (key.start, key.stop, key.step):
            if part is not None and not _is_int(part):
                raise TypeError(f"example slices take ints, got {key!r}")
        return np.arange(*key.indices(n), dtype=np.int64), False
    arr = np.asarray(key) if isinstance(key, _LIST_TYPES) else None
    if arr is None or arr.ndim != 1 or not (arr.dtype.kind in "iu" or (arr.size == 0 and arr.dtype.kind == "f")):
        raise TypeError(
            f"examples must be an int, a slice or a list / 1-D array of ints, got {key!r}"
            + (" (for a boolean mask pass np.flatnonzero(mask))" if arr is not None and arr.dtype.kind == "b" else "")
        )
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < -n) | (arr >= n))
    if bad.size:
        raise ExampleIndexError(
            f"example {int(arr[bad[0]])} (item {int(bad[0])} of the list) is out of range: this store holds "
            f"{n} examples (0..{n - 1})"
        )
    return np.where(arr < 0, arr + n, arr), False


def parse_layers(key: Any, stored: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """(layer numbers, whether the key was one layer) for a layer key; layers are the
    model's layer numbers, never positions."""
    stored = tuple(int(x) for x in stored)
    if isinstance(key, slice):
        if key == slice(None):
            return stored, False
        for part in (key.start, key.stop, key.step):
            if part is not None and not _is_int(part):
                raise TypeError(f"layer slices take layer numbers (ints), got {key!r}")
        step = 1 if key.step is None else int(key.step)
        if step <= 0:
            raise ValueError(
                f"layer slices select layer numbers in range(start, stop, step); step must be positive, got {step}"
            )
        start = min(stored) if key.start is None else int(key.start)
        stop = max(stored) + 1 if key.stop is None else int(key.stop)
        picked = range(start, stop, step)
        return tuple(x for x in stored if x in picked), False
    if isinstance(key, _LIST_TYPES) and np.ndim(key) == 0:  # a 0-d array: one layer
        key = np.asarray(key).item()
    if not isinstance(key, _LIST_TYPES):
        layer_position(stored, key)  # raises LayerNotFoundError listing the stored layers
        return (int(key),), True
    arr = np.asarray(key)
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or arr.size == 0):
        raise TypeError(f"layers must be a layer number, a list of layer numbers or a slice, got {key!r}")
    out = tuple(int(x) for x in arr.tolist())
    for x in out:
        layer_position(stored, x)
    return out, False


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _exposed(store: Reader, flat: np.ndarray) -> np.ndarray:
    """The stored dtype as readers return it: bfloat16 bits widen to float32 (a second copy)."""
    return bf16_bits_to_f32(flat) if store.dtype == "bfloat16" else flat
