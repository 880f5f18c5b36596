"""File operations of a local store: temporary names, directory fsync, syncfs, and the
thread that starts written files' writeback (Linux sync_file_range)."""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from actstore.storage.base import Writeback

__all__ = [
    "SYNC_FILE_RANGE_WRITE",
    "FileWriteback",
    "fsync_dir",
    "exchange_paths",
    "fsync_files",
    "sync_file_range",
    "syncfs",
    "tmp_name",
    "write_all",
]

SYNC_FILE_RANGE_WRITE = 2


def _load_libc_fn(name: str, argtypes: list) -> Any:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


sync_file_range = _load_libc_fn("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])
_syncfs = _load_libc_fn("syncfs", [ctypes.c_int])
_renameat2 = _load_libc_fn("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE): readers see one or the
    other, never neither. False where the C library, kernel or file system has no exchange
    (the caller renames in two steps); any other failure raises OSError naming `b`."""
    if _renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


# Buffers one os.writev takes (Linux IOV_MAX); more parts take more calls.
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


def write_all(fd: int, parts: Iterable[Any]) -> int:
    """Write the concatenation of `parts` (bytes-like, C-contiguous) at `fd`'s offset as one
    gathered write (os.writev, IOV_MAX parts a call), resumed where a short write stopped;
    nothing is copied. Returns the bytes written. os.write where there is no writev (Windows)."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    total = 0
    while views:
        n = os.writev(fd, views[:IOV_MAX]) if hasattr(os, "writev") else os.write(fd, views[0])
        total += n
        done = 0
        while done < len(views) and n >= views[done].nbytes:  # the parts written whole
            n -= views[done].nbytes
            done += 1
        views = views[done:]
        if n:  # a short write stopped inside this part
            views[0] = views[0][n:]
    return total


def tmp_name(path: Path) -> Path:
    """A hidden temporary name beside `path` (`.name.tmp-<pid>-<random>`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def syncfs(path: str | os.PathLike) -> None:
    """Flush every dirty page of the file system holding `path` (Linux syncfs, else sync)."""
    if _syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _syncfs(fd)
    finally:
        os.close(fd)


def fsync_files(paths: set[str], top: str, threads: int = 16, made: set[str] = frozenset()) -> None:
    """Make these files durable, with the folders that name them up to `top` (their new
    names) and the folders `made` since, all at once: the fsyncs run in parallel, so the
    file system commits them together (one journal commit for many; ext4 and xfs group
    concurrent fsyncs). Unlike syncfs, it waits for nothing another writer of the same disk
    wrote. A file deleted meanwhile is skipped."""
    from concurrent.futures import ThreadPoolExecutor

    top = top.rstrip("/")
    folders: set[str] = set()
    for p in [*paths, *(m + "/" for m in made)]:
        d = p.rsplit("/", 1)[0]
        while d.startswith(top) and d not in folders:
            folders.add(d)
            d = d.rsplit("/", 1)[0]

    def sync(path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    todo = sorted(paths) + sorted(folders, key=len, reverse=True)  # files, then the folders naming them
    if len(todo) <= 1:
        for p in todo:
            sync(p)
        return
    with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="actstore-fsync") as pool:
        list(pool.map(sync, sorted(paths)))
        list(pool.map(sync, sorted(folders, key=len, reverse=True)))


class FileWriteback(Writeback):
    """A thread that starts the writeback of written files (sync_file_range WRITE).

    It only starts I/O: durability still comes from `sync` where it is asked for. A
    failure to start writeback is ignored: the kernel writes the pages later.
    """

    def __init__(self, depth: int = 8):
        self._q: queue.Queue = queue.Queue(depth)  # file descriptors owned by the thread
        self._thread = threading.Thread(target=self._run, name="actstore-writeback", daemon=True)
        self._thread.start()

    def submit(self, fd: int) -> None:
        """Start the writeback of file `fd`; the thread closes it (waits while `depth` are queued)."""
        self._q.put(fd)

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            fd = self._q.get()
            if fd is None:
                return
            try:
                sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)
            finally:
                os.close(fd)
