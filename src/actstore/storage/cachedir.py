"""The on-disk part of CachedStorage: entry files in a cache directory shared by any
number of processes, their integrity checks, and least-recently-used eviction.

Layout, under the cache directory:

    <ns>/<xx>/<digest>                         one entry: a 32-byte header, then the bytes
    <ns>/<xx>/.<digest>.tmp-<pid>-<random>     an entry being written (renamed into place)
    .evict.lock                                flock'd by the one process scanning/evicting

`ns` is a 64-bit blake2b of the namespace, `digest` a 160-bit blake2b of (kind, key from
the store root, offset, length), `xx` its first two digits. Header: magic b"ACTCACHE",
version u32, crc32c u32 of the bytes, byte count u64, 8 zero bytes. An entry whose header,
length or crc does not add up is deleted (the caller refetches). Entries are written to a
temporary file and renamed into place, so a reader sees a whole entry or none.

Eviction: an entry's mtime is its last use (set at write and on every hit). When this
process's count of the directory's bytes (its last scan plus what it wrote since) passes
max_bytes, or it has written RESCAN_FRACTION of max_bytes since its last scan (other
processes write too), it scans the directory (every namespace) and deletes least recently
used entries until LOW_WATER of max_bytes remain. Used by one process (any number of
threads), the directory is within max_bytes whenever no call is under way; P processes
sharing it can exceed it by what they wrote since their last scans: at most about
P * (RESCAN_FRACTION * max_bytes + the largest entry). Deleting an entry never breaks a
reader (an open file survives its unlink; a missing one is a miss) nor a writer
(temporary files are left alone unless older than STALE_TMP_S: a crashed writer's).
Files of other names are never touched.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from actstore.layout.checksum import crc32c
from actstore.storage.files import atomic_write, write_new

__all__ = ["HEADER", "LOW_WATER", "RESCAN_FRACTION", "STAT_NAMES", "CacheDir"]

HEADER = struct.Struct("<8sIIQ8x")  # magic, version, crc32c, byte count, reserved
MAGIC = b"ACTCACHE"
VERSION = 1
LOW_WATER = 0.875  # an eviction leaves at most this fraction of max_bytes
RESCAN_FRACTION = 0.125  # rescan after writing this fraction of max_bytes (others write too)
STALE_TMP_S = 3600  # a temporary file this old belongs to a crashed writer
LOCK_NAME = ".evict.lock"
STAT_NAMES = (
    "hits",
    "misses",
    "hit_bytes",
    "miss_bytes",
    "written",
    "written_bytes",
    "skipped",
    "evicted",
    "evicted_bytes",
    "damaged",
    "errors",
)

_NS_RE = re.compile(r"[0-9a-f]{16}")
_SUB_RE = re.compile(r"[0-9a-f]{2}")
_ENTRY_RE = re.compile(r"[0-9a-f]{40}")
_TMP_RE = re.compile(r"\.[0-9a-f]{40}\.tmp-\d+-[0-9a-f]{8}")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class CacheDir:
    """The entries of one namespace in a cache directory, as one process sees them: entry
    files, this process's count of the directory's bytes, and its statistics. Shared by a
    CachedStorage and its children; pickles as its location only.

    Args:
        root: the cache directory (created on first write).
        max_bytes: the directory's size limit (entry files, headers included).
        namespace: any string; entries of other namespaces are never read.
    """

    def __init__(self, root: Path, max_bytes: int, namespace: str):
        self.root = root
        self.max_bytes = max_bytes
        self.ns_dir = f"{root}/{hashlib.blake2b(namespace.encode('utf-8', 'surrogatepass'), digest_size=8).hexdigest()}"
        self._init_process_state()

    def _init_process_state(self) -> None:
        self.lock = threading.Lock()
        self.evicting = threading.Lock()
        self.counts = dict.fromkeys(STAT_NAMES, 0)
        self.known_bytes: int | None = None  # bytes in the directory, at least: last scan + own writes since
        self.since_scan = 0  # bytes this process wrote since its last scan began
        self.written_total = 0
        self.scans = 0  # scans begun by this process
        self.made_dirs: set[str] = set()

    def __getstate__(self) -> dict:
        return {"root": self.root, "max_bytes": self.max_bytes, "ns_dir": self.ns_dir}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_process_state()  # a new process counts its own use and scans afresh

    def stats(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)

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
        folder = path.rsplit("/", 1)[0]
        try:
            if folder not in self.made_dirs:
                os.makedirs(folder, exist_ok=True)
                self.made_dirs.add(folder)
            atomic_write(path, lambda tmp: _write_entry(tmp, view))
        except OSError:  # (atomic_write removed its temporary file)
            self.count(errors=1)
            return
        with self.lock:
            self.counts["written"] += 1
            self.counts["written_bytes"] += size
            self.written_total += size
            self.since_scan += size
            if self.known_bytes is not None:
                self.known_bytes += size
            due = (
                self.known_bytes is None
                or self.known_bytes > self.max_bytes
                or self.since_scan > self.max_bytes * RESCAN_FRACTION
            )
            ticket = self.scans
        if due:
            self.evict(ticket)

    # ---- eviction -----------------------------------------------------------------
    def evict(self, ticket: int | None = None) -> None:
        """Scan the directory; when it holds more than max_bytes, delete least recently
        used entries (every namespace) down to LOW_WATER of it. One scan at a time: one
        thread per process, one process per directory (a flock). `ticket`: the count of
        scans begun when the caller's entry was in place; a scan begun since saw it."""
        with self.evicting:
            with self.lock:
                if ticket is not None and self.scans > ticket:
                    return
                self.scans += 1
                base = self.written_total
            try:
                os.makedirs(self.root, exist_ok=True)
                lock_fd = os.open(f"{self.root}/{LOCK_NAME}", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    with contextlib.suppress(OSError):  # a file system without flock: evict unlocked
                        fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    entries = list(self._scan())
                    total = sum(size for _, size, _ in entries)
                    if total > self.max_bytes:
                        total = self._delete_oldest(entries, total, int(self.max_bytes * LOW_WATER))
                finally:
                    os.close(lock_fd)  # releases the flock
            except OSError:
                self.count(errors=1)
                return
            with self.lock:  # writes during the scan may or may not be in `total`: count them
                extra = self.written_total - base
                self.known_bytes, self.since_scan = total + extra, extra

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


def _write_entry(path: Path, view: memoryview) -> None:
    """A new entry file: its header and bytes, its mtime set to now (its first use: the
    file system's own timestamp may be coarser than the clock eviction compares)."""
    write_new(path, HEADER.pack(MAGIC, VERSION, crc32c(view), view.nbytes), view)
    now = time.time_ns()
    os.utime(path, ns=(now, now))
