"""Integrity checks of a store: `actstore verify` and `ActStore(path, verify=...)`.

Split by level. Fast (metadata and object sizes): `store` (identity against manifest, the
store's root, shards present and listed), `shard` (commit and block records against the
manifest, the checksums file, the shard's folders, per-sample arrays, texts, statistics),
`acts` (each activation array's metadata against the store config, every chunk object
present at its exact size). Deep: `deep` (every published chunk read and its crc32c
compared with the writer's record, per-sample values, text lines, statistics loaded).
All over one listing of the store (`check`), reporting into `report`; saev directories are
checked by actstore.saev.verify. Every byte is read through the store's Storage and every
name and record comes from actstore.layout, so a store in object storage verifies like a
local one.

Missing chunks: the direct writer writes every chunk, so a missing one is damage;
zarr-python (engine "zarr") omits chunks equal to the fill value, so there a missing chunk
is legal and deep mode's checksum says whether zeros were written.
"""

from actstore.verify.report import ERROR, WARNING, Problem, VerifyReport
from actstore.verify.store import verify_store

__all__ = ["ERROR", "WARNING", "Problem", "VerifyReport", "verify_store"]
