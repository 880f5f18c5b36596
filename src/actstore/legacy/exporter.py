"""`actstore export-pkl`: a store -> the legacy pkl.gz format, for tools that still read it.

Each record gets `sample_idx` (the store's "sample_idx" field, else the global example
index), `activation` (float32 [T_i, D], all segments joined as `store[ex, layer]` returns
them), `shape`, `text_preview` (the text "text_preview", else the first text field cut to
200 characters, else "") and `metadata` (the text "metadata" when it is an object, else
the sample key and numeric fields). Shard files are written atomically, metadata.json
(with sha256 checksums) last: a directory without metadata.json is an interrupted export,
which a rerun replaces.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actstore.errors import LegacyExportExistsError
from actstore.legacy.metadata import METADATA_FILE, SHARD_NAME_FORMAT
from actstore.storage.files import atomic_write_bytes, atomic_write_json, export_os_errors

if TYPE_CHECKING:
    from actstore.read.store import ActStore

PICKLE_PROTOCOL = 4
TEXT_PREVIEW_CHARS = 200
_OUR_FILES = re.compile(r"^(shard_\d{4,}\.pkl(\.gz)?|\..*\.tmp-.*)$")


@dataclass(kw_only=True)
class ExportReport:
    store: str
    out: str
    n_examples: int
    n_shards: int
    n_bytes: int

    def summary(self) -> str:
        return f"exported {self.store} -> {self.out}: {self.n_examples} examples in {self.n_shards} pkl shards ({self.n_bytes} bytes)"


def export_pkl(
    store: str | os.PathLike,
    out: str | os.PathLike,
    *,
    examples_per_shard: int = 100,
    compress: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write `store` as a legacy pkl.gz directory `out`.

    Args:
        store: a finalized store.
        out: the directory to write (created; an interrupted export there is replaced).
        examples_per_shard: records per shard file.
        compress: gzip the shards (.pkl.gz, the default) or not (.pkl).
        overwrite: replace a complete earlier export (a directory holding metadata.json).
        progress: called with the number of examples written after each shard.
    """
    from actstore.read.store import ActStore

    if isinstance(examples_per_shard, bool) or not isinstance(examples_per_shard, int) or examples_per_shard <= 0:
        raise ValueError(f"examples_per_shard must be a positive int. Got {examples_per_shard!r}.")
    st = ActStore(store)
    out = Path(out)
    with export_os_errors(
        f"exporting {st.path} to pkl",
        out,
        "the same export-pkl command (it replaces the unfinished export)",
        left=f"{out} holds an unfinished export (no {METADATA_FILE}), which no reader takes for a complete one",
    ):
        _prepare_out(out, overwrite)
        return _export(st, store, out, examples_per_shard, compress, progress)


def _export(
    st: ActStore,
    store: str | os.PathLike,
    out: Path,
    examples_per_shard: int,
    compress: bool,
    progress: Callable[[int], None] | None,
) -> ExportReport:
    n, cfg = len(st), st.config
    ids = st.field("sample_idx").astype(np.int64) if "sample_idx" in cfg.fields else np.arange(n, dtype=np.int64)
    keys = st.field("sample_key") if n else []
    previews = _previews(st, n)
    metas = _metadatas(st, n, keys)
    shards, total = [], 0
    for k, e0 in enumerate(range(0, n, examples_per_shard)):
        e1 = min(n, e0 + examples_per_shard)
        doc: dict[str, list[dict[str, Any]]] = {}
        for layer in cfg.layers:
            recs = []
            for ex in range(e0, e1):
                a = np.asarray(st[ex, layer], dtype=np.float32)  # a copy in float32, as the format says
                recs.append(
                    {
                        "sample_idx": int(ids[ex]),
                        "activation": a,
                        "shape": tuple(a.shape),
                        "text_preview": previews[ex],
                        "metadata": metas[ex],
                    }
                )
            doc[f"layer_{layer}"] = recs
        data = pickle.dumps(doc, protocol=PICKLE_PROTOCOL)
        if compress:
            data = gzip.compress(data, mtime=0)
        name = SHARD_NAME_FORMAT.format(k + 1) if compress else SHARD_NAME_FORMAT.format(k + 1)[: -len(".gz")]
        atomic_write_bytes(out / name, data)
        total += len(data)
        shards.append(
            {
                "shard_id": k + 1,
                "filename": name,
                "size_bytes": len(data),
                "num_samples": e1 - e0,
                "layers": list(cfg.layers),
                "sample_id_range": [int(ids[e0]), int(ids[e1 - 1])],
                "compressed": compress,
                "checksum": "sha256:" + hashlib.sha256(data).hexdigest(),
            }
        )
        if progress is not None:
            progress(e1 - e0)
    atomic_write_json(out / METADATA_FILE, _metadata_doc(st, shards, total))
    return ExportReport(store=str(store), out=str(out), n_examples=n, n_shards=len(shards), n_bytes=total)


def _prepare_out(out: Path, overwrite: bool) -> None:
    if not out.exists():
        out.mkdir(parents=True)
        return
    names = [p.name for p in out.iterdir()]
    if METADATA_FILE in names and not overwrite:
        raise LegacyExportExistsError(
            f"{out} already holds a legacy export ({METADATA_FILE}); pass overwrite=True (--overwrite) to replace it"
        )
    foreign = [x for x in names if x != METADATA_FILE and not _OUR_FILES.match(x)]
    if foreign:
        raise LegacyExportExistsError(
            f"{out} holds files that an export did not write ({', '.join(sorted(foreign)[:5])}); export to a new or empty folder"
        )
    for x in names:  # an interrupted (or replaced) export: metadata.json first, so it is never stale
        if x == METADATA_FILE:
            (out / x).unlink()
    for x in names:
        if x != METADATA_FILE:
            (out / x).unlink(missing_ok=True)


def _previews(st: Any, n: int) -> list[str]:
    texts = st.config.texts
    if "text_preview" in texts:
        return [v if isinstance(v, str) else str(v) for v in st.texts("text_preview")]
    if texts:
        return [(v if isinstance(v, str) else str(v))[:TEXT_PREVIEW_CHARS] for v in st.texts(texts[0])]
    return [""] * n


def _metadatas(st: Any, n: int, keys: Any) -> list[Any]:
    if "metadata" in st.config.texts:
        given = list(st.texts("metadata"))
    else:
        given = [None] * n
    fields = {f: st.field(f) for f in st.config.fields if f != "sample_idx"}
    out = []
    for i in range(n):
        if isinstance(given[i], dict):
            out.append(given[i])
        else:
            out.append({"sample_key": str(keys[i]), **{f: v[i].item() for f, v in fields.items()}})
    return out


def _metadata_doc(st: Any, shards: list[dict[str, Any]], total: int) -> dict[str, Any]:
    cfg = st.config
    legacy = dict(cfg.attrs.get("legacy_pkl") or {})
    extraction = dict(
        legacy.get("extraction_config")
        or {
            "model_name": cfg.model_id,
            "model_params": {"hidden_size": cfg.d_model},
            "max_seq_length": cfg.t_total,
        }
    )
    extraction["layers_extracted"] = list(cfg.layers)
    stats = dict(legacy.get("statistics") or {})
    stats.update(
        total_shards=len(shards), total_samples=len(st), total_size_bytes=total, layers_extracted=list(cfg.layers)
    )
    stats.setdefault("extraction_duration_seconds", 0.0)
    return {
        "version": "1.0",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "extraction_config": extraction,
        "distributed_config": legacy.get("distributed_config")
        or {
            "machine_id": 0,
            "total_machines": 1,
            "multihost": False,
            "num_hosts": 1,
            "mesh_type": "1d",
        },
        "shards": shards,
        "statistics": stats,
    }
