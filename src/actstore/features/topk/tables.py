"""The files of a feature pass, in a folder or an object-store prefix, readable without
actstore (pandas, pyarrow, duckdb):

- `top.parquet`: one row per (feature, sign, rank): feature int32, sign int8 (+1 the
  positive tail, rank 0 = highest; -1 the negative tail, rank 0 = lowest), rank int32,
  example int64, token int32 (the position in `store[example, layer]`), activation float32;
- `features.parquet`: one row per feature: feature, max, density, mean_active, n_active,
  n_tokens, histogram (list of counts on `meta.json`'s `histogram_edges`), of the positive
  side; with the negative tail also min, n_negative, density_negative, mean_negative and
  histogram_negative (counts of |value| on `histogram_edges_negative`);
- `intervals.parquet`: feature, sign, interval, lo, hi, sample, example, token, activation, exact;
- `meta.json`, published last (its presence says the folder is complete): the store (path,
  sha256 of the manifest bytes the pass opened), layer, encoder (kind, path, sha256), masks,
  options (sign among them), command, and the sha256 of each table file.
The files are written staged and swapped in whole (actstore.features.topk.publish): a failed
run keeps the older output. A folder of format 1 (no `sign` column) reads as all +1.
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.topk.collect import FeatureTables
from actstore.features.topk.publish import publish
from actstore.read.api import Reader
from actstore.storage import Storage, open_storage

TOP, FEATURES, INTERVALS, META = "top.parquet", "features.parquet", "intervals.parquet", "meta.json"
FORMAT = "actstore-features/2"
FORMATS = ("actstore-features/1", FORMAT)  # what read_meta accepts (1: no sign column, all +1)
SIGNED = (TOP, INTERVALS)  # the tables with a sign column


def _pa() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise FeatureError("feature tables need pyarrow: pip install 'actstore[views]'") from None
    return pa, pq


def store_checksum(store: Reader) -> str | None:
    """sha256 of the manifest bytes `store` opened (the exact finalized state it reads,
    ActStore.manifest_sha256: never read again, which a concurrent finalize may have
    replaced); None for a reader with no actstore manifest (a saev directory: SaevStore)."""
    return getattr(store, "manifest_sha256", None)


def _parquet(columns: dict[str, np.ndarray]) -> bytes:
    pa, pq = _pa()
    arrays = {}
    for name, col in columns.items():
        if name.startswith("histogram"):  # (F, bins) -> list<int64> per row, from flat buffers
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
    """Write the three tables and meta.json into `out` (a folder or a URL), staged and
    swapped in whole (actstore.features.topk.publish); returns meta.json's content."""
    files = {
        name: _parquet(cols)
        for name, cols in ((TOP, tables.top), (FEATURES, tables.features), (INTERVALS, tables.intervals))
    }
    edges = [float(x) for x in tables.hist_edges]
    full = {
        "format": FORMAT,
        **meta,
        "histogram_edges": edges,
        **({"histogram_edges_negative": edges} if tables.sign != "positive" else {}),
        "n_features": int(len(tables.features["feature"])),
        "n_tokens": int(tables.features["n_tokens"][0]) if len(tables.features["n_tokens"]) else 0,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    files[META] = json.dumps(full, indent=1).encode()
    publish(open_storage(out), files, META, {TOP, FEATURES, INTERVALS, META})
    return full


def read_meta(src: str | Storage) -> dict[str, Any]:
    storage = open_storage(src)
    if not storage.exists(META):
        raise FeatureError(
            f"{storage.url} holds no {META}: it is not the output of `actstore features` (or that run did not finish)"
        )
    meta = json.loads(storage.get(META))
    if meta.get("format") not in FORMATS:
        raise FeatureError(f"{storage.url}/{META}: format must be one of {list(FORMATS)}. Got {meta.get('format')!r}.")
    return meta


def read_table(src: str | Storage, name: str) -> Any:
    """A pyarrow Table of one of the files (TOP, FEATURES, INTERVALS); a table of format 1
    (no sign column) gains `sign` = +1 after `feature`."""
    pa, pq = _pa()
    storage = open_storage(src)
    table = pq.read_table(io.BytesIO(storage.get(name)))
    if name in SIGNED and "sign" not in table.column_names:
        table = table.add_column(1, "sign", pa.array(np.ones(table.num_rows, np.int8)))
    return table
