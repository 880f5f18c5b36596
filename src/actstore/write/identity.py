"""The store's identity claimed by the first writer, checked by every later one."""

from __future__ import annotations

from actstore import catalog
from actstore.errors import StoreMismatchError
from actstore.layout import keys, records
from actstore.layout.config import StoreConfig
from actstore.layout.spool import SPOOL_DIR
from actstore.storage import Storage


def claim_store(storage: Storage, cfg: StoreConfig) -> StoreConfig:
    """Create the store's identity record (create-only), or check that the existing store
    has `cfg`; returns the store's configuration."""
    names = storage.list_dir()  # one listing answers both: is it a store, and is it empty (no HEAD first)
    if keys.IDENTITY not in names:
        foreign = [
            n
            for n in names
            if n not in (keys.IDENTITY, keys.SHARDS, keys.MANIFEST, keys.LEASES, SPOOL_DIR) and not keys.is_temporary(n)
        ]
        if foreign:
            raise StoreMismatchError(
                f"{storage.url} already holds files that are not an actstore store ({', '.join(sorted(foreign)[:5])}); "
                "write the store to a new or empty folder"
            )
        if storage.put_if_absent(keys.IDENTITY, records.dump_identity(cfg)):
            return cfg
    existing = catalog.read_identity(storage)
    existing.check_same_store(cfg, storage.url)
    return existing
