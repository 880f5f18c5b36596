"""CachedStorage: a local, size-bounded cache in front of a finalized store's Storage, so a
second epoch over a store in object storage reads from local disk.

Only keys the caller's `cacheable` predicate admits are cached (data objects: chunk files,
Zarr shard files, per-sample chunks, texts; never mutable records); everything else passes
to the inner Storage. Granularity: whole objects (`get`, `read_object_into`), byte ranges
(`get_range`, `read_into`: one entry per (key, offset, length)) and object sizes (`size`).

On disk, under `cache_dir` (shared by any number of processes and namespaces):

    <ns>/<xx>/<digest>                         one entry: a 32-byte header, then the bytes
    <ns>/<xx>/.<digest>.tmp-<pid>-<random>     an entry being written (renamed into place)
    .evict.lock                                flock'd by the one process evicting

`ns` is a 64-bit blake2b of the namespace (the reader passes a hash of the store URL and
its manifest, so one store generation never sees another's bytes); `digest` is a 160-bit
blake2b of (kind, key from the store root, offset, length); `xx` its first two digits.
Header: magic b"ACTCACHE", version u32, crc32c u32 of the bytes, byte count u64, 8 zero
bytes. An entry whose header, length or crc does not add up is deleted and refetched.

Eviction: an entry's mtime is its last use (set at write and on every hit). When this
process's count of the directory's bytes (its last scan plus what it wrote since) passes
`max_bytes`, or it has written RESCAN_FRACTION of `max_bytes` since its last scan (other
processes write too), it scans the directory and deletes least recently used entries
until LOW_WATER of `max_bytes` remain. One process alone never exceeds `max_bytes`
after a call returns; P processes sharing the directory can exceed it by at most about
P * (RESCAN_FRACTION * max_bytes + their largest entry). Deleting an entry never breaks a
reader (an open file survives its unlink; a missing one is a miss) nor a writer
(temporary files are left alone unless older than STALE_TMP_S: a crashed writer's).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from actstore.errors import ActstoreError
from actstore.layout.checksum import crc32c
from actstore.storage.base import Entry, Storage, Writeback

__all__ = ["CachedStorage", "ReadOnlyCacheError"]

HEADER = struct.Struct("<8sIIQ8x")  # magic, version, crc32c, byte count, reserved
MAGIC = b"ACTCACHE"
VERSION = 1
LOW_WATER = 0.875  # an eviction leaves at most this fraction of max_bytes
RESCAN_FRACTION = 0.125  # rescan after writing this fraction of max_bytes (others write too)
STALE_TMP_S = 3600  # a temporary file this old belongs to a crashed writer
LOCK_NAME = ".evict.lock"
STAT_NAMES = ("hits", "misses", "hit_bytes", "miss_bytes", "written", "written_bytes", "skipped",
              "evicted", "evicted_bytes", "damaged", "errors")

_NS_RE = re.compile(r"[0-9a-f]{16}")
_SUB_RE = re.compile(r"[0-9a-f]{2}")
_ENTRY_RE = re.compile(r"[0-9a-f]{40}")
_TMP_RE = re.compile(r"\.[0-9a-f]{40}\.tmp-\d+-[0-9a-f]{8}")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class ReadOnlyCacheError(ActstoreError, PermissionError):
    """A write through a CachedStorage (a cache reads a finalized store, never writes it)."""


class _Cache:
    """The cache directory of one namespace, shared by a CachedStorage and its children:
    entry files, this process's count of the directory's bytes, and the statistics."""

    def __init__(self, root: Path, max_bytes: int, namespace: str):
        self.root = root
        self.max_bytes = max_bytes
        self.ns_dir = f"{root}/{hashlib.blake2b(namespace.encode('utf-8', 'surrogatepass'), digest_size=8).hexdigest()}"
        self._init_process_state()

    def _init_process_state(self) -> None:
        self.lock = threading.Lock()
        self.evicting = threading.Lock()
        self.counts = dict.fromkeys(STAT_NAMES, 0)
        self.known_bytes: int | None = None  # bytes in the directory: last scan + own writes since
        self.since_scan = 0
        self.made_dirs: set[str] = set()

    def __getstate__(self) -> dict:
        return {"root": self.root, "max_bytes": self.max_bytes, "ns_dir": self.ns_dir}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_process_state()  # a new process counts its own use and scans afresh

    def count(self, **inc: int) -> None:
        with self.lock:
            for name, n in inc.items():
                self.counts[name] += n

    def path(self, kind: str, key: str, offset: int = 0, length: int = 0) -> str:
        """The entry file of (kind, key from the store root, offset, length)."""
        ident = f"{kind}\0{key}\0{offset}\0{length}".encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(ident, digest_size=20).hexdigest()
        return f"{self.ns_dir}/{digest[:2]}/{digest}"

    # ---- lookups ------------------------------------------------------------------
    def _open(self, path: str) -> tuple[int, int, int] | None:
        """(fd, byte count, crc) of an entry whose header and length add up; None when
        there is none (a damaged one is dropped)."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, HEADER.size, 0) if stat.S_ISREG(st.st_mode) else b""
            if len(head) == HEADER.size:
                magic, version, crc, n = HEADER.unpack(head)
                if magic == MAGIC and version == VERSION and st.st_size == HEADER.size + n:
                    return fd, n, crc
        except OSError:
            pass
        self._drop(path, fd)
        os.close(fd)
        return None

    def _drop(self, path: str, fd: int) -> None:
        """Delete the damaged entry open at `fd`, unless another process has just renamed
        a fresh one into its place."""
        self.count(damaged=1)
        with contextlib.suppress(OSError):
            a, b = os.fstat(fd), os.lstat(path)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                os.unlink(path)

    def _hit(self, fd: int, n: int) -> None:
        now = time.time_ns()
        with contextlib.suppress(OSError):  # the last use, for eviction
            os.utime(fd, ns=(now, now))
        self.count(hits=1, hit_bytes=n)

    def load(self, path: str) -> bytes | None:
        """An entry's bytes, or None (missing or damaged)."""
        found = self._open(path)
        if found is None:
            return None
        fd, n, crc = found
        try:
            data = os.pread(fd, n, HEADER.size)
            if len(data) == n and crc32c(data) == crc:
                self._hit(fd, n)
                return data
            self._drop(path, fd)
            return None
        finally:
            os.close(fd)

    def load_into(self, path: str, dest: memoryview, *, exact: bool = False) -> int | None:
        """Copy an entry's bytes into `dest` (its start when the entry is longer); return
        the entry's byte count, or None (missing, damaged, or with `exact` not len(dest))."""
        found = self._open(path)
        if found is None:
            return None
        fd, n, crc = found
        try:
            if exact and n != len(dest):
                return None  # not damage: the caller's read path explains a wrong size
            if n <= len(dest):
                got = os.preadv(fd, [dest[:n]], HEADER.size)  # the one copy: page cache -> dest
                ok = got == n and crc32c(dest[:n]) == crc
            else:
                data = os.pread(fd, n, HEADER.size)
                ok = len(data) == n and crc32c(data) == crc
                if ok:
                    dest[:] = memoryview(data)[: len(dest)]
            if ok:
                self._hit(fd, n)
                return n
            self._drop(path, fd)
            return None
        finally:
            os.close(fd)

    # ---- stores -------------------------------------------------------------------
    def store(self, path: str, data: Any) -> None:
        """Write an entry atomically (temporary file, rename). A failure (disk full, no
        permission) is counted, never raised: the caller already has its bytes."""
        view = memoryview(data).cast("B")
        size = HEADER.size + view.nbytes
        if size > self.max_bytes:
            self.count(skipped=1)
            return
        folder, name = path.rsplit("/", 1)
        tmp = f"{folder}/.{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            if folder not in self.made_dirs:
                os.makedirs(folder, exist_ok=True)
                self.made_dirs.add(folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
            try:
                for part in (HEADER.pack(MAGIC, VERSION, crc32c(view), view.nbytes), view):
                    part = memoryview(part)
                    while part.nbytes:
                        part = part[os.write(fd, part):]
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            self.count(errors=1)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        with self.lock:
            self.counts["written"] += 1
            self.counts["written_bytes"] += size
            self.since_scan += size
            if self.known_bytes is not None:
                self.known_bytes += size
            due = (self.known_bytes is None or self.known_bytes > self.max_bytes
                   or self.since_scan > self.max_bytes * RESCAN_FRACTION)
        if due:
            self.evict()

    # ---- eviction -----------------------------------------------------------------
    def evict(self) -> None:
        """Scan the directory; when it holds more than max_bytes, delete least recently
        used entries (every namespace) down to LOW_WATER of it. One process at a time (a
        flock); within a process one thread, the others go on (their next write checks)."""
        if not self.evicting.acquire(blocking=False):
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            lock_fd = os.open(f"{self.root}/{LOCK_NAME}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # one process scans at a time, each a fresh view
                entries = list(self._scan())
                total = sum(size for _, size, _ in entries)
                if total > self.max_bytes:
                    total = self._delete_oldest(entries, total, int(self.max_bytes * LOW_WATER))
                with self.lock:
                    self.known_bytes, self.since_scan = total, 0
            finally:
                os.close(lock_fd)  # releases the flock
        except OSError:
            self.count(errors=1)
        finally:
            self.evicting.release()

    def _delete_oldest(self, entries: list[tuple[int, int, str]], total: int, target: int) -> int:
        entries.sort()  # oldest use first
        for _, size, path in entries:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):  # gone already: another evictor
                os.unlink(path)
                self.count(evicted=1, evicted_bytes=size)
            total -= size
        return total

    def _scan(self) -> Iterator[tuple[int, int, str]]:
        """(mtime_ns, size, path) of every entry of every namespace; removes temporary
        files of crashed writers. Files of other names are never touched."""
        stale = time.time_ns() - STALE_TMP_S * 10**9
        for ns in _dirs(str(self.root), _NS_RE):
            for sub in _dirs(ns, _SUB_RE):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(sub) as it:
                    for f in it:
                        try:
                            st = f.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if _ENTRY_RE.fullmatch(f.name) and stat.S_ISREG(st.st_mode):
                            yield st.st_mtime_ns, st.st_size, f.path
                        elif _TMP_RE.fullmatch(f.name) and st.st_mtime_ns < stale:
                            with contextlib.suppress(OSError):
                                os.unlink(f.path)


def _dirs(folder: str, pattern: re.Pattern) -> list[str]:
    """The sub-folders of `folder` whose names match `pattern` (links are not followed)."""
    try:
        with os.scandir(folder) as it:
            return [e.path for e in it if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


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

    def __init__(self, inner: Storage, cache_dir: str | os.PathLike, *, max_bytes: int, namespace: str,
                 cacheable: Callable[[str], bool]):
        if not isinstance(inner, Storage):
            raise TypeError(f"inner must be a Storage. Got {type(inner).__name__}.")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive number of bytes. Got {max_bytes!r}.")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty string. Got {namespace!r}.")
        if not callable(cacheable):
            raise TypeError(f"cacheable must be a callable taking a key. Got {cacheable!r}.")
        self._setup(inner, _Cache(Path(cache_dir), max_bytes, namespace), "", cacheable)

    def _setup(self, inner: Storage, cache: _Cache, prefix: str, cacheable: Callable[[str], bool]) -> None:
        self.inner = inner
        self.url = inner.url
        self.local_root = None  # every byte goes through this object, so the cache sees it
        self.cacheable = cacheable
        self._cache = cache
        self._prefix = prefix  # this child's folder, from the store root, with a trailing '/'

    def __repr__(self) -> str:
        return f"CachedStorage({self.inner!r}, {str(self._cache.root)!r}, max_bytes={self._cache.max_bytes})"

    @property
    def cache_dir(self) -> Path:
        return self._cache.root

    def stats(self) -> dict[str, int]:
        """This process's counts, for this storage and every child sharing its cache:
        hits, misses, hit_bytes, miss_bytes (fetched from inner), written, written_bytes,
        skipped (too large to cache), evicted, evicted_bytes, damaged (entries dropped),
        errors (cache writes or scans that failed; the reads still succeeded)."""
        with self._cache.lock:
            return dict(self._cache.counts)

    def where(self, key: str) -> str:
        return self.inner.where(key)

    def child(self, prefix: str) -> CachedStorage:
        """A CachedStorage over `inner.child(prefix)` sharing this one's cache (directory,
        namespace, budget, statistics); its keys are cached under `prefix/key`."""
        sub = object.__new__(CachedStorage)
        sub._setup(self.inner.child(prefix), self._cache, f"{self._prefix}{prefix.strip('/')}/", self.cacheable)
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
        if n is None:
            n = self.inner.read_into(key, dest, offset)
            self._missed(path, dest[:n], n)
        return n

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

    def put(self, key: str, *parts: Any, atomic: bool = True, durable: bool = False,
            writeback: Writeback | None = None) -> None:
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
