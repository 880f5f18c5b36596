"""`actstore import-pkl`: a legacy pkl.gz directory -> an actstore store.

Mapping (one actstore writer shard per legacy shard, in metadata.json order):
- `layer_{idx}` lists -> the store's layers (`extraction_config.layers_extracted` order);
  example i of a shard is item i of every layer list (their sample_idx must agree);
- each activation [seq_len, hidden_size] -> one example of segment "tokens"
  (T_max = `max_seq_length`), with its true length seq_len;
- `sample_idx` -> the int64 field "sample_idx" and the sample key str(sample_idx);
- `text_preview` -> text "text_preview"; `metadata` -> text "metadata" (JSON);
- metadata.json (extraction and distributed config, statistics) -> store attrs "legacy_pkl".

A rerun after a crash skips the shards already imported completely from the same
metadata.json and rewrites the others, then finalizes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import CorruptStoreError, LegacyFormatError, StoreMismatchError, UnsafePathError
from actstore.layout import jsonio, spec
from actstore.legacy.metadata import METADATA_FILE, LegacyMetadata, LegacyShardInfo, parse_metadata
from actstore.legacy.safe_pickle import MAX_OBJECTS, load_shard_bytes
from actstore.storage.files import read_regular, safe_child

SEGMENT = "tokens"
TEXTS = ("text_preview", "metadata")
BATCH = 32
_HINT = "a legacy directory holds only metadata.json and its shard files"
_RECORD_SLACK = 1 << 16  # pickle bytes allowed per record beyond its activation (text, metadata)


@dataclass(kw_only=True)
class ImportReport:
    """What `import_pkl` did."""

    source: str
    store: str
    n_shards: int = 0
    n_imported: int = 0
    n_skipped: int = 0
    n_examples: int = 0
    layers: list[int] = field(default_factory=list)
    d_model: int = 0
    t_max: int = 0
    dtype: str = ""
    bytes_read: int = 0
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"imported {self.source} -> {self.store}: {self.n_examples} examples from {self.n_shards} legacy shards "
            f"({self.n_imported} written now, {self.n_skipped} already imported), {self.bytes_read} bytes read",
            f"layers {self.layers}, d_model {self.d_model}, segment {SEGMENT!r} with T_max {self.t_max}, stored as {self.dtype}",
            f"fields: sample_idx; texts: {', '.join(TEXTS)}; legacy metadata.json in the store's attrs['legacy_pkl']",
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def import_pkl(
    source: str | os.PathLike,
    store: str | os.PathLike,
    *,
    dtype: str = spec.DEFAULT_DTYPE,
    tokens: int | None = None,
    max_shard_bytes: int | None = None,
    max_objects: int = MAX_OBJECTS,
    progress: Callable[[int], None] | None = None,
) -> ImportReport:
    """Import a legacy pkl.gz directory into a new (or partly imported) store, then finalize it.

    Args:
        source: the legacy directory (metadata.json + shard files).
        store: the store to write.
        dtype: stored dtype ("float16" default, "bfloat16", "float32").
        tokens: T_max when metadata.json has no extraction_config.max_seq_length.
        max_shard_bytes: refuse a shard whose pickle decompresses to more bytes than this
            (default: derived from its metadata: num_samples x layers x T x D x 8 + slack).
        max_objects: refuse a shard whose pickle builds more objects than this.
        progress: called with the number of examples imported after each shard.

    Raises:
        LegacyFormatError: metadata, checksums or shard contents do not match the format.
        UnsafePickleError: a shard pickle asks for anything but numpy array reconstruction.
    """
    from actstore.write.finalize import finalize

    src = Path(source)
    md, md_sha = _read_metadata(src)
    t_max = tokens or md.max_seq_length
    if not t_max:
        raise LegacyFormatError(
            f"{src / METADATA_FILE} has no extraction_config.max_seq_length; pass tokens=T (--tokens T), the longest activation"
        )
    report = ImportReport(
        source=str(src), store=str(store), n_shards=len(md.shards), layers=list(md.layers), t_max=t_max, dtype=dtype
    )
    seen: set[int] = set()
    d_model = md.hidden_size
    for i, info in enumerate(md.shards):
        state = _existing_shard(Path(store), i, info, md_sha)
        if state == "done":
            report.n_skipped += 1
            report.n_examples += info.num_samples
            seen.update(_imported_ids(Path(store), i, info.num_samples))
            continue
        data = _read_shard_file(src, info)
        report.bytes_read += len(data)
        if info.sha256 is None:
            report.warnings.append(f"{info.filename} lists no checksum: its integrity was not verified")
        bound = max_shard_bytes or _default_bound(info, md, t_max, d_model)
        obj = load_shard_bytes(
            data,
            compressed=info.compressed,
            where=str(src / info.filename),
            max_bytes=bound,
            max_objects=max_objects,
            max_shares=len(md.layers) - 1,
        )
        del data
        examples = _shard_examples(obj, info, md.layers, t_max, d_model, str(src / info.filename))
        del obj
        if d_model is None:
            d_model = examples[0][1].shape[2] if examples else None
        for sample_idx, _, _, _ in examples:
            if sample_idx in seen:
                raise LegacyFormatError(
                    f"{src / info.filename}: sample_idx {sample_idx} appears in more than one record; sample ids must be unique"
                )
            seen.add(sample_idx)
        if d_model is None:
            raise LegacyFormatError(
                f"{src / METADATA_FILE}: no hidden_size and the first shard is empty; cannot tell d_model"
            )
        _write_shard(Path(store), i, examples, md, md_sha, d_model, t_max, dtype, overwrite=state == "partial")
        report.n_imported += 1
        report.n_examples += len(examples)
        if progress is not None:
            progress(len(examples))
    m = finalize(store)
    report.d_model = m.config.d_model
    return report


def _read_metadata(src: Path) -> tuple[LegacyMetadata, str]:
    path = src / METADATA_FILE
    try:
        raw = read_regular(path, error=LegacyFormatError, hint=_HINT, max_bytes=jsonio.MAX_JSON_BYTES)
    except FileNotFoundError:
        raise LegacyFormatError(
            f"{src} has no {METADATA_FILE}: it is not a legacy pkl.gz activation directory"
        ) from None
    try:
        doc = jsonio.parse(raw)
    except ValueError as e:
        raise LegacyFormatError(f"{path} is not valid JSON ({e})") from None
    return parse_metadata(doc, str(path)), hashlib.sha256(raw).hexdigest()


def _read_shard_file(src: Path, info: LegacyShardInfo) -> bytes:
    try:
        path = safe_child(src, info.filename)
    except UnsafePathError:
        raise LegacyFormatError(
            f"{src / METADATA_FILE}: shard filename {info.filename!r} points outside {src}; refusing to read it"
        ) from None
    try:
        data = read_regular(path, error=LegacyFormatError, hint=_HINT)
    except FileNotFoundError:
        raise LegacyFormatError(f"{path} is listed in {METADATA_FILE} but missing") from None
    if info.size_bytes is not None and len(data) != info.size_bytes:
        raise LegacyFormatError(
            f"{path} has {len(data)} bytes; {METADATA_FILE} says {info.size_bytes} (truncated or replaced?)"
        )
    if info.sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != info.sha256:
            raise LegacyFormatError(
                f"{path} has sha256 {got}; {METADATA_FILE} lists {info.sha256}: the file is damaged or was replaced, "
                "nothing of it was imported"
            )
    return data


def _default_bound(info: LegacyShardInfo, md: LegacyMetadata, t_max: int, d_model: int | None) -> int:
    d = d_model or 65_536
    return info.num_samples * len(md.layers) * (t_max * d * 8 + _RECORD_SLACK) + (1 << 20)


def _shard_examples(
    obj: Any, info: LegacyShardInfo, layers: tuple[int, ...], t_max: int, d_model: int | None, where: str
) -> list[tuple]:
    """[(sample_idx, acts (L, T_i, D), text_preview, metadata)] of one shard, validated."""
    if not isinstance(obj, dict):
        raise LegacyFormatError(f"{where} must hold a dict of layer_<idx> lists. Got {type(obj).__name__}.")
    keys = [f"layer_{l}" for l in layers]
    if set(obj) != set(keys):
        raise LegacyFormatError(
            f"{where} holds keys {sorted(map(str, obj))}; metadata.json lists layers {list(layers)} ({keys})"
        )
    lists = [obj[k] for k in keys]
    for k, items in zip(keys, lists):
        if not isinstance(items, list) or len(items) != info.num_samples:
            n = len(items) if isinstance(items, list) else type(items).__name__
            raise LegacyFormatError(
                f"{where}: {k} holds {n} records; metadata.json says num_samples {info.num_samples}"
            )
    out = []
    for j in range(info.num_samples):
        recs = [_record(items[j], f"{where}: {k}[{j}]", t_max, d_model) for k, items in zip(keys, lists)]
        idx, seq = recs[0][0], recs[0][1].shape
        for r, k in zip(recs, keys):
            if r[0] != idx or r[1].shape != seq:
                raise LegacyFormatError(
                    f"{where}: record {j} is sample_idx {idx} of shape {seq} in {keys[0]} but sample_idx {r[0]} of shape {r[1].shape} in {k}"
                )
        acts = np.stack([r[1] for r in recs])  # (L, T_i, D); one copy to join the layers
        out.append((idx, acts, recs[0][2], recs[0][3]))
    if info.sample_id_range is not None and out:
        ids = [e[0] for e in out]
        if (min(ids), max(ids)) != info.sample_id_range:
            raise LegacyFormatError(
                f"{where}: sample ids span {min(ids)}..{max(ids)}; metadata.json says {list(info.sample_id_range)}"
            )
    return out


def _record(r: Any, where: str, t_max: int, d_model: int | None) -> tuple[int, np.ndarray, str, Any]:
    if not isinstance(r, dict) or "sample_idx" not in r or "activation" not in r:
        raise LegacyFormatError(f"{where} must be a dict with sample_idx and activation. Got {str(r)[:120]}")
    idx = r["sample_idx"]
    if isinstance(idx, (bool, np.bool_)) or not isinstance(idx, (int, np.integer)) or not 0 <= idx < 2**63:
        raise LegacyFormatError(f"{where}: sample_idx must be a non-negative int64. Got {idx!r}.")
    a = r["activation"]
    if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype.kind != "f":
        desc = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise LegacyFormatError(f"{where}: activation must be a 2-D float array [seq_len, hidden_size]. Got {desc}.")
    if d_model is not None and a.shape[1] != d_model:
        raise LegacyFormatError(f"{where}: activation has hidden size {a.shape[1]}; metadata.json says {d_model}")
    if a.shape[0] > t_max:
        raise LegacyFormatError(
            f"{where}: activation has {a.shape[0]} tokens, more than max_seq_length {t_max}; pass tokens=T (--tokens)"
        )
    shape = r.get("shape")
    if shape is not None and (not isinstance(shape, (tuple, list)) or tuple(shape) != a.shape):
        raise LegacyFormatError(f"{where}: shape field {shape!r} does not match the activation's shape {a.shape}")
    text = r.get("text_preview", "")
    if not isinstance(text, str):
        raise LegacyFormatError(f"{where}: text_preview must be a string. Got {type(text).__name__}.")
    try:
        meta = jsonio.parse(json.dumps(r.get("metadata"), default=_jsonable, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise LegacyFormatError(
            f"{where}: metadata is not standard JSON (kept as a text of the store) ({type(e).__name__}: {e})"
        ) from None
    return int(idx), a, text, meta


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.size <= 1024:
        return v.tolist()
    if isinstance(v, tuple):
        return list(v)
    raise TypeError(f"{type(v).__name__} is not JSON-serialisable")


def _store_attrs(md: LegacyMetadata, md_sha: str) -> dict[str, Any]:
    return {
        "legacy_pkl": {
            "version": md.version,
            "created_at": md.created_at,
            "extraction_config": md.extraction_config,
            "distributed_config": md.distributed_config,
            "statistics": md.statistics,
            "metadata_sha256": md_sha,
        }
    }


def _existing_shard(root: Path, i: int, info: LegacyShardInfo, md_sha: str) -> str:
    """'new', 'partial' (a killed import: rewritten) or 'done' (imported from this source)."""
    from actstore import catalog
    from actstore.layout import records
    from actstore.storage import KeyNotFound, open_storage

    storage = open_storage(root)
    if not catalog.shard_exists(storage, i):
        return "new"
    sh = catalog.shard_storage(storage, i)
    rec = catalog.read_commit(sh)
    fmt = catalog.read_identity(storage).zarr_format  # the layout the import was written in
    key = records.group_attrs_key(fmt)
    try:
        cfg = records.shard_attrs_config(sh.get(key), fmt, sh.where(key))
        src_sha = (cfg.attrs.get("legacy_pkl") or {}).get("metadata_sha256")
    except (KeyNotFound, CorruptStoreError, AttributeError):
        src_sha = None
    if src_sha != md_sha:
        raise StoreMismatchError(
            f"{root} already holds shard {i}, not imported from this metadata.json; import into a new store path"
        )
    if rec.complete and rec.n_committed == info.num_samples:
        return "done"
    return "partial"


def _imported_ids(root: Path, i: int, n: int) -> list[int]:
    """sample_idx values of a shard imported by an earlier run (for the uniqueness check)."""
    import zarr

    from actstore import catalog
    from actstore.layout import keys
    from actstore.storage import open_storage

    sh = catalog.shard_storage(open_storage(root), i)
    arr = zarr.open_array(store=sh.zarr_store(keys.field_array("sample_idx"), read_only=True), mode="r")
    return [int(x) for x in arr[:n]]


def _write_shard(
    root: Path,
    i: int,
    examples: list[tuple],
    md: LegacyMetadata,
    md_sha: str,
    d_model: int,
    t_max: int,
    dtype: str,
    *,
    overwrite: bool,
) -> None:
    from actstore.write import ShardWriter

    with ShardWriter(
        root,
        shard=i,
        layers=list(md.layers),
        d_model=d_model,
        segments={SEGMENT: t_max},
        dtype=dtype,
        fields={"sample_idx": "int64"},
        texts=list(TEXTS),
        model_id=md.model_name,
        attrs=_store_attrs(md, md_sha),
        overwrite=overwrite,
    ) as w:
        for b0 in range(0, len(examples), BATCH):
            batch = examples[b0 : b0 + BATCH]
            lens = np.array([e[1].shape[1] for e in batch], np.int64)
            t = max(int(lens.max()), 1)
            acts = np.zeros((len(batch), len(md.layers), t, d_model), np.float32)
            for k, e in enumerate(batch):
                acts[k, :, : e[1].shape[1]] = e[1]
            ids = [e[0] for e in batch]
            w.append(
                acts,
                lengths=lens,
                sample_keys=[str(x) for x in ids],
                fields={"sample_idx": np.array(ids, np.int64)},
                texts={"text_preview": [e[2] for e in batch], "metadata": [e[3] for e in batch]},
            )
