"""The store's identity claimed by the first writer, checked by every later one."""

from __future__ import annotations

from actstore import catalog
from actstore.errors import StoreMismatchError
from actstore.layout import keys, records
from actstore.layout.config import StoreConfig
from actstore.layout.spool import SPOOL_DIR
from actstore.storage import Storage


def claim_store(storage: Storage, cfg: StoreConfig) -> bool:
    """Create the store's identity record (create-only), or check that the existing store
    has `cfg`; returns whether the store holds a spool folder (the same listing tells, so a
    writer of a store that is no spool asks nothing more about one)."""
    names = storage.list_dir()  # one listing answers all: is it a store, is it empty, is it a spool (no HEAD first)
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
            return SPOOL_DIR in names
    catalog.read_identity(storage).check_same_store(cfg, storage.url)
    return SPOOL_DIR in names
