"""A read-only zarr store over any Storage, so zarr-python's reads take the Storage's
path (e.g. a CachedStorage's cache, a local store's regular-files-only reads) instead of
going to the bytes' home directly. Zarr metadata documents are checked against the size
and depth limits of actstore.layout.jsonio before zarr-python parses them (its own JSON
parsing recurses without bound)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from actstore.errors import CorruptStoreError
from actstore.layout import jsonio, keys
from actstore.storage.base import Storage

_CLASS = None


def StorageZarrStore(storage: Storage) -> Any:  # noqa: N802 - a class built on first use
    """A read-only zarr.abc.store.Store whose keys are `storage`'s keys."""
    return _store_class()(storage)


def _store_class() -> type:
    """The zarr Store class (built on first use: zarr imports slowly)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest

    class _StorageZarrStore(Store):
        supports_writes = False
        supports_deletes = False
        supports_listing = True

        def __init__(self, storage: Storage):
            super().__init__(read_only=True)
            self.storage = storage

        def __eq__(self, other: object) -> bool:
            return isinstance(other, _StorageZarrStore) and other.storage is self.storage

        __hash__ = object.__hash__

        def __repr__(self) -> str:
            return f"StorageZarrStore({self.storage!r})"

        def _read(self, key: str, byte_range: Any) -> bytes | None:
            s = self.storage
            try:
                if byte_range is None:
                    data = s.get(key)
                    if keys.basename(key) in keys.ZARR_NAMES:
                        _check_json(data, s.where(key))
                    return data
                if isinstance(byte_range, RangeByteRequest):
                    return s.get_range(key, byte_range.start, byte_range.end - byte_range.start)
                size = s.size(key)
                if size is None:
                    return None
                if isinstance(byte_range, OffsetByteRequest):
                    return s.get_range(key, byte_range.offset, size - byte_range.offset)
                if isinstance(byte_range, SuffixByteRequest):
                    start = max(size - byte_range.suffix, 0)
                    return s.get_range(key, start, size - start)
            except FileNotFoundError:
                return None
            raise ValueError(f"Unexpected byte_range, got {byte_range}")

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            data = await asyncio.to_thread(self._read, key, byte_range)
            return None if data is None else prototype.buffer.from_bytes(data)

        async def get_partial_values(self, prototype: Any, key_ranges: Iterable[tuple[str, Any]]) -> list[Any]:
            return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

        async def exists(self, key: str) -> bool:
            return await asyncio.to_thread(self.storage.exists, key)

        async def set(self, key: str, value: Any) -> None:
            self._check_writable()

        async def delete(self, key: str) -> None:
            self._check_writable()

        async def list(self) -> AsyncIterator[str]:
            for e in await asyncio.to_thread(lambda: [*self.storage.list("")]):
                yield e.key

        async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
            folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
            for e in await asyncio.to_thread(lambda: [*self.storage.list(folder)]):
                if e.key.startswith(prefix):
                    yield e.key

        async def list_dir(self, prefix: str) -> AsyncIterator[str]:
            for name in await asyncio.to_thread(self.storage.list_dir, prefix.rstrip("/")):
                yield name

        async def getsize(self, key: str) -> int:
            size = await asyncio.to_thread(self.storage.size, key)
            if size is None:
                raise FileNotFoundError(key)
            return size

    _CLASS = _StorageZarrStore
    return _CLASS


def _check_json(data: bytes, where: str) -> None:
    """Refuse a metadata document that is not bounded JSON before zarr-python parses it."""
    try:
        jsonio.parse(data)
    except ValueError as e:
        raise CorruptStoreError(
            f"Zarr metadata {where} is not valid JSON ({e}); the store is damaged (run `actstore verify`)"
        ) from None
