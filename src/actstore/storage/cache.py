"""CachedStorage: a local, size-bounded cache in front of a finalized store's Storage, so a
second epoch over a store in object storage reads from local disk.

Only keys the caller's `cacheable` predicate admits are cached (data objects: chunk files,
Zarr shard files, per-sample chunks, texts; never mutable records such as the commit
record or the manifest); everything else passes to the inner Storage. Granularity: whole
objects (`get`, `read_object_into`), byte ranges (`get_range`, `read_into`: one entry per
(key, offset, length); a format-3 Zarr shard file is read one chunk range at a time) and
object sizes (`size`). The namespace (the reader passes a hash of the store URL and its
manifest) keeps one store generation from ever seeing another's bytes. The directory
layout, integrity checks and eviction are in actstore/storage/cachedir.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from actstore.errors import ReadOnlyCacheError
from actstore.storage.base import Entry, Storage, Writeback
from actstore.storage.cachedir import CacheDir

__all__ = ["CachedStorage", "ReadOnlyCacheError"]


class CachedStorage(Storage):
    """A read-only Storage that keeps data objects of `inner` in a local cache directory.

    Args:
        inner: the store's Storage (any implementation; usually an ObjectStorage).
        cache_dir: the cache directory (created on first write); processes may share it.
        max_bytes: the directory's size limit in bytes (entry files, headers included);
            least recently used entries go first. An object larger is never cached.
        namespace: separates stores and store generations sharing `cache_dir` (e.g. a hash
            of the store URL and its manifest's bytes); entries of another namespace are
            never served, and age out by least recent use.
        cacheable: which keys to cache, called with the key relative to the store root
            (also for reads through `child`). Must pickle (a module-level function or a
            functools.partial) for DataLoader workers. Admit only immutable objects.

    `read_cached` answers from the cache only, never from `inner`. Writes raise
    ReadOnlyCacheError. `stats()` counts this process's use of the cache.
    """

    def __init__(
        self,
        inner: Storage,
        cache_dir: str | os.PathLike,
        *,
        max_bytes: int,
        namespace: str,
        cacheable: Callable[[str], bool],
    ):
        if not isinstance(inner, Storage):
            raise TypeError(f"inner must be a Storage. Got {type(inner).__name__}.")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive number of bytes. Got {max_bytes!r}.")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty string. Got {namespace!r}.")
        if not callable(cacheable):
            raise TypeError(f"cacheable must be a callable taking a key. Got {cacheable!r}.")
        self._setup(inner, CacheDir(Path(cache_dir), max_bytes, namespace), "", cacheable)

    def _setup(self, inner: Storage, cache: CacheDir, prefix: str, cacheable: Callable[[str], bool]) -> None:
        self.inner = inner
        self.url = inner.url
        self.local_root = None  # every byte goes through this object, so the cache sees it
        self.cacheable = cacheable
        self._cache = cache
        self._prefix = prefix  # this child's folder, from the store root, with a trailing '/'

    def __repr__(self) -> str:
        return f"CachedStorage({self.inner!r}, {str(self._cache.root)!r}, max_bytes={self._cache.max_bytes})"

    keeps_ranges = True

    @property
    def coalesce_bytes(self) -> int:  # type: ignore[override]
        return self.inner.coalesce_bytes

    @property
    def cache_dir(self) -> Path:
        return self._cache.root

    def stats(self) -> dict[str, int]:
        """This process's counts, for this storage and every child sharing its cache:
        hits, misses, hit_bytes, miss_bytes (fetched from inner), written, written_bytes,
        skipped (too large to cache), evicted, evicted_bytes, damaged (entries dropped),
        errors (cache writes or scans that failed; the reads still succeeded)."""
        return self._cache.stats()

    def where(self, key: str) -> str:
        return self.inner.where(key)

    def child(self, prefix: str) -> CachedStorage:
        """A CachedStorage over `inner.child(prefix)` sharing this one's cache (directory,
        namespace, budget, statistics); its keys are cached under `prefix/key`."""
        folder = prefix.strip("/")
        sub = object.__new__(CachedStorage)
        sub._setup(
            self.inner.child(prefix),
            self._cache,
            f"{self._prefix}{folder}/" if folder else self._prefix,
            self.cacheable,
        )
        return sub

    def _entry(self, kind: str, key: str, offset: int = 0, length: int = 0) -> str | None:
        """The entry file of `key`, or None when the key is not cacheable."""
        full = self._prefix + key
        return self._cache.path(kind, full, offset, length) if self.cacheable(full) else None

    def _missed(self, path: str, data: Any, n: int) -> None:
        self._cache.count(misses=1, miss_bytes=n)
        self._cache.store(path, data)

    # ---- reads ----------------------------------------------------------------------
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        path = self._entry("object", key)
        if path is None:
            return self.inner.get(key, max_bytes=max_bytes)
        data = self._cache.load(path)
        if data is None:
            data = self.inner.get(key, max_bytes=max_bytes)
            self._missed(path, data, len(data))
        elif max_bytes is not None and len(data) > max_bytes:
            raise ValueError(f"{self.where(key)} has {len(data)} bytes, more than the {max_bytes} allowed for it")
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._entry("range", key, start, length) if length > 0 else None
        if path is None:
            return self.inner.get_range(key, start, length)
        data = self._cache.load(path)
        if data is None:
            data = self.inner.get_range(key, start, length)
            self._missed(path, data, len(data))
        return data

    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> int:
        path = self._entry("range", key, offset, len(dest)) if len(dest) else None
        if path is None:
            return self.inner.read_into(key, dest, offset)
        n = self._cache.load_into(path, dest)
        if n is None or n > len(dest):  # (an entry never holds more than its range)
            n = self.inner.read_into(key, dest, offset)
            self._missed(path, dest[:n], n)
        return n

    def read_ranges_into(self, key: str, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Each range from its own entry (as read_into keeps them); the misses are fetched
        from `inner` together (one batched request on an object store), then kept."""
        counts: list[int | None] = [None] * len(ranges)
        missed: list[tuple[int, str | None]] = []
        for i, (offset, dest) in enumerate(ranges):
            path = self._entry("range", key, offset, len(dest)) if len(dest) else None
            n = self._cache.load_into(path, dest) if path is not None else None
            if n is not None and n <= len(dest):
                counts[i] = n
            else:
                missed.append((i, path))
        if missed:
            got = self.inner.read_ranges_into(key, [ranges[i] for i, _ in missed])
            for (i, path), n in zip(missed, got):
                counts[i] = n
                if path is not None:
                    self._missed(path, ranges[i][1][:n], n)
        return [int(n) for n in counts]

    def read_object_into(self, key: str, dest: memoryview) -> int | None:
        path = self._entry("object", key)
        if path is None:
            return self.inner.read_object_into(key, dest)
        size = self._cache.load_into(path, dest)
        if size is None:
            size = self.inner.read_object_into(key, dest)
            if size is not None and size <= len(dest):  # dest holds the whole object
                self._missed(path, dest[:size], size)
        return size

    def read_cached(self, key: str, dest: memoryview, offset: int = 0) -> bool:
        """True when `dest` was filled from the cache: a range entry of exactly (offset,
        len(dest)), or at offset 0 a whole object of exactly len(dest) bytes (as
        LocalStorage: an object of another size goes to the read that reports it).
        Never asks `inner`; a key that is not cacheable answers False."""
        path = self._entry("range", key, offset, len(dest)) if len(dest) else None
        if path is None:
            return False
        if self._cache.load_into(path, dest, exact=True) is not None:
            return True
        return offset == 0 and self._cache.load_into(self._entry("object", key), dest, exact=True) is not None

    def size(self, key: str) -> int | None:
        path = self._entry("size", key)
        if path is None:
            return self.inner.size(key)
        data = self._cache.load(path)
        if data is not None and len(data) == 8:
            return int.from_bytes(data, "little")
        size = self.inner.size(key)
        if size is not None:  # a missing object is not cached: a finalized store may name it
            self._missed(path, size.to_bytes(8, "little"), 0)
        return size

    def kind(self, key: str) -> str | None:
        path = self._entry("size", key)
        if path is not None and self._cache.load(path) is not None:
            return "file"
        return self.inner.kind(key)

    def list(self, prefix: str = "") -> Iterator[Entry]:
        return self.inner.list(prefix)

    def list_dir(self, prefix: str = "") -> list[str]:
        return self.inner.list_dir(prefix)

    def stored_bytes(self, prefix: str = "") -> int:
        return self.inner.stored_bytes(prefix)

    # ---- writes: refused ------------------------------------------------------------
    def _refuse(self, what: str, key: str) -> ReadOnlyCacheError:
        return ReadOnlyCacheError(
            f"cannot {what} {self.where(key)}: this is a read cache (CachedStorage) of a finalized store; "
            "write through the store's own storage (open_storage(url)), then open a new cache"
        )

    def put(
        self, key: str, *parts: Any, atomic: bool = True, durable: bool = False, writeback: Writeback | None = None
    ) -> None:
        raise self._refuse("put", key)

    def put_stream(self, key: str, parts: Iterator[bytes]) -> None:
        raise self._refuse("put", key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        raise self._refuse("create", key)

    def append(self, key: str, data: bytes) -> int:
        raise self._refuse("append to", key)

    def truncate(self, key: str, size: int) -> None:
        raise self._refuse("truncate", key)

    def delete(self, key: str) -> None:
        raise self._refuse("delete", key)

    def delete_prefix(self, prefix: str) -> None:
        raise self._refuse("delete", prefix)

    def sync(self, prefix: str = "") -> None:
        """Nothing was written through a cache: nothing to make durable."""

    def check_access(self, *, write: bool) -> None:
        if write:
            raise self._refuse("write to", "")
        self.inner.check_access(write=False)

    def zarr_store(self, prefix: str, *, read_only: bool) -> Any:
        """A read-only zarr store whose reads go through this cache."""
        if not read_only:
            raise self._refuse("open zarr for writing at", prefix)
        from actstore.storage.zarrview import StorageZarrStore

        return StorageZarrStore(self.child(prefix) if prefix.strip("/") else self)
