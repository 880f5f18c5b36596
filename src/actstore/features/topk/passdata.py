"""The output of a feature pass as the views read it: meta.json and the three tables as
numpy columns, in the format of either version (actstore-features/1: one positive tail;
/2: a `sign` column, +1 rows the positive tail and -1 rows the negative one), and the check
that the store still is the state the pass read (meta.json's `store.sha256`: the sha256 of
the manifest bytes the pass opened).

The views (`actstore view`, the exports) read a pass through `load_pass` only, so a folder of
format 1 reads as all +1 and every consumer sees the same columns.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.topk.tables import FEATURES, INTERVALS, META, TOP, store_checksum
from actstore.read.api import Reader, ReaderLike, as_reader
from actstore.storage import open_storage

FORMATS = ("actstore-features/1", "actstore-features/2")
STORE_CHANGED = ("refuse", "warn")  # what a view does when the store is not the state the pass read


@dataclass(frozen=True)
class PassData:
    """One pass's files as columns (numpy arrays; `histogram` columns as (F, bins) int64).

    Attributes:
        meta: meta.json's content.
        top: feature, rank, example, token, activation, sign (+1 / -1).
        features: feature, max, density, mean_active, n_active, n_tokens, histogram and, when
            the pass kept the negative tail, min, n_negative, density_negative, mean_negative,
            histogram_negative.
        intervals: feature, interval, lo, hi, sample, example, token, activation, exact, sign.
    """

    meta: dict[str, Any]
    top: dict[str, np.ndarray]
    features: dict[str, np.ndarray]
    intervals: dict[str, np.ndarray]

    @property
    def n_features(self) -> int:
        return len(self.features["feature"])

    @property
    def has_negative(self) -> bool:
        return "histogram_negative" in self.features


def read_pass_meta(src: Any) -> dict[str, Any]:
    """meta.json of a pass folder or URL, of either format."""
    import json

    storage = open_storage(src)
    if not storage.exists(META):
        raise FeatureError(
            f"{storage.url} holds no {META}: it is not the output of `actstore features` (or that run did not finish)"
        )
    try:
        meta = json.loads(storage.get(META))
    except ValueError as e:
        raise FeatureError(f"{storage.url}/{META} is not JSON ({e}): rerun `actstore features`") from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise FeatureError(f"{storage.url}/{META}: format must be one of {list(FORMATS)}. Got {got!r}.")
    return meta


def load_pass(src: Any) -> PassData:
    """Read a pass folder or URL (`actstore features --out`)."""
    import hashlib
    import io

    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FeatureError("feature tables need pyarrow: pip install 'actstore[views]'") from None
    meta = read_pass_meta(src)
    storage = open_storage(src)
    cols = {}
    sums = meta.get("files") or {}  # format 2: the sha256 of each table as published
    for name in (TOP, FEATURES, INTERVALS):
        try:
            data = storage.get(name)
        except FileNotFoundError:
            raise FeatureError(f"{storage.url} has meta.json but no {name}: rerun `actstore features`") from None
        if name in sums and hashlib.sha256(data).hexdigest() != sums[name]:
            raise FeatureError(
                f"{storage.url}/{name} is not the file meta.json vouches for (sha256 differs): rerun `actstore features`"
            )
        table = pq.read_table(io.BytesIO(data))
        cols[name] = {c: _column(table, c) for c in table.column_names}
    for name in (TOP, INTERVALS):
        if "sign" not in cols[name]:  # format 1: the positive tail only
            cols[name]["sign"] = np.ones(len(cols[name]["feature"]), np.int8)
    return PassData(meta, cols[TOP], cols[FEATURES], cols[INTERVALS])


def _column(table: Any, name: str) -> np.ndarray:
    col = table.column(name)
    if name.startswith("histogram"):  # list<int64> per row -> (F, bins), from the flat values
        flat = col.combine_chunks().flatten().to_numpy(zero_copy_only=False)
        n = len(col)
        return flat.reshape(n, -1) if n else np.zeros((0, 0), np.int64)
    return col.to_numpy(zero_copy_only=False)


def open_store_of(meta: dict[str, Any], store: ReaderLike | None) -> Reader:
    """`store` as a Reader, or (None) the store meta.json names, opened."""
    if store is not None:
        return as_reader(store)
    from actstore.opener import open as open_store

    return open_store(meta["store"]["path"])


def check_store(meta: dict[str, Any], store: Reader, on_change: str = "refuse") -> str | None:
    """Compare the store with the state the pass read (meta.json's manifest checksum).

    Returns None when they match (or the reader has no manifest to compare), else the
    message; `on_change="refuse"` raises it as a FeatureError, "warn" prints it on stderr."""
    if on_change not in STORE_CHANGED:
        raise FeatureError(f"on_change must be one of {list(STORE_CHANGED)}. Got {on_change!r}.")
    want = (meta.get("store") or {}).get("sha256")
    have = store_checksum(store)
    if want is None or have is None or want == have:
        return None
    msg = (
        f"{store.path} is no longer the state the feature pass read (manifest sha256 {have[:12]}..., "
        f"meta.json has {want[:12]}...): its examples may have changed under the tables. "
        "Rerun `actstore features` on it"
    )
    if on_change == "refuse":
        raise FeatureError(msg + ", or pass --allow-store-change to view it anyway")
    print(f"actstore: warning: {msg}", file=sys.stderr)
    return msg
