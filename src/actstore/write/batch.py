"""What `ShardWriter.append` accepts: a batch's arguments checked and converted.

Pure functions of the store configuration and the batch; nothing here writes. A batch
that does not fit raises AppendError (or one of its subclasses) before anything of it is
kept, with a message that names the argument and what it should be.

`prepare` is the user's door: every argument checked, the activations converted and
screened for non-finite values once. The result, a `Batch`, is what the writer's internal
door (`ShardWriter.append_batch`) takes as it is; a caller that made every array itself
(the capture, actstore.capture.writeside) builds the Batch directly, with `sample_rows`
for the keys and text lines, and is not checked again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.dtypes import clip_to, convert, to_numpy
from actstore.errors import AppendError, Float16OverflowError, NonFiniteError
from actstore.layout import keys, spec
from actstore.layout import texts as texts_layout
from actstore.layout.arrays import encode_keys
from actstore.layout.config import SegmentSpec, StoreConfig


@dataclass
class Batch:
    """One checked batch: activations padded to whole chunks, per-sample rows, text lines."""

    b: int
    acts: dict[str, np.ndarray]  # segment -> (b, L, seg.t_pad, D), the stored dtype; each
    # (example, layer) row C-contiguous, the array itself perhaps a strided view (layer-major)
    aliased: dict[str, bool]  # segment -> acts[segment] is a view of the caller's memory
    lengths: dict[str, np.ndarray]  # segment -> (b,) int32
    per_sample: dict[str, np.ndarray] = field(default_factory=dict)  # array key -> (b, ...) rows
    text_lines: dict[str, list[bytes]] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    overflow: dict[str, int] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    release: Any = None  # lent rows (ShardWriter.append(release=)): called once they are written
    stats: Any = None  # a RunningStats already computed for this batch (merged as is), or None


class LayerList:
    """A batch (b, L, T, D) held as its L layers (b, T, D), never stacked: what a capture
    hands over (each layer as its hook produced it). It answers the indexing the layouts
    use: `x[i, lp]` and `x[i:j, lp]` (one layer's rows), `x[i:j]`, `x[:, :, :t]`."""

    ndim = 4

    def __init__(self, layers: Sequence[np.ndarray]):
        self.layers = list(layers)

    @property
    def shape(self) -> tuple[int, ...]:
        a = self.layers[0]
        return (a.shape[0], len(self.layers), *a.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.layers[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.layers)

    def __getitem__(self, key: Any) -> Any:
        key = key if isinstance(key, tuple) else (key,)
        first, layer, rest = key[0], (key[1] if len(key) > 1 else slice(None)), key[2:]
        if isinstance(layer, (int, np.integer)):
            return self.layers[layer][(first, *rest)]
        if not isinstance(first, slice):
            raise TypeError("LayerList keeps the example axis: index it with a slice or (i, layer)")
        return LayerList([a[(first, *rest)] for a in self.layers[layer]])

    def map(self, f: Any) -> LayerList:
        return LayerList([f(a) for a in self.layers])

    def any(self) -> bool:
        return any(bool(a.any()) for a in self.layers)

    def stack(self) -> np.ndarray:
        return np.stack(self.layers, axis=1)


def per_segment(value: Any, names: list[str], what: str) -> dict[str, Any]:
    """A per-segment argument as {segment: value} (a bare value for a one-segment store)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise AppendError(f"{what} names segments {unknown} that the store does not have ({names})")
        return dict(value)
    if len(names) != 1:
        raise AppendError(f"this store has segments {names}: pass {what} as a dict {{segment: values}}")
    return {names[0]: value}


def pad_tokens(x: Any, t_pad: int) -> Any:
    """Zero-pad axis 2 to `t_pad` (a copy only when padding is needed: `x` as it is otherwise,
    strides and all; the layouts copy it once)."""
    t = x.shape[2]
    if t == t_pad:
        return x
    if isinstance(x, LayerList):
        return x.map(lambda a: pad_tokens(a[:, None], t_pad)[:, 0])
    out = np.zeros((x.shape[0], x.shape[1], t_pad, *x.shape[3:]), dtype=x.dtype)
    out[:, :, :t] = x
    return out


def prepare(
    cfg: StoreConfig,
    segment_acts: dict[str, Any],
    *,
    lengths: Any,
    source_lengths: Any,
    token_labels: Any,
    sample_keys: Sequence[str] | None,
    token_ids: Any = None,
    fields: Mapping[str, Any] | None,
    texts: Mapping[str, Sequence[Any]] | None,
    first_index: int,
    shard: int,
    on_nonfinite: str,
    on_overflow: str,
) -> Batch:
    """Check and convert every argument of one `append`; `first_index` is the batch's
    first local example index (for default sample keys and text lines)."""
    seg_names = [s.name for s in cfg.segments]
    unknown = sorted(set(segment_acts) - set(seg_names))
    missing = [s for s in seg_names if s not in segment_acts]
    if unknown or missing:
        raise AppendError(f"append needs activations for segments {seg_names}; got {sorted(segment_acts)}")
    lengths_d = per_segment(lengths, seg_names, "lengths")
    src_d = per_segment(source_lengths, seg_names, "source_lengths")
    labels_d = per_segment(token_labels, seg_names, "token_labels")
    ids_d = per_segment(token_ids, seg_names, "token_ids")
    batch: Batch | None = None
    for seg in cfg.segments:
        x, src = _activations(segment_acts[seg.name], f"activations of segment {seg.name!r}")
        b = _check_shape(cfg, seg, x, None if batch is None else batch.b)
        if batch is None:
            batch = Batch(b=b, acts={}, aliased={}, lengths={})
        t = x.shape[2]
        lens = _lengths(seg, lengths_d.get(seg.name), b, t)
        if isinstance(x, LayerList):
            parts = [_convert(cfg, seg, a, src, on_nonfinite, on_overflow) for a in x.layers]
            stored, nonfinite, over = (
                LayerList([p[0] for p in parts]),
                sum(p[1] for p in parts),
                sum(p[2] for p in parts),
            )
        else:
            stored, nonfinite, over = _convert(cfg, seg, x, src, on_nonfinite, on_overflow)
        if b and cfg.n_layers and not all(stored[0, lp].flags.c_contiguous for lp in range(cfg.n_layers)):
            # the layouts take (example, layer) rows whole
            stored = stored.map(np.ascontiguousarray) if isinstance(stored, LayerList) else np.ascontiguousarray(stored)
        batch.acts[seg.name] = pad_tokens(stored, seg.t_pad)
        # Buffered batches outlive append: never keep a view of the caller's memory.
        batch.aliased[seg.name] = isinstance(x, LayerList) or np.may_share_memory(batch.acts[seg.name], x)
        batch.lengths[seg.name] = lens
        batch.nonfinite[seg.name] = nonfinite
        batch.overflow[seg.name] = over
        batch.truncated[seg.name] = 0
        if seg.name in src_d:
            s = np.asarray(src_d[seg.name]).reshape(-1)
            if s.shape != (b,):
                raise AppendError(f"source_lengths for {seg.name!r} must have shape ({b},), got {s.shape}")
            batch.truncated[seg.name] = int(np.count_nonzero(s > seg.t_max))
    assert batch is not None
    _per_sample(cfg, batch, labels_d, sample_keys, fields, texts, first_index, shard)
    _token_ids(cfg, batch, ids_d)
    return batch


def _activations(x: Any, name: str) -> tuple[Any, str]:
    """A segment's activations as an array (b, L, T, D), or a LayerList of L arrays (b, T, D)
    when given as a list or tuple of layers; and their source dtype name."""
    if not isinstance(x, (list, tuple)):
        return to_numpy(x, name)
    layers = [to_numpy(a, f"{name}, layer {lp}") for lp, a in enumerate(x)]
    if not layers or any(a.ndim != 3 or a.shape != layers[0][0].shape for a, _ in layers):
        raise AppendError(f"{name}: a list of layers must hold L arrays (b, T, D) of one shape")
    if len({src for _, src in layers}) != 1:
        raise AppendError(f"{name}: the layers have different dtypes {sorted({src for _, src in layers})}")
    return LayerList([a for a, _ in layers]), layers[0][1]


def _check_shape(cfg: StoreConfig, seg: SegmentSpec, x: Any, b: int | None) -> int:
    if x.ndim != 4:
        raise AppendError(
            f"segment {seg.name!r}: expected a batch of shape (b, L={cfg.n_layers}, T, D={cfg.d_model}), got shape {tuple(x.shape)}"
        )
    if b is not None and x.shape[0] != b:
        raise AppendError(f"segment {seg.name!r} has {x.shape[0]} examples but another segment has {b}")
    if x.shape[1] != cfg.n_layers:
        raise AppendError(
            f"segment {seg.name!r}: batch has {x.shape[1]} layers, the store records {cfg.n_layers} (layers {list(cfg.layers)})"
        )
    if x.shape[3] != cfg.d_model:
        raise AppendError(f"segment {seg.name!r}: batch has d_model {x.shape[3]}, the store has d_model {cfg.d_model}")
    t = x.shape[2]
    if seg.fixed and t != seg.t_max:
        raise AppendError(f"segment {seg.name!r} holds exactly {seg.t_max} tokens per example; the batch has {t}")
    if t > seg.t_max and not (t == seg.t_pad and not x[:, :, seg.t_max :].any()):
        raise AppendError(
            f"segment {seg.name!r}: batch has {t} tokens but the store holds at most {seg.t_max}; truncate it to {seg.t_max} (and pass source_lengths to record truncation)"
        )
    return x.shape[0]


def _convert(
    cfg: StoreConfig, seg: SegmentSpec, x: np.ndarray, src: str, on_nonfinite: str, on_overflow: str
) -> tuple[np.ndarray, int, int]:
    """The batch in the stored dtype, with its non-finite and overflow counts (refused or clipped)."""
    try:
        stored, nonfinite, over = convert(x, src, cfg.dtype)
    except TypeError as e:
        raise AppendError(f"segment {seg.name!r}: {e}") from None
    if nonfinite and on_nonfinite == "raise":
        raise NonFiniteError(
            f"segment {seg.name!r}: the batch holds {nonfinite} NaN or infinite values; nothing of this batch was written (pass on_nonfinite='count' to store and count them)"
        )
    if over:
        if on_overflow == "raise":
            raise overflow_error(seg.name, over, src, cfg.dtype)
        stored, _, _ = convert(clip_to(x, src, cfg.dtype), "float32" if src == "bfloat16" else src, cfg.dtype)
    return stored, nonfinite, over


def overflow_error(segment: str, over: int, src: str, dtype: str) -> Float16OverflowError:
    """The refusal of finite values beyond the stored dtype's range (on_overflow='raise')."""
    return Float16OverflowError(
        f"segment {segment!r}: {over} finite {src} values lie beyond the range of {dtype} "
        f"(|x| > {65504 if dtype == 'float16' else 'float32 max'}) and would be stored as inf; "
        "nothing of this batch was written. Store with dtype='float32' or 'bfloat16', or pass "
        "on_overflow='clip' to saturate them (counted in the store's metadata)"
    )


def _lengths(seg: SegmentSpec, given: Any, b: int, t: int) -> np.ndarray:
    if given is None:
        return np.full(b, t, np.int32)
    if seg.fixed:
        raise AppendError(f"segment {seg.name!r} has a fixed length ({seg.t_max} tokens); do not pass lengths for it")
    lens, _ = to_numpy(given, "lengths")
    lens = np.asarray(lens).reshape(-1)
    if lens.shape != (b,) or lens.dtype.kind not in "iu":
        raise AppendError(f"lengths of segment {seg.name!r} must be {b} ints, got {lens.dtype} of shape {lens.shape}")
    if (lens < 0).any() or (lens > min(t, seg.t_max)).any():
        bad = int(lens[(lens < 0) | (lens > min(t, seg.t_max))][0])
        raise AppendError(
            f"segment {seg.name!r}: length {bad} is beyond the batch's {t} tokens (T_max {seg.t_max}); "
            "lengths must be the true token counts capped to T_max"
        )
    return lens.astype(np.int32)


def _token_ids(cfg, batch: Batch, ids_d: dict[str, Any]) -> None:
    """The per-token vocabulary ids of each segment (int32; padding stored as 0)."""
    if not cfg.token_ids:
        if ids_d:
            raise AppendError("this store was created without token_ids=True; token ids cannot be stored")
        return
    b = batch.b
    for seg in cfg.segments:
        ids = ids_d.get(seg.name)
        if ids is None:
            raise AppendError(
                f"this store records token_ids: pass token_ids for segment {seg.name!r} ((b, <= {seg.t_max}) ints)"
            )
        ids, _ = to_numpy(ids, "token_ids")
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[0] != b or ids.shape[1] > seg.t_max or ids.dtype.kind not in "iu":
            raise AppendError(
                f"token_ids of segment {seg.name!r} must be integers of shape ({b}, <= {seg.t_max}), got {ids.dtype} {ids.shape}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
            raise AppendError(
                f"token_ids of segment {seg.name!r} must be vocabulary ids in 0..2**31-1, got {int(ids.min())}..{int(ids.max())}"
            )
        out = np.zeros((b, seg.t_max), np.int32)
        out[:, : ids.shape[1]] = ids
        out[np.arange(seg.t_max)[None, :] >= batch.lengths[seg.name][:, None]] = 0  # padding holds 0
        batch.per_sample[keys.token_ids_array(seg.name)] = out


def _per_sample(cfg, batch: Batch, labels_d, sample_keys, fields, texts, first_index: int, shard: int) -> None:
    """Lengths, token labels, sample keys, fields and text lines of the batch."""
    b, out = batch.b, batch.per_sample
    for seg in cfg.segments:
        out[keys.len_array(seg.name)] = batch.lengths[seg.name]
        if cfg.token_labels:
            lab = labels_d.get(seg.name)
            if lab is None:
                raise AppendError(
                    f"this store records token_labels: pass token_labels for segment {seg.name!r} ((b, {seg.t_max}) uint8)"
                )
            lab, _ = to_numpy(lab, "token_labels")
            lab = np.asarray(lab)
            if lab.ndim != 2 or lab.shape[0] != b or lab.shape[1] > seg.t_max:
                raise AppendError(
                    f"token_labels of segment {seg.name!r} must have shape ({b}, <= {seg.t_max}), got {lab.shape}"
                )
            if lab.size and (lab.min() < 0 or lab.max() > 255):
                raise AppendError(f"token_labels of segment {seg.name!r} must be in 0..255 (uint8)")
            out[keys.labels_array(seg.name)] = pad_tokens(lab.astype(np.uint8)[:, None, :, None], seg.t_max)[:, 0, :, 0]
        elif labels_d:
            raise AppendError("this store was created without token_labels=True; token labels cannot be stored")
    names = _sample_keys(cfg, batch, sample_keys, first_index, shard)
    fields = dict(fields or {})
    if set(fields) != set(cfg.fields):
        raise AppendError(f"this store declares fields {sorted(cfg.fields)}; the batch gives {sorted(fields)}")
    for name, dt in cfg.fields.items():
        v, _ = to_numpy(fields[name], f"field {name}")
        v = np.asarray(v).reshape(-1)
        if v.shape != (b,):
            raise AppendError(f"field {name!r} must have {b} values, got shape {v.shape}")
        try:
            out[keys.field_array(name)] = v.astype(dt, casting="same_kind")
        except TypeError:
            raise AppendError(
                f"field {name!r} holds {v.dtype} values that do not fit its dtype {np.dtype(dt)}"
            ) from None
        _check_range(name, v, out[keys.field_array(name)])
    _text_lines(cfg, batch, texts, names, first_index)


def sample_rows(
    cfg: StoreConfig,
    batch: Batch,
    sample_keys: Sequence[str] | None,
    texts: Mapping[str, Sequence[Any]] | None,
    first_index: int,
    shard: int,
) -> None:
    """The sample keys and text lines of a batch built outside `prepare` (a capture's): keys
    encoded as stored (default "{shard}-{index}"), texts dumped as JSON lines."""
    names = _sample_keys(cfg, batch, sample_keys, first_index, shard)
    _text_lines(cfg, batch, texts, names, first_index)


def _sample_keys(
    cfg: StoreConfig, batch: Batch, sample_keys: Sequence[str] | None, first_index: int, shard: int
) -> list[str]:
    b = batch.b
    if sample_keys is None:
        names = [f"{shard}-{first_index + i}" for i in range(b)]
    else:
        names = [str(k) for k in sample_keys]
        if len(names) != b:
            raise AppendError(f"got {len(names)} sample_keys for a batch of {b}")
    try:
        batch.per_sample[keys.field_array(spec.SAMPLE_KEY)] = encode_keys(names, cfg.zarr_format)
    except ValueError as e:
        raise AppendError(str(e)) from None
    return names


def _text_lines(
    cfg: StoreConfig, batch: Batch, texts: Mapping[str, Sequence[Any]] | None, names: list[str], first_index: int
) -> None:
    texts = dict(texts or {})
    if set(texts) != set(cfg.texts):
        raise AppendError(f"this store declares texts {list(cfg.texts)}; the batch gives {sorted(texts)}")
    for name in cfg.texts:
        vals = list(texts[name])
        if len(vals) != batch.b:
            raise AppendError(f"text {name!r} has {len(vals)} values for a batch of {batch.b}")
        try:
            batch.text_lines[name] = [
                texts_layout.dump_line(first_index + i, names[i], name, v) for i, v in enumerate(vals)
            ]
        except (TypeError, ValueError) as e:
            raise AppendError(f"text {name!r} holds a value that standard JSON cannot hold: {e}") from None


def _check_range(name: str, given: np.ndarray, stored: np.ndarray) -> None:
    """A field value must be stored exactly: 300 given to an int8 field would wrap to 44, a
    float64 beyond float16's range would become infinity."""
    dt = stored.dtype
    if dt.kind in "iu" and given.size:
        info = np.iinfo(dt)
        lo, hi = given.min(), given.max()
        if lo < info.min or hi > info.max:
            raise AppendError(f"field {name!r} holds values {lo}..{hi}; its dtype {dt} holds {info.min}..{info.max}")
    if dt.kind == "f" and given.size:
        bad = np.isfinite(given) & ~np.isfinite(stored)
        if bad.any():
            raise AppendError(f"field {name!r} holds {given[bad][0]!r}, beyond the range of its dtype {dt}")
