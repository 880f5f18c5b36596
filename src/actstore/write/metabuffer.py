"""A writer shard's Zarr metadata held in memory and written out once per commit.

zarr-python writes an array's or group's metadata document every time it changes (each
resize, each attribute update) and re-puts the parent groups' documents when it creates an
array: on an object store a one-commit shard cost dozens of PUTs of the same `.zgroup`,
`.zattrs` and `zarr.json`, and a GET or HEAD before most of them. The writer holds its
shard exclusively (its lease), so no one else changes these documents: the writer's zarr
store keeps them in memory (read from storage at most once each) and `flush()` puts each
document whose bytes changed since it was last written, whole and atomically, before the
commit record that makes them part of the shard. Chunk objects go straight through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from actstore.layout import keys
from actstore.storage import KeyNotFound, Storage

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

_CLASS = None


def is_metadata(key: str) -> bool:
    """Whether `key` is a Zarr metadata document (zarr.json, .zarray, .zattrs, .zgroup, .zmetadata)."""
    return keys.basename(key) in keys.ZARR_NAMES


def MetaBufferStore(zarr_store: ZarrStore, storage: Storage, *, empty: bool) -> Any:  # noqa: N802 - a class built on first use
    """`zarr_store` (the shard's writable zarr store, keys relative to the shard) with its
    metadata documents buffered; `storage` (the same keys) is where `flush` puts them.
    `empty`: the shard holds no metadata yet (just claimed), so nothing is read to find out,
    and listings name the buffered documents only."""
    return _store_class()(zarr_store, storage, empty)


def _store_class() -> type:
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from zarr.storage import WrapperStore

    class _MetaBufferStore(WrapperStore):
        def __init__(self, zarr_store: ZarrStore, storage: Storage, empty: bool):
            super().__init__(zarr_store)
            self.storage = storage
            self.empty = empty
            self.docs: dict[str, bytes | None] = {}  # key -> bytes now (None: absent)
            self.written: dict[str, bytes | None] = {}  # key -> bytes on storage, where known

        def _doc(self, key: str) -> bytes | None:
            if key not in self.docs:
                data: bytes | None = None
                if not self.empty:
                    try:
                        data = self.storage.get(key)
                    except KeyNotFound:
                        data = None
                self.docs[key] = self.written[key] = data
            return self.docs[key]

        def read(self, key: str) -> bytes:
            """A metadata document as the shard has it now (written out or not)."""
            data = self._doc(key)
            if data is None:
                raise KeyNotFound(self.storage.where(key))
            return data

        def flush(self) -> int:
            """Put every document changed since it was last written; returns their count."""
            n = 0
            for key, data in self.docs.items():
                if data == self.written.get(key):
                    continue
                if data is None:
                    self.storage.delete(key)
                else:
                    self.storage.put(key, data)
                self.written[key] = data
                n += 1
            return n

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if not is_metadata(key):
                return await self._store.get(key, prototype, byte_range)
            data = self._doc(key)
            if data is None:
                return None
            if byte_range is not None:  # zarr reads metadata whole; ranges are served all the same
                from zarr.abc.store import RangeByteRequest

                if not isinstance(byte_range, RangeByteRequest):
                    raise ValueError(f"unexpected byte range {byte_range!r} of the metadata document {key}")
                data = data[byte_range.start : byte_range.end]
            return prototype.buffer.from_bytes(data)

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any]:
            return [await self.get(k, prototype, r) for k, r in key_ranges]

        async def exists(self, key: str) -> bool:
            if is_metadata(key):
                return self._doc(key) is not None
            return await self._store.exists(key)

        async def set(self, key: str, value: Any) -> None:
            if is_metadata(key):
                self._doc(key)
                self.docs[key] = value.to_bytes()
                return
            await self._store.set(key, value)
            self.storage.mark_written(key)  # (a durable commit syncs it: Storage.sync_written)

        async def set_if_not_exists(self, key: str, value: Any) -> None:
            if is_metadata(key):
                if self._doc(key) is None:
                    self.docs[key] = value.to_bytes()
                return
            await self._store.set_if_not_exists(key, value)

        async def delete(self, key: str) -> None:
            if is_metadata(key):
                self._doc(key)
                self.docs[key] = None
                return
            await self._store.delete(key)

        async def list(self) -> AsyncIterator[str]:
            async for k in self.list_prefix(""):
                yield k

        async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
            # A shard created by this writer holds no metadata but the buffered documents:
            # zarr lists only to find a group's members (consolidation), so the store's
            # listing (chunk objects, requests on an object store) is not needed.
            if not self.empty:
                async for k in self._store.list_prefix(prefix):
                    if k not in self.docs:  # a buffered document is listed below, as it is now
                        yield k
            for k in sorted(k for k, v in self.docs.items() if v is not None and k.startswith(prefix)):
                yield k

        async def list_dir(self, prefix: str) -> AsyncIterator[str]:
            head = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
            names = set()
            async for k in self.list_prefix(head):
                names.add(k[len(head) :].split("/", 1)[0])
            for name in sorted(names):
                yield name

    _CLASS = _MetaBufferStore
    return _CLASS
