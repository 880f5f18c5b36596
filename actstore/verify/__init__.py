"""Integrity checks of a store: `actstore verify` and `ActStore(path, verify=...)`.

Split by level: `store` (identity against manifest, the store's root, shards present and
listed), `shard` (commit and block records, checksum file, folders, per-sample arrays,
texts, statistics), `acts` (every chunk object present at its exact size; with deep=True
every (example, layer) crc32c recomputed and compared with the writer's record), over one
listing of the store (`check`), reporting into `report`. saev directories are checked by
actstore.saev.verify. Everything is read through the store's Storage, so a store in
object storage verifies like a local one.

Fast mode reads metadata and object sizes only; deep mode also reads every published
chunk. Missing chunks: the direct writer writes every chunk, so a missing one is damage;
zarr-python (engine "zarr") omits chunks equal to the fill value, so there a missing chunk
is legal and deep mode's checksum says whether zeros were written.
"""

from actstore.verify.report import ERROR, WARNING, Problem, VerifyReport
from actstore.verify.store import verify_store

__all__ = ["ERROR", "WARNING", "Problem", "VerifyReport", "verify_store"]
