"""zarr-python's LocalStore as writers use it: every write atomic, every read of a regular
file only, nothing written or deleted through a symbolic link inside the store."""

from __future__ import annotations

import asyncio
import os
from typing import Any

_CLASS = None


def atomic_local_store(root: str, *, top: str, storage_class: type) -> Any:
    """A writable zarr store over the folder `root` of the store rooted at `top`; its
    writes go through `storage_class` (LocalStorage) puts."""
    store = _store_class(storage_class)(root, read_only=False)
    store.actstore_top = top
    return store


def _store_class(storage_class: type) -> type:
    """The class, built on first use (zarr imports slowly)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from zarr.storage import LocalStore

    from actstore.storage.regular import check_no_links, open_regular

    class AtomicLocalStore(LocalStore):
        """A LocalStore whose every write goes to a temporary file renamed into place.

        zarr-python 3.1's LocalStore writes in place: a crash mid-write would leave a
        half-written `.zarray` or per-sample chunk. Here no reader ever sees one. Reads
        refuse FIFOs, folders and links where a file belongs (a FIFO would block forever).
        """

        actstore_top: str = ""

        def _storage(self) -> Any:
            return storage_class(self.root, top=self.actstore_top or str(self.root))

        async def set(self, key: str, value: Any) -> None:  # noqa: D102
            if not self._is_open:
                await self._open()
            self._check_writable()
            data = value.to_bytes()
            await asyncio.to_thread(self._storage().put, key, data)

        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:  # noqa: D102
            path = os.path.join(str(self.root), key)
            try:
                os.close(open_regular(path))
            except FileNotFoundError:
                return None
            return await super().get(key, prototype, byte_range)

        async def delete(self, key: str) -> None:  # noqa: D102
            path = os.path.join(str(self.root), key)
            check_no_links(self.actstore_top or str(self.root), os.path.dirname(path))
            await super().delete(key)

    _CLASS = AtomicLocalStore
    return _CLASS
