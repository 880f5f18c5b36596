"""The store's configuration (its identity): parsed, validated and compared field by field."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from actstore.errors import CorruptStoreError, FormatVersionError, StoreMismatchError
from actstore.layout import spec


@dataclass(frozen=True, kw_only=True)
class SegmentSpec:
    """One named token segment: an array (n, L, t_max, D) chunked (1, 1, t_chunk, D)."""

    name: str
    t_max: int
    t_chunk: int
    fixed: bool

    @property
    def n_chunks(self) -> int:
        return -(-self.t_max // self.t_chunk)

    @property
    def t_pad(self) -> int:
        """Tokens per example on the chunk grid (n_chunks * t_chunk, >= t_max): the rows the
        writer stores per (example, layer) and read_into fills."""
        return self.n_chunks * self.t_chunk


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Everything that every writer shard of one store must agree on."""

    layers: tuple[int, ...]
    d_model: int
    dtype: str
    segments: tuple[SegmentSpec, ...]
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT
    shard_examples: int | None = None
    fields: Mapping[str, str] = field(default_factory=dict)
    texts: tuple[str, ...] = ()
    token_labels: bool = False
    model_id: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    token_ids: bool = False  # a per-token int32 vocabulary id array per segment
    # What the labels mean: {label: name} of token kinds (0 content, 1 special, 2 template),
    # which the default mask reads by (actstore.read.masks); None: the labels are classes.
    token_label_names: Mapping[int, str] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def zarr_dtype(self) -> str:
        return spec.ACT_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.zarr_dtype).itemsize

    @property
    def t_total(self) -> int:
        return sum(s.t_max for s in self.segments)

    @property
    def default_keeps(self) -> int | None:
        """The label that the default mask keeps (spec.CONTENT_LABEL) when the labels are
        token kinds; None when a reader reads every token (no labels, or labels that are
        classes: data, not a mask)."""
        return spec.CONTENT_LABEL if self.token_label_names is not None else None

    def segment(self, name: str) -> SegmentSpec:
        for s in self.segments:
            if s.name == name:
                return s
        from actstore.errors import SegmentNotFoundError

        raise SegmentNotFoundError(
            f"segment {name!r} is not in this store; it has segments {[s.name for s in self.segments]}"
        )

    def example_bytes(self) -> int:
        """Bytes of activations one example takes on disk (all layers, all segments, padded)."""
        return sum(s.t_pad for s in self.segments) * self.d_model * self.itemsize * self.n_layers

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["segments"] = [{k: v for k, v in asdict(s).items() if k != "name"} | {"name": s.name} for s in self.segments]
        d["fields"] = dict(self.fields)
        d["texts"] = list(self.texts)
        d["attrs"] = dict(self.attrs)
        del d["token_label_names"]
        if self.token_label_names is not None:
            d["token_labels"] = {
                "meaning": spec.TOKEN_LABELS_KINDS,
                "names": {str(k): v for k, v in sorted(self.token_label_names.items())},
            }
        if not self.token_ids:
            del d["token_ids"]  # optional: stores without token ids keep their bytes
        return d

    @classmethod
    def from_json(cls, d: Any) -> StoreConfig:
        if not isinstance(d, dict):
            raise CorruptStoreError(f"store config must be a JSON object, got {type(d).__name__}")
        missing = [k for k in spec.CONFIG_FIELDS if k not in d]
        if missing:
            raise CorruptStoreError(f"store config lacks fields {missing}")
        segs = d["segments"]
        if not isinstance(segs, list) or not segs:
            raise CorruptStoreError(f"store config 'segments' must be a non-empty list, got {segs!r}")
        segments = []
        for s in segs:
            if not isinstance(s, dict) or set(s) != {"name", *spec.SEGMENT_FIELDS}:
                raise CorruptStoreError(
                    f"bad segment entry {s!r}: expected keys name, {', '.join(spec.SEGMENT_FIELDS)}"
                )
            segments.append(
                SegmentSpec(
                    name=parse_segment_name(s["name"]),
                    t_max=parse_positive_int("t_max", s["t_max"]),
                    t_chunk=parse_positive_int("t_chunk", s["t_chunk"]),
                    fixed=bool(s["fixed"]),
                )
            )
        labels, names = parse_token_labels(d["token_labels"])
        return make_config(
            layers=d["layers"],
            d_model=d["d_model"],
            dtype=d["dtype"],
            segments_specs=tuple(segments),
            zarr_format=d["zarr_format"],
            shard_examples=d["shard_examples"],
            fields=d["fields"],
            texts=d["texts"],
            token_labels=labels,
            model_id=d["model_id"],
            attrs=d["attrs"],
            token_ids=_bool_field(d, "token_ids"),
            token_label_names=names,
        )

    def differences(self, other: StoreConfig) -> list[str]:
        """Fields (other than free-form attrs) in which two configs differ, described."""
        a, b = self.to_json(), other.to_json()
        names = [*spec.CONFIG_FIELDS, *spec.CONFIG_OPTIONAL_FIELDS]
        return [
            f"{k}: store has {a.get(k, False)!r}, asked for {b.get(k, False)!r}"
            for k in names
            if k != "attrs" and a.get(k, False) != b.get(k, False)
        ]

    def check_same_store(self, other: StoreConfig, where: str) -> None:
        diffs = self.differences(other)
        if diffs:
            raise StoreMismatchError(
                f"{where} already holds a different actstore store ({'; '.join(diffs)}). "
                "Write to a new path, or match the existing store's configuration."
            )


def parse_token_labels(value: Any) -> tuple[bool, dict[int, str] | None]:
    """The config's `token_labels` as (labels stored, kind names or None): `false`, `true`
    (classes) or {"meaning": "kinds", "names": {"0": "content", ...}}."""
    if isinstance(value, bool):
        return value, None
    if not isinstance(value, dict) or set(value) != set(spec.TOKEN_LABELS_FIELDS):
        raise ValueError(
            f'token_labels must be true, false or {{"meaning": "{spec.TOKEN_LABELS_KINDS}", "names": {{label: name}}}}. '
            f"Got {value!r}."
        )
    if value["meaning"] != spec.TOKEN_LABELS_KINDS:
        raise ValueError(f"token_labels meaning must be {spec.TOKEN_LABELS_KINDS!r}. Got {value['meaning']!r}.")
    names = value["names"]
    if not isinstance(names, dict) or not all(isinstance(k, str) and k.isdigit() for k in names):
        raise ValueError(f"token_labels names must map labels (digits) to names. Got {names!r}.")
    return True, parse_token_label_names({int(k): v for k, v in names.items()})


def parse_token_label_names(value: Any) -> dict[int, str]:
    """{label: name} of token kinds: labels 0..255 (uint8), non-empty names, label 0 (the
    content that the default mask keeps) among them."""
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            f"token_label_names must map token labels to names, e.g. {spec.TOKEN_KIND_NAMES}. Got {value!r}."
        )
    out = {}
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= 255:
            raise ValueError(f"token_label_names keys must be labels 0..255 (uint8). Got {k!r}.")
        if not isinstance(v, str) or not v or len(v) > 64:
            raise ValueError(f"token_label_names values must be names of 1..64 characters. Got {v!r} for label {k}.")
        out[int(k)] = v
    if spec.CONTENT_LABEL not in out:
        raise ValueError(
            f"token_label_names must name label {spec.CONTENT_LABEL}, the content tokens the default mask keeps. Got {value!r}."
        )
    return dict(sorted(out.items()))


def legacy_kind_names(attrs: Mapping[str, Any]) -> dict[int, str] | None:
    """Kind names of a store written before the config recorded them: capture-made stores
    carry attrs `token_labels` {"0": "content", ...}; every other store's labels are classes."""
    meaning = attrs.get(spec.LEGACY_KINDS_ATTR)
    if isinstance(meaning, Mapping) and meaning.get(str(spec.CONTENT_LABEL)) == spec.TOKEN_KIND_NAMES[0]:
        return dict(spec.TOKEN_KIND_NAMES)
    return None


def parse_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int. Got {value!r}.")
    return int(value)


def parse_dtype(value: Any) -> str:
    name = getattr(value, "name", None) or str(value)
    name = name.removeprefix("torch.")
    if name not in spec.ACT_DTYPES:
        raise ValueError(f"dtype must be one of {list(spec.ACT_DTYPES)}. Got {value!r}.")
    return name


def parse_segment_name(value: Any) -> str:
    if not isinstance(value, str) or not re.match(spec.SEGMENT_NAME_PATTERN, value):
        raise ValueError(
            f"segment names must match {spec.SEGMENT_NAME_PATTERN} (lower case, digits, underscores). Got {value!r}."
        )
    return value


def parse_layers(value: Any) -> tuple[int, ...]:
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"layers must be a list of model layer numbers (ints). Got {value!r}.") from None
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in items):
        raise ValueError(f"layers must be a list of model layer numbers (ints), never truncated. Got {value!r}.")
    layers = tuple(int(x) for x in items)
    if not layers or any(x < 0 for x in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be a non-empty list of distinct non-negative ints. Got {value!r}.")
    return layers


def default_t_chunk(t_max: int, d_model: int, itemsize: int) -> int:
    """T_max when a (1,1,T_max,D) chunk fits MAX_CHUNK_BYTES, else equal splits that do."""
    n = -(-(t_max * d_model * itemsize) // spec.MAX_CHUNK_BYTES)
    return -(-t_max // max(n, 1))


def default_shard_examples(segments: Sequence[SegmentSpec], d_model: int, itemsize: int, n_layers: int) -> int:
    """Examples per Zarr shard file when the writer chooses: those that fill about
    DEFAULT_SHARD_BYTES (at least one, at most MAX_AUTO_SHARD_EXAMPLES)."""
    example = sum(s.t_pad for s in segments) * d_model * itemsize * n_layers
    return max(1, min(spec.MAX_AUTO_SHARD_EXAMPLES, spec.DEFAULT_SHARD_BYTES // max(example, 1)))


def make_config(
    *,
    layers: Sequence[int],
    d_model: int,
    dtype: Any = spec.DEFAULT_DTYPE,
    tokens: int | None = None,
    segments: Mapping[str, int] | None = None,
    segments_specs: tuple[SegmentSpec, ...] | None = None,
    t_chunk: int | Mapping[str, int] | None = None,
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT,
    shard_examples: int | str | None = spec.SHARD_EXAMPLES_AUTO,
    fields: Mapping[str, Any] | None = None,
    texts: Sequence[str] = (),
    token_labels: bool = False,
    model_id: str | None = None,
    attrs: Mapping[str, Any] | None = None,
    token_ids: bool = False,
    token_label_names: Mapping[int, str] | None = None,
) -> StoreConfig:
    """Validate writer arguments and build a StoreConfig (see ShardWriter for the meaning)."""
    layers_t = parse_layers(layers)
    d_model = parse_positive_int("d_model", d_model)
    dtype_s = parse_dtype(dtype)
    itemsize = np.dtype(spec.ACT_DTYPES[dtype_s]).itemsize
    if segments_specs is None:
        if (tokens is None) == (segments is None):
            raise ValueError(
                "give exactly one of tokens=T (one fixed-length segment, e.g. ViT patches + CLS) "
                "or segments={'prompt': P_max, 'response': R_max} (zero-padded, with lengths)"
            )
        named = {spec.DEFAULT_SEGMENT: tokens} if tokens is not None else dict(segments or {})
        if not named:
            raise ValueError("segments must name at least one segment, e.g. {'prompt': 256, 'response': 64}")
        specs = []
        for name, t_max in named.items():
            t_max = parse_positive_int(f"segment {name!r} length", t_max)
            tc = t_chunk.get(name) if isinstance(t_chunk, Mapping) else t_chunk
            tc = default_t_chunk(t_max, d_model, itemsize) if tc is None else parse_positive_int("t_chunk", tc)
            specs.append(
                SegmentSpec(
                    name=parse_segment_name(name), t_max=t_max, t_chunk=min(tc, t_max), fixed=tokens is not None
                )
            )
        segments_specs = tuple(specs)
    if zarr_format not in spec.ZARR_FORMATS:
        raise ValueError(f"zarr_format must be one of {list(spec.ZARR_FORMATS)}. Got {zarr_format!r}.")
    if isinstance(shard_examples, str) and shard_examples == spec.SHARD_EXAMPLES_AUTO:
        shard_examples = (
            default_shard_examples(segments_specs, d_model, itemsize, len(layers_t)) if zarr_format == 3 else None
        )
    if shard_examples is not None:
        shard_examples = parse_positive_int("shard_examples", shard_examples)
        if zarr_format != 3:
            raise ValueError("shard_examples (Zarr sharding) needs zarr_format=3")
    fields_d = {}
    for name, dt in (fields or {}).items():
        parse_segment_name(name)
        if name == spec.SAMPLE_KEY or name.endswith(spec.RESERVED_SUFFIXES):
            raise ValueError(f"field name {name!r} is reserved; pick another")
        np_dt = np.dtype(dt)
        if np_dt.kind not in "biuf":
            raise ValueError(f"field {name!r} must have a numeric or bool dtype. Got {dt!r}.")
        fields_d[name] = np_dt.str
    text_names = tuple(parse_segment_name(t) for t in texts)
    if len(set(text_names)) != len(text_names):
        raise ValueError(f"texts must be distinct names. Got {list(texts)}.")
    token_labels = bool(token_labels)
    attrs = dict(attrs or {})
    if token_label_names is not None:
        if not token_labels:
            raise ValueError("token_label_names says what the per-token labels mean; pass token_labels=True too")
        token_label_names = parse_token_label_names(token_label_names)
    elif token_labels:
        token_label_names = legacy_kind_names(attrs)
    return StoreConfig(
        layers=layers_t,
        d_model=d_model,
        dtype=dtype_s,
        segments=segments_specs,
        zarr_format=int(zarr_format),
        shard_examples=shard_examples,
        fields=fields_d,
        texts=text_names,
        token_labels=token_labels,
        model_id=model_id,
        attrs=attrs,
        token_ids=bool(token_ids),
        token_label_names=token_label_names,
    )


def _bool_field(d: dict, name: str) -> bool:
    v = d.get(name, False)
    if not isinstance(v, bool):
        raise CorruptStoreError(f"store config field {name!r} must be true or false, got {v!r}")
    return v


def check_format_header(d: Any, where: str) -> None:
    """Refuse documents of another format or a newer version with a clear upgrade message."""
    if not isinstance(d, dict) or d.get("format") != spec.FORMAT_NAME:
        raise CorruptStoreError(f'{where} is not an actstore document (missing "format": "actstore")')
    v = d.get("format_version")
    if type(v) is not int or v != spec.FORMAT_VERSION:  # exactly the JSON integer: not 1.0, "1" or true
        if type(v) is int and v > spec.FORMAT_VERSION:
            raise FormatVersionError(
                f"{where} uses actstore format version {v}, newer than this actstore reads "
                f"(version {spec.FORMAT_VERSION}); upgrade actstore (pip install -U actstore)"
            )
        raise FormatVersionError(
            f"{where} has unknown format_version {v!r}; this actstore reads version {spec.FORMAT_VERSION}"
        )
