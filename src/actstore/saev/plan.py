"""Resolve export options against a store into an ExportPlan: the saev metadata, its hash,
and which stored tokens land where. Pure (reads only the store's metadata).

Store metadata used (the `attrs` a writer was given, each overridable by an option):
`cls_token` (bool: token 0 of the store's tokens is a CLS token), `family`, `ckpt`
(default: the store's model_id), `dataset` (absolute path of the original data set),
`data` (object or string describing it) and `pixel_agg`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.chunkio import crc32c
from actstore.errors import SaevOptionError
from actstore.index import layer_position
from actstore.layout import jsonio
from actstore.layout import saevspec as P
from actstore.layout.spec import LEN_SUFFIX, TOKEN_LABELS_SUFFIX
from actstore.read.masks import leaves_out_special
from actstore.read.store import ActStore

CLS_MODES = ("keep", "drop", "none")


@dataclass(frozen=True, kw_only=True)
class Part:
    """Tokens [skip, skip + count) of segment `segment` land at exported tokens [dst, dst + count)."""

    segment: str
    skip: int
    count: int
    dst: int
    n_pad: int  # rows a padded read of the segment fills (token chunks x chunk length)
    fixed: bool


@dataclass(frozen=True, kw_only=True)
class ExportPlan:
    protocol: str
    metadata: dict[str, Any]
    hash: str
    geometry: P.ShardGeometry
    layers: tuple[int, ...]
    parts: tuple[Part, ...]
    cls: str
    labels: bool
    stored_dtype: str
    # Padded (LLM) stores: real tokens only, packed `tokens_per_example` to an exported
    # example; offsets[e] is store example e's first token in that stream (None: unpacked).
    offsets: np.ndarray | None = None
    dropped_tokens: int = 0  # the stream's tail shorter than one exported example
    # Packed exports of a text store whose labels mark token kinds: {segment: (N, T_max)
    # bool}, the tokens exported (content, label 0; actstore.read.masks); None: every real token.
    keep: dict[str, np.ndarray] | None = None

    def rows(self, part: Part, ex: int, n_read: int) -> np.ndarray:
        """The rows of a segment's padded read (`n_read` real tokens) that example `ex`
        contributes to a packed export's stream, in order."""
        n = part.count if part.fixed else min(max(n_read - part.skip, 0), part.count)
        rows = np.arange(part.skip, part.skip + n)
        if self.keep is not None and part.segment in self.keep:
            rows = rows[self.keep[part.segment][ex, part.skip : part.skip + n]]
        return rows


DEFAULT_BATCH_BYTES = 32 * 2**20  # float32 bytes per work unit of the export's pipeline
# Bytes of one exported shard file, at most: every file, the last one included, takes the
# full (examples_per_shard, L, T, D) shape (zero padding, a sparse hole), and saev's
# readers map each file whole. A budget beyond it is refused before anything is written.
MAX_SHARD_FILE_BYTES = 2**40


@dataclass(frozen=True, kw_only=True)
class SaevExportOptions:
    """Every option of a saev export, as one value (export_saev's Args describe each)."""

    protocol: str = "auto"
    layers: Sequence[int] | None = None
    segments: Sequence[str] | None = None
    cls: str | bool | None = None
    family: str | None = None
    ckpt: str | None = None
    dataset: str | os.PathLike | None = None
    data: Any = None
    patches_per_shard: int | None = None  # None: at most DEFAULT_BUDGET, fitted to the data
    pixel_agg: str | None = None
    labels: bool | None = None
    tokens_per_example: int | None = None
    keep_special: bool = False
    overwrite: bool = False
    workers: int = 2
    batch_bytes: int = DEFAULT_BATCH_BYTES
    fsync: bool = True
    progress: bool = True


def make_plan(
    store: ActStore, options: SaevExportOptions | None = None, *, protocol: str = P.DEFAULT_PROTOCOL
) -> ExportPlan:
    """Validate every export option against `store`; `protocol` is the one chosen for the
    export (options.protocol may say "auto"); see export_saev."""
    o = options if options is not None else SaevExportOptions()
    layers, segments, cls, family, ckpt, dataset, data = (
        o.layers,
        o.segments,
        o.cls,
        o.family,
        o.ckpt,
        o.dataset,
        o.data,
    )
    patches_per_shard, pixel_agg, labels, tokens_per_example = (
        o.patches_per_shard,
        o.pixel_agg,
        o.labels,
        o.tokens_per_example,
    )
    if protocol not in P.PROTOCOLS:
        raise SaevOptionError(f"protocol must be one of {list(P.PROTOCOLS)}. Got {protocol!r}.")
    cfg = store.config
    attrs = dict(cfg.attrs)
    n = len(store)
    if n == 0:
        raise SaevOptionError(f"store {store.path} holds no examples; there is nothing to export")
    layers_t = _layers(layers, store)
    seg_names = _segments(segments, cfg)
    text = any(not cfg.segment(s).fixed for s in seg_names)  # padded segments: real tokens packed
    # What saev's metadata needs and the store may not record: every gap named at once.
    cls_mode, family_v, ckpt_v, dataset_v = _all_or_raise(
        lambda: _cls_mode(cls, attrs, [cfg.segment(s) for s in seg_names]),
        lambda: _family(family, attrs, cfg.model_id, protocol, text=text),
        lambda: _ckpt(ckpt, attrs, cfg.model_id),
        lambda: _dataset(dataset, attrs),
    )
    parts, t_total = _parts(seg_names, cfg, cls_mode)
    cls_token = cls_mode == "keep"
    content = t_total - int(cls_token)
    offsets, dropped, keep = None, 0, None
    if any(not p.fixed for p in parts):  # padding is never exported: pack the real tokens
        if cls_token:
            raise SaevOptionError(
                "an export of padded (text) segments packs real tokens, with no per-example CLS token; pass cls='drop' or 'none'"
            )
        keep = None if o.keep_special else _content(store, parts)
        offsets = _token_offsets(store, parts, keep)
        content = 1 if tokens_per_example is None else int(tokens_per_example)
        if content < 1:
            raise SaevOptionError(f"tokens_per_example must be a positive int. Got {tokens_per_example!r}.")
        n, dropped = divmod(int(offsets[-1]), content)
        if n == 0:
            raise SaevOptionError(
                f"the store holds {int(offsets[-1])} real tokens, fewer than one exported example of {content}"
            )
    elif tokens_per_example is not None:
        raise SaevOptionError(
            "tokens_per_example packs the real tokens of padded (text) segments; this store's segments are fixed-length"
        )
    if content < 1:
        raise SaevOptionError(
            f"the exported examples would hold no content tokens (segments {seg_names}, cls {cls_mode!r}); "
            "choose segments with more tokens"
        )
    if patches_per_shard is None:  # the default: at most DEFAULT_BUDGET, fitted to the data
        per_example = (content + int(cls_token)) * len(layers_t)
        patches_per_shard = fitted_budget(n, per_example, P.DEFAULT_BUDGET)
    if isinstance(patches_per_shard, bool) or not isinstance(patches_per_shard, int) or patches_per_shard <= 0:
        raise SaevOptionError(f"patches_per_shard must be a positive int. Got {patches_per_shard!r}.")
    geom = P.ShardGeometry(
        n_examples=n,
        n_layers=len(layers_t),
        content_tokens=content,
        cls_token=cls_token,
        d_model=cfg.d_model,
        budget=patches_per_shard,
    )
    if geom.examples_per_shard < 1:
        need = geom.tokens_per_example * geom.n_layers
        raise SaevOptionError(
            f"patches_per_shard {patches_per_shard} is smaller than one example ({geom.tokens_per_example} tokens "
            f"x {geom.n_layers} layers = {need}); raise it to at least {need}"
        )
    if geom.shard_nbytes > MAX_SHARD_FILE_BYTES:
        most = MAX_SHARD_FILE_BYTES // geom.example_nbytes * geom.tokens_per_example * geom.n_layers
        whole = n * geom.tokens_per_example * geom.n_layers
        raise SaevOptionError(
            f"patches_per_shard {patches_per_shard} makes every shard file {geom.shard_nbytes:,} bytes (zero-padded "
            f"past the data: saev's readers map each file whole); at most {MAX_SHARD_FILE_BYTES:,} bytes per file: "
            f"pass at most {most:,} ({min(most, whole):,} holds this whole export in one file), or leave it out"
        )
    want_labels = _labels(labels, cfg)
    values = {
        "family": family_v,
        "ckpt": ckpt_v,
        "layers": list(layers_t),
        P.CONTENT_KEY[protocol]: content,
        "cls_token": cls_token,
        "d_model": cfg.d_model,
        P.N_KEY[protocol]: n,
        P.BUDGET_KEY[protocol]: patches_per_shard,
        "data": _data(
            data,
            attrs,
            protocol,
            _default_data(store, seg_names, cls_mode, packed=offsets is not None, content=keep is not None),
        ),
        "dataset": dataset_v,
        "pixel_agg": _pixel_agg(pixel_agg, attrs, protocol),
        "dtype": P.DTYPE,
        "protocol": protocol,
    }
    metadata = {k: values[k] for k in P.FIELDS[protocol]}
    try:
        digest = P.metadata_hash(metadata, protocol)
    except (TypeError, ValueError) as e:
        raise SaevOptionError(f"the saev metadata must be plain JSON (check data and the store's attrs): {e}") from None
    return ExportPlan(
        protocol=protocol,
        metadata=metadata,
        hash=digest,
        geometry=geom,
        layers=layers_t,
        parts=parts,
        cls=cls_mode,
        labels=want_labels,
        stored_dtype=cfg.dtype,
        offsets=offsets,
        dropped_tokens=dropped,
        keep=keep,
    )


def _content(store: ActStore, parts: tuple[Part, ...]) -> dict[str, np.ndarray] | None:
    """{segment: (N, T_max) bool content tokens} where the readers' default mask leaves out
    special and chat-template tokens (a text store whose labels mark token kinds), else None."""
    if not leaves_out_special(store):
        return None
    return {p.segment: np.asarray(store.field(p.segment + TOKEN_LABELS_SUFFIX)) == 0 for p in parts}


def _token_offsets(store: ActStore, parts: tuple[Part, ...], keep: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Each store example's first token in the stream of exported tokens (parts in order,
    each part's tokens past its skip and within its length, and in `keep` where given), and
    the total at the end."""
    counts = np.zeros(len(store), np.int64)
    for p in parts:
        lens = (
            np.full(len(store), p.count + p.skip, np.int64)
            if p.fixed
            else np.asarray(store.field(p.segment + LEN_SUFFIX), np.int64)
        )
        if keep is not None and p.segment in keep:
            window = keep[p.segment][:, p.skip : p.skip + p.count]
            within = np.arange(p.skip, p.skip + window.shape[1])[None, :] < lens[:, None]
            counts += (window & within).sum(axis=1)
        else:
            counts += np.clip(lens - p.skip, 0, p.count)
    return np.concatenate([[0], np.cumsum(counts)])


def fitted_budget(n_examples: int, per_example: int, cap: int) -> int:
    """The default token budget per shard: as many shards as `cap` gives (at least one
    example each), then the fewest examples per shard that hold the data, so the last,
    zero-padded shard file (saev's readers map every file at the full shape) holds less
    than one example per shard of padding instead of up to a whole shard of zeros."""
    most = max(1, cap // per_example)
    shards = -(-n_examples // most)
    return -(-n_examples // shards) * per_example


def _layers(layers: Sequence[Any] | None, store: ActStore) -> tuple[int, ...]:
    """Layer numbers, names or negative numbers (actstore.read.layers) -> stored layer numbers."""
    if layers is None:
        return tuple(store.config.layers)
    out = tuple(store.layer_number(x) for x in layers)  # raises LayerNotFoundError naming the stored layers
    if not out or len(set(out)) != len(out):
        raise SaevOptionError(f"layers must be a non-empty list of distinct layers. Got {list(layers)}.")
    for x in out:
        layer_position(store.config.layers, x)
    return out


def _segments(segments: Sequence[str] | None, cfg: Any) -> list[str]:
    if segments is None:
        return [s.name for s in cfg.segments]
    names = list(segments)
    if not names or len(set(names)) != len(names):
        raise SaevOptionError(f"segments must be a non-empty list of distinct segment names. Got {names}.")
    for name in names:
        cfg.segment(name)  # raises SegmentNotFoundError listing the store's segments
    return names


def _all_or_raise(*checks: Any) -> list[Any]:
    """Each check's value; when some raise SaevOptionError, one error naming every one of them."""
    values, problems = [], []
    for check in checks:
        try:
            values.append(check())
        except SaevOptionError as e:
            problems.append(str(e))
    if len(problems) == 1:
        raise SaevOptionError(problems[0])
    if problems:
        raise SaevOptionError(f"{len(problems)} export options need a value: " + "; and ".join(problems))
    return values


def _cls_mode(cls: str | bool | None, attrs: dict[str, Any], segs: list[Any]) -> str:
    if cls is True or cls is False:
        cls = "keep" if cls else "none"
    if cls is None:
        known = attrs.get("cls_token")
        if isinstance(known, bool):
            return "keep" if known else "none"
        if all(not s.fixed for s in segs):
            return "none"  # padded text segments: no CLS token
        raise SaevOptionError(
            "the store does not say whether token 0 is a CLS token (no boolean attrs['cls_token']); pass cls (--cls): "
            "'keep' (CLS exported at token 0), 'drop' (CLS left out) or 'none' (no CLS: every token is content)"
        )
    if cls not in CLS_MODES:
        raise SaevOptionError(f"cls must be one of {list(CLS_MODES)}. Got {cls!r}.")
    return cls


def _parts(seg_names: list[str], cfg: Any, cls_mode: str) -> tuple[tuple[Part, ...], int]:
    parts, dst = [], 0
    for k, name in enumerate(seg_names):
        seg = cfg.segment(name)
        skip = 1 if k == 0 and cls_mode == "drop" else 0
        count = seg.t_max - skip
        if count > 0:
            parts.append(Part(segment=name, skip=skip, count=count, dst=dst, n_pad=seg.t_pad, fixed=seg.fixed))
        dst += count
    return tuple(parts), dst


def _labels(labels: bool | None, cfg: Any) -> bool:
    if labels is None:
        return bool(cfg.token_labels)
    if labels and not cfg.token_labels:
        raise SaevOptionError(
            "the store has no per-token labels (it was written without token_labels=True); export without labels"
        )
    return bool(labels)


def _family(family: str | None, attrs: dict[str, Any], model_id: str | None, protocol: str, text: bool = False) -> str:
    allowed = P.FAMILIES[protocol]
    source = "family"
    if family is None:
        family, source = attrs.get("family"), "the store's attrs['family']"
    if family is None:
        hits = sorted((f for f in allowed if model_id and f in model_id.lower()), key=len, reverse=True)
        if hits:
            return hits[0]
        if text:  # saev knows vision families only; its loaders read any listed one
            raise SaevOptionError(
                f"a text store ({model_id!r}) has no saev family: saev's protocol {protocol} lists only the vision families "
                f"{list(allowed)}; pass one as a label (--family, e.g. clip: the shards read the same whichever is named), "
                "the model stays named in ckpt"
            )
        raise SaevOptionError(
            f"the store does not record its model family (attrs['family']) and its model_id {model_id!r} names none; "
            f"pass family (--family), one of {list(allowed)}"
        )
    if family not in allowed:
        raise SaevOptionError(
            f"{source} {family!r} is not a saev protocol {protocol} family; saev accepts only {list(allowed)}: "
            "pass one with --family"
        )
    return family


def _ckpt(ckpt: str | None, attrs: dict[str, Any], model_id: str | None) -> str:
    value = ckpt if ckpt is not None else attrs.get("ckpt", model_id)
    if not isinstance(value, str) or not value:
        raise SaevOptionError(
            "the store records no model identifier (model_id or attrs['ckpt']); pass ckpt (--ckpt), "
            "e.g. 'facebook/dinov2-small'"
        )
    return value


def _dataset(dataset: str | os.PathLike | None, attrs: dict[str, Any]) -> str:
    if dataset is not None:
        return os.path.abspath(os.fspath(dataset))
    value = attrs.get("dataset")
    if value is None:
        raise SaevOptionError(
            "the store does not record its dataset root (attrs['dataset']); pass dataset (--dataset), the "
            "absolute path of the original data set (saev links it for visuals)"
        )
    if isinstance(value, str) and value.startswith("embedded:"):
        raise SaevOptionError(
            f"the store's attrs['dataset'] is {value!r}, data shipped in packages, not a folder saev can link to; pass "
            "dataset (--dataset) the absolute path of a folder holding those images (`actstore export-saev` writes the "
            "embedded images to DUMP_TO/embedded-images and names that folder by itself)"
        )
    if not isinstance(value, str) or not os.path.isabs(value):
        raise SaevOptionError(
            f"the store's attrs['dataset'] must be an absolute path. Got {value!r}; pass dataset (--dataset)"
        )
    return value


def _pixel_agg(pixel_agg: str | None, attrs: dict[str, Any], protocol: str) -> str | None:
    if protocol == "2.0":
        if pixel_agg is not None:
            raise SaevOptionError("pixel_agg exists only in protocol 2.1; drop it or pass protocol='2.1'")
        return None
    value = pixel_agg if pixel_agg is not None else attrs.get("pixel_agg", P.DEFAULT_PIXEL_AGG)
    if value not in P.PIXEL_AGGS:
        raise SaevOptionError(f"pixel_agg must be one of {list(P.PIXEL_AGGS)}. Got {value!r}.")
    return value


def _default_data(
    store: ActStore, seg_names: list[str], cls_mode: str, packed: bool = False, content: bool = False
) -> dict[str, Any]:
    """What the export was made from; `content_crc32c` ties the hash to the store's bytes."""
    crc = 0
    for s in store.manifest.shards:
        crc = crc32c(struct.pack("<QQI", s.n_examples, s.nbytes, s.crc32c & 0xFFFFFFFF), crc)
    return {
        "__class__": "ActStore",
        "model_id": store.config.model_id,
        "segments": seg_names,
        "cls": cls_mode,
        "content_crc32c": f"{crc:08x}",
        **(
            {"tokens": f"real tokens only, packed; {P.OFFSETS_FILE} maps them to (store example, position)"}
            if packed
            else {}
        ),
        **({"special_tokens": "left out (content tokens only, token label 0)"} if content else {}),
    }


def _data(data: Any, attrs: dict[str, Any], protocol: str, default: dict[str, Any]) -> Any:
    source = "data"
    if data is None:
        data, source = attrs.get("data", default), "the store's attrs['data']"
    if protocol == "2.1":
        if isinstance(data, dict):
            return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if not isinstance(data, str):
            raise SaevOptionError(
                f"{source} must be a string (or an object, stored as JSON) for protocol 2.1. Got {data!r}."
            )
        return data
    if isinstance(data, str):
        try:
            data = jsonio.parse(data)
        except ValueError:
            raise SaevOptionError(f"{source} must be a JSON object for protocol 2.0. Got {data!r}.") from None
    if not isinstance(data, dict) or not isinstance(data.get("__class__"), str):
        raise SaevOptionError(
            f"{source} must be an object with a string '__class__' field naming the dataset config class "
            f"(protocol 2.0 stores dataclasses.asdict(cfg.data) plus __class__). Got {data!r}."
        )
    return data
