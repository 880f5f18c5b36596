"""LocalStorage: a store in a folder of the local file system.

Whole-object puts are atomic (a temporary file beside the target, renamed into place);
create-only puts use link(2); reads never follow a symbolic link and never open anything
but a regular file (a FIFO planted in a store would block a reader forever). Two
behaviours are options of the object, not environment switches:

- eager_writeback (default True): start each written file's writeback at once
  (Linux sync_file_range), so the disk works while the writer computes;
- read_nowait (default True): `read_cached` asks the kernel for page-cache hits only
  (preadv2 RWF_NOWAIT), so loaders copy cached chunks without waiting for the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import queue
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from actstore.errors import CorruptStoreError, UnsafePathError
from actstore.storage.base import Entry, KeyNotFound, Storage, Writeback

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_SYNC_FILE_RANGE_WRITE = 2


def _load_libc_fn(name: str, argtypes: list) -> Any:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


_sync_file_range = _load_libc_fn("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])
_syncfs = _load_libc_fn("syncfs", [ctypes.c_int])


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
                _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
            finally:
                os.close(fd)


class LocalStorage(Storage):
    """A store rooted at a local folder (created by the first write, not by opening).

    Args:
        root: the store's folder.
        eager_writeback: start each written file's writeback at once (Linux).
        read_nowait: let `read_cached` use preadv2 RWF_NOWAIT (Linux).
    """

    def __init__(self, root: str | os.PathLike, *, eager_writeback: bool = True, read_nowait: bool = True):
        self.local_root = Path(root)
        self.url = str(root)
        self._root = str(root).rstrip("/") + "/" if str(root) != "/" else "/"
        self.eager_writeback = eager_writeback and _sync_file_range is not None
        self.read_nowait = read_nowait and bool(_RWF_NOWAIT) and hasattr(os, "preadv")
        self._made_dirs: set[str] = set()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_made_dirs"] = set()
        return state

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def path(self, key: str) -> str:
        """The file system path of `key`."""
        return self._root + key if key else self._root.rstrip("/") or "/"

    def where(self, key: str) -> str:
        return self.path(key)

    def child(self, prefix: str) -> LocalStorage:
        """The folder `prefix`; refused when a symbolic link takes it outside this store."""
        path = self.path(_checked(prefix))
        if os.path.islink(path) or any(os.path.islink(p) for p in _parents(self._root, prefix)):
            root = Path(self._root).resolve()
            full = Path(path).resolve()
            if full != root and root not in full.parents:
                raise UnsafePathError(
                    f"path {prefix!r} resolves to {str(full)!r}, outside the store {str(root)!r} "
                    "(a symlink leaving the store?); refusing to follow it"
                )
        return LocalStorage(path, eager_writeback=self.eager_writeback, read_nowait=self.read_nowait)

    # ---- reads ----------------------------------------------------------------------
    def _open_regular(self, key: str) -> int:
        """An fd of the regular file `key`; links, FIFOs, devices and folders are refused."""
        path = self.path(_checked(key))
        try:
            fd = os.open(path, os.O_RDONLY | _O_BINARY | _O_NOFOLLOW | _O_NONBLOCK)
        except FileNotFoundError:
            raise KeyNotFound(f"{path} does not exist") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"{path} is a symbolic link; actstore never writes links inside a store, so the store was "
                    "altered: refusing to follow it (run `actstore verify`)"
                ) from None
            if e.errno in (errno.EISDIR, errno.ENOTDIR):
                raise CorruptStoreError(f"{path} is a folder where the store has a file; the store is damaged (run `actstore verify`)") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
            raise CorruptStoreError(f"{path} is {kind} where the store has a file; the store is damaged (run `actstore verify`)")
        return fd

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        fd = self._open_regular(key)
        try:
            size = os.fstat(fd).st_size
            if max_bytes is not None and size > max_bytes:
                raise ValueError(f"{self.path(key)} has {size} bytes, more than the {max_bytes} allowed for it")
            chunks = []
            while True:
                b = os.read(fd, max(size, 1 << 16))
                if not b:
                    break
                chunks.append(b)
                if max_bytes is not None and sum(map(len, chunks)) > max_bytes:
                    raise ValueError(f"{self.path(key)} grew past the {max_bytes} bytes allowed for it")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        fd = self._open_regular(key)
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> int:
        try:
            fd = os.open(self._root + key, os.O_RDONLY | _O_BINARY | _O_NOFOLLOW)
        except OSError:
            fd = self._open_regular(key)  # explains what is wrong (or works after a race)
        try:
            return os.preadv(fd, [dest], offset)
        finally:
            os.close(fd)

    def read_object_into(self, key: str, dest: memoryview) -> int | None:
        try:
            fd = os.open(self._root + key, os.O_RDONLY | _O_BINARY | _O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:
            fd = self._open_regular(key)
        try:
            extra = bytearray(1)
            n = os.readv(fd, [dest, extra])
            return n if n <= len(dest) else os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_cached(self, key: str, dest: memoryview, offset: int = 0) -> bool:
        if not self.read_nowait:
            return False
        try:
            fd = os.open(self._root + key, os.O_RDONLY | _O_BINARY | _O_NOFOLLOW)
        except OSError:
            return False  # missing, a link, ...: read_into handles and explains it
        try:
            if offset == 0 and os.fstat(fd).st_size != len(dest):
                return False
            n = os.preadv(fd, [dest], offset, _RWF_NOWAIT)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self.read_nowait = False  # this kernel or file system cannot tell: never again
                return False
            raise
        finally:
            os.close(fd)
        return n == len(dest)

    def size(self, key: str) -> int | None:
        try:
            st = os.lstat(self.path(_checked(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def kind(self, key: str) -> str | None:
        """"file", "dir", "link", "other", or None when nothing is there."""
        try:
            st = os.lstat(self.path(_checked(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return _kind(st.st_mode)

    def link_target(self, key: str) -> tuple[str, bool] | None:
        path = self.path(_checked(key))
        if not os.path.islink(path):
            return None
        target, root = os.path.realpath(path), os.path.realpath(self._root)
        return target, target == root or target.startswith(root.rstrip(os.sep) + os.sep)

    def list(self, prefix: str = "") -> Iterator[Entry]:
        top = self.path(_checked(prefix)) if prefix else self._root.rstrip("/")
        base = len(self._root)
        stack = [top]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                empty = True
                for e in it:
                    empty = False
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                        continue
                    st = e.stat(follow_symlinks=False)
                    yield Entry(e.path[base:], st.st_size, _kind(st.st_mode))
                if empty and d != top:
                    yield Entry(d[base:], 0, "dir")

    def stored_bytes(self, prefix: str = "") -> int:
        """Bytes allocated on disk (sparse files count what they use)."""
        total = 0
        for e in self.list(prefix):
            try:
                total += os.lstat(self._root + e.key).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def list_dir(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(_checked(prefix)) if prefix else self._root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    # ---- writes ---------------------------------------------------------------------
    def _parent(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)

    def put(self, key: str, *parts: Any, atomic: bool = True, durable: bool = False,
            writeback: Writeback | None = None) -> None:
        path = self.path(_checked(key))
        self._parent(path)
        if not atomic:
            self._write_file(path, parts, durable, writeback)
            return
        tmp = str(tmp_name(Path(path)))
        try:
            self._write_file(tmp, parts, durable, writeback)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if durable:
            fsync_dir(path.rsplit("/", 1)[0])

    def _write_file(self, path: str, parts: tuple, durable: bool, writeback: Writeback | None) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view.nbytes:
                    n = os.write(fd, view)
                    view = view[n:]
            if durable:
                os.fsync(fd)
            elif self.eager_writeback:
                if isinstance(writeback, FileWriteback):
                    writeback.submit(os.dup(fd))
                else:
                    _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)

    def put_stream(self, key: str, parts: Iterator[bytes]) -> None:
        path = self.path(_checked(key))
        self._parent(path)
        tmp = str(tmp_name(Path(path)))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view.nbytes:
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = Path(self.path(_checked(key)))
        self._parent(str(path))
        tmp = tmp_name(path)
        tmp.write_bytes(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def append(self, key: str, data: bytes) -> int:
        path = self.path(_checked(key))
        self._parent(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_BINARY | _O_NOFOLLOW, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view.nbytes:
                view = view[os.write(fd, view):]
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def truncate(self, key: str, size: int) -> None:
        fd = os.open(self.path(_checked(key)), os.O_WRONLY | _O_BINARY | _O_NOFOLLOW)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(_checked(key)))

    def delete_prefix(self, prefix: str) -> None:
        path = self.path(_checked(prefix)) if prefix else self._root
        if os.path.islink(path.rstrip("/")):
            os.unlink(path.rstrip("/"))
        else:
            shutil.rmtree(path, ignore_errors=False) if os.path.isdir(path) else None
        self._made_dirs = {d for d in self._made_dirs if not d.startswith(path)}

    def sync(self, prefix: str = "") -> None:
        path = self.path(prefix) if prefix else self._root
        if os.path.exists(path):
            syncfs(path)

    def writeback(self) -> Writeback | None:
        return FileWriteback() if self.eager_writeback else None

    # ---- access -------------------------------------------------------------------
    def check_access(self, *, write: bool) -> None:
        from actstore.errors import StorageAccessError

        path = Path(self._root)
        if path.exists() and not path.is_dir():
            raise StorageAccessError(f"cannot use {self.url}: it is a file, not a folder; give a new or existing folder")
        if not write:
            return
        top = path
        while not top.exists():
            top = top.parent
        if not top.is_dir():
            raise StorageAccessError(f"cannot write to {self.url}: {top} is a file, not a folder; give a path under a folder")
        if not os.access(top, os.W_OK | os.X_OK):
            raise StorageAccessError(f"cannot write to {self.url}: no write permission in {top}")

    # ---- zarr -----------------------------------------------------------------------
    def zarr_store(self, prefix: str, *, read_only: bool) -> Any:
        return _atomic_local_store_class()(self.path(_checked(prefix)) if prefix else self._root, read_only=read_only)


def _parents(root: str, prefix: str) -> Iterator[str]:
    parts = prefix.split("/")
    for i in range(1, len(parts)):
        yield root + "/".join(parts[:i])


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def _checked(key: str) -> str:
    """A key is a relative path inside the store: no absolute path, no '..'."""
    if key.startswith("/") or key == ".." or key.startswith("../") or "/../" in key or key.endswith("/.."):
        raise UnsafePathError(f"key {key!r} points outside the store; refusing to follow it")
    return key


_ATOMIC_STORE = None


def _atomic_local_store_class() -> type:
    """zarr's LocalStore with atomic writes (built on first use: zarr imports slowly)."""
    global _ATOMIC_STORE
    if _ATOMIC_STORE is None:
        from zarr.storage import LocalStore

        class AtomicLocalStore(LocalStore):
            """A LocalStore whose every write goes to a temporary file renamed into place.

            zarr-python 3.1's LocalStore writes in place: a crash mid-write would leave a
            half-written `.zarray` or per-sample chunk. Here no reader ever sees one.
            """

            async def set(self, key: str, value: Any) -> None:  # noqa: D102
                if not self._is_open:
                    await self._open()
                self._check_writable()
                target = LocalStorage(self.root)
                data = value.to_bytes()
                await asyncio.to_thread(target.put, key, data)

        _ATOMIC_STORE = AtomicLocalStore
    return _ATOMIC_STORE
