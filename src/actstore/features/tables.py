"""The files of a feature pass, in a folder or an object-store prefix, readable without
actstore (pandas, pyarrow, duckdb):

- `top.parquet`: one row per (feature, rank): feature int32, rank int32 (0 = highest),
  example int64, token int32 (the position in `store[example, layer]`), activation float32;
- `features.parquet`: one row per feature: feature, max, density, mean_active, n_active,
  n_tokens, histogram (list of counts on `meta.json`'s `histogram_edges`);
- `intervals.parquet`: feature, interval, lo, hi, sample, example, token, activation, exact;
- `meta.json`, written last (its presence says the folder is complete): the store (path,
  sha256 of its manifest), layer, encoder (kind, path, sha256), masks, options, command.
Every file is written whole and atomically through actstore's Storage.
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.collect import FeatureTables
from actstore.layout import keys
from actstore.read.api import Reader
from actstore.read.store import ActStore
from actstore.storage import Storage, open_storage

TOP, FEATURES, INTERVALS, META = "top.parquet", "features.parquet", "intervals.parquet", "meta.json"
FORMAT = "actstore-features/1"


def _pa() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise FeatureError("feature tables need pyarrow: pip install 'actstore[views]'") from None
    return pa, pq


def store_checksum(store: Reader) -> str | None:
    """sha256 of the store's manifest.json (names the exact finalized state read); None for
    a reader with no actstore manifest (a saev shard directory: SaevStore)."""
    if not isinstance(store, ActStore):
        return None
    return hashlib.sha256(store.storage.get(keys.MANIFEST)).hexdigest()


def _parquet(columns: dict[str, np.ndarray]) -> bytes:
    pa, pq = _pa()
    arrays = {}
    for name, col in columns.items():
        if name == "histogram":  # (F, bins) -> list<int64> per row, from flat buffers
            flat = pa.array(np.ascontiguousarray(col).reshape(-1))
            arrays[name] = (
                pa.FixedSizeListArray.from_arrays(flat, col.shape[1])
                if len(col)
                else pa.array([], pa.list_(pa.int64(), col.shape[1]))
            )
        else:
            arrays[name] = pa.array(col)
    buf = io.BytesIO()
    pq.write_table(pa.table(arrays), buf, compression="zstd")
    return buf.getvalue()


def write_tables(tables: FeatureTables, out: str | Storage, meta: dict[str, Any]) -> dict[str, Any]:
    """Write the three tables, then meta.json, into `out` (a folder or a URL)."""
    storage = open_storage(out)
    storage.delete(META) if storage.exists(META) else None  # an old meta.json must not vouch for new tables mid-write
    for name, cols in ((TOP, tables.top), (FEATURES, tables.features), (INTERVALS, tables.intervals)):
        storage.put(name, _parquet(cols))
    full = {
        "format": FORMAT,
        **meta,
        "histogram_edges": [float(x) for x in tables.hist_edges],
        "n_features": int(len(tables.features["feature"])),
        "n_tokens": int(tables.features["n_tokens"][0]) if len(tables.features["n_tokens"]) else 0,
    }
    storage.put(META, json.dumps(full, indent=1).encode())
    return full


def read_meta(src: str | Storage) -> dict[str, Any]:
    storage = open_storage(src)
    if not storage.exists(META):
        raise FeatureError(
            f"{storage.url} holds no {META}: it is not the output of `actstore features` (or that run did not finish)"
        )
    meta = json.loads(storage.get(META))
    if meta.get("format") != FORMAT:
        raise FeatureError(f"{storage.url}/{META}: format must be {FORMAT!r}. Got {meta.get('format')!r}.")
    return meta


def read_table(src: str | Storage, name: str) -> Any:
    """A pyarrow Table of one of the files (TOP, FEATURES, INTERVALS)."""
    _, pq = _pa()
    storage = open_storage(src)
    return pq.read_table(io.BytesIO(storage.get(name)))
