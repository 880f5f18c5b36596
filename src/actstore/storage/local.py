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

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from actstore.errors import StorageAccessError, UnsafePathError
from actstore.storage.base import Entry, KeyNotFound, Storage, Writeback
from actstore.storage.durable import (
    SYNC_FILE_RANGE_WRITE,
    FileWriteback,
    fsync_dir,
    fsync_files,
    sync_file_range,
    syncfs,
    tmp_name,
    write_all,
)
from actstore.storage.files import atomic_write
from actstore.storage.mapping import MappedFile
from actstore.storage.regular import O_BINARY as _O_BINARY
from actstore.storage.regular import O_NOFOLLOW as _O_NOFOLLOW
from actstore.storage.regular import (
    READ_FLAGS,
    check_no_links,
    file_parent,
    kind_of,
    named_writes,
    not_regular,
    open_regular,
)
from actstore.storage.regular import (
    open_write as _open_write,
)
from actstore.storage.vectored import RWF_NOWAIT, pread_cached, preadv_runs


class LocalStorage(Storage):
    """A store rooted at a local folder (created by the first write, not by opening).

    Args:
        root: the store's folder.
        eager_writeback: start each written file's writeback at once (Linux).
        read_nowait: let `read_cached` use preadv2 RWF_NOWAIT (Linux).
        top: the store's root when `root` is a folder inside it (writes refuse a symbolic
            link anywhere below `top`); default `root`.
    """

    def __init__(
        self, root: str | os.PathLike, *, eager_writeback: bool = True, read_nowait: bool = True, top: str | None = None
    ):
        self.local_root = Path(root)
        self.url = str(root)
        self._root = str(root).rstrip("/") + "/" if str(root) != "/" else "/"
        self._top = top if top is not None else self._root
        self.eager_writeback = eager_writeback and sync_file_range is not None
        self.read_nowait = read_nowait and bool(RWF_NOWAIT) and hasattr(os, "preadv")
        self._made_dirs: set[str] = set()
        self._written: set[str] | None = None  # paths written since the last sync_written (when tracked)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_made_dirs"] = set()
        state["_written"] = None
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
        return LocalStorage(path, eager_writeback=self.eager_writeback, read_nowait=self.read_nowait, top=self._top)

    # ---- reads ----------------------------------------------------------------------
    def open_regular(self, key: str) -> int:
        """An fd of the regular file `key`; links, FIFOs, devices and folders are refused
        (actstore.storage.regular), never blocking."""
        return open_regular(self.path(_checked(key)), missing=KeyNotFound)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        fd = self.open_regular(key)
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
        fd = self.open_regular(key)
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    # The hot paths below open without fstat; a short read or a failed one is explained by
    # actstore.storage.regular (a FIFO opened O_NONBLOCK reads nothing, a folder fails).
    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> int:
        try:
            fd = os.open(self._root + key, READ_FLAGS)
        except OSError:
            fd = self.open_regular(key)  # explains what is wrong (or works after a race)
        try:
            n = os.preadv(fd, [dest], offset)
            if n < len(dest):
                self._check_regular(fd, key)
            return n
        except OSError as e:
            raise not_regular(self.path(key), e.errno) from None
        finally:
            os.close(fd)

    def read_ranges_into(self, key: str, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """The ranges of one file with one open: each run of adjacent ranges (one ending
        where the next begins, in the order given) in one preadv of several buffers."""
        if len(ranges) <= 1:
            return [self.read_into(key, dest, offset) for offset, dest in ranges]
        try:
            fd = os.open(self._root + key, READ_FLAGS)
        except OSError:
            fd = self.open_regular(key)
        try:
            counts, short = preadv_runs(fd, ranges)
            if short:
                self._check_regular(fd, key)
        except OSError as e:
            raise not_regular(self.path(key), e.errno) from None
        finally:
            os.close(fd)
        return counts

    def read_object_into(self, key: str, dest: memoryview) -> int | None:
        try:
            fd = os.open(self._root + key, READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError:
            fd = self.open_regular(key)
        try:
            extra = bytearray(1)
            n = os.readv(fd, [dest, extra])
            if n != len(dest):
                self._check_regular(fd, key)
            return n if n <= len(dest) else os.fstat(fd).st_size
        except OSError as e:
            raise not_regular(self.path(key), e.errno) from None
        finally:
            os.close(fd)

    def map_file(self, key: str) -> MappedFile | None:
        if not MappedFile.supported():
            return None
        try:
            fd = os.open(self._root + key, READ_FLAGS)
        except OSError:
            return None  # missing, a link, ...: read_into handles and explains it
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                return None
            return MappedFile.map(fd, st.st_size)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def _check_regular(self, fd: int, key: str) -> None:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular(self.path(key))

    def read_cached(self, key: str, dest: memoryview, offset: int = 0) -> bool:
        if not self.read_nowait:
            return False
        try:
            fd = os.open(self._root + key, READ_FLAGS)
        except OSError:
            return False  # missing, a link, ...: read_into handles and explains it
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (offset == 0 and st.st_size != len(dest)):
                return False
            got = pread_cached(fd, dest, offset)
        finally:
            os.close(fd)
        if got is None:
            self.read_nowait = False  # this kernel or file system cannot tell: never again
        return bool(got)

    def size(self, key: str) -> int | None:
        try:
            st = os.lstat(self.path(_checked(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def kind(self, key: str) -> str | None:
        """ "file", "dir", "link", "other", or None when nothing is there."""
        try:
            st = os.lstat(self.path(_checked(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return kind_of(st.st_mode)

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
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed since the folder was read (a renamed temporary file, a spool's removal)
                    yield Entry(e.path[base:], st.st_size, kind_of(st.st_mode))
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
        """Create the folder of `path`; refuse (once per folder) a symbolic link on the way."""
        parent = path.rsplit("/", 1)[0]
        if parent not in self._made_dirs:
            check_no_links(self._top, parent)
            try:
                os.makedirs(parent, exist_ok=True)
            except (NotADirectoryError, FileExistsError):
                raise StorageAccessError(
                    f"cannot create the folder {parent}: {file_parent(os.path.join(parent, '-'))} is a file, not a folder; "
                    "choose a path whose folders are folders (nothing was written there)"
                ) from None
            self._made_dirs.add(parent)
            if self._written is not None:
                self._written_dirs.add(parent)  # its name, and its parents', synced by sync_written

    def put(
        self, key: str, *parts: Any, atomic: bool = True, durable: bool = False, writeback: Writeback | None = None
    ) -> None:
        path = self.path(_checked(key))
        self._parent(path)
        with named_writes(path):
            self._put(path, parts, atomic, durable, writeback)

    def _put(self, path: str, parts: tuple, atomic: bool, durable: bool, writeback: Writeback | None) -> None:
        if not atomic:
            self._write_file(path, parts, durable, writeback)
            return
        written: list[str] = []

        def write(tmp: Path) -> None:
            written.append(str(tmp))
            self._write_file(str(tmp), parts, durable, writeback)

        atomic_write(path, write)  # (a durable file syncs itself in _write_file)
        if durable:
            fsync_dir(path.rsplit("/", 1)[0])
        else:
            self._note(path, written[0])

    def _write_file(self, path: str, parts: tuple, durable: bool, writeback: Writeback | None) -> None:
        if not durable:  # (a durable put syncs itself)
            self._note(path)
        fd = _open_write(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY | _O_NOFOLLOW)
        try:
            write_all(fd, parts)  # one gathered write
            if durable:
                os.fsync(fd)
            elif self.eager_writeback:
                if isinstance(writeback, FileWriteback):
                    writeback.submit(os.dup(fd))
                else:
                    sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)

    def put_stream(self, key: str, parts: Iterator[bytes]) -> None:
        path = self.path(_checked(key))
        self._parent(path)
        with named_writes(path):
            atomic_write(path, lambda tmp: _write_stream(tmp, parts))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = Path(self.path(_checked(key)))
        self._parent(str(path))
        tmp = tmp_name(path)
        try:
            with named_writes(str(path)):
                tmp.write_bytes(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
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
        self._note(path)
        fd = _open_write(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_BINARY | _O_NOFOLLOW)
        try:
            with named_writes(path):
                write_all(fd, (data,))
                return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def truncate(self, key: str, size: int) -> None:
        path = self.path(_checked(key))
        self._note(path)
        check_no_links(self._top, path.rsplit("/", 1)[0])
        fd = _open_write(path, os.O_WRONLY | _O_BINARY | _O_NOFOLLOW)
        try:
            with named_writes(path):
                os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        path = self.path(_checked(key))
        check_no_links(self._top, path.rsplit("/", 1)[0])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def delete_prefix(self, prefix: str) -> None:
        path = self.path(_checked(prefix)) if prefix else self._root
        check_no_links(self._top, path.rstrip("/").rsplit("/", 1)[0])
        if os.path.islink(path.rstrip("/")):
            os.unlink(path.rstrip("/"))
        else:
            shutil.rmtree(path, ignore_errors=False) if os.path.isdir(path) else None
        self._made_dirs = {d for d in self._made_dirs if not d.startswith(path)}

    def sync(self, prefix: str = "") -> None:
        path = self.path(prefix) if prefix else self._root
        if os.path.exists(path):
            syncfs(path)

    def track_writes(self) -> None:
        self._written, self._written_dirs = set(), set()

    def mark_written(self, key: str) -> None:
        self._note(self.path(_checked(key)))

    def sync_written(self) -> None:  # the written files and their folders at once (durable.fsync_files)
        if self._written is None:
            return self.sync()
        paths, self._written, made, self._written_dirs = self._written, set(), self._written_dirs, set()
        fsync_files(paths, self._top, made=made)

    def _note(self, path: str, replaced: str = "") -> None:
        if self._written is not None:
            self._written.discard(replaced)  # (a temporary file's data, now under its final name)
            self._written.add(path)

    def writeback(self) -> Writeback | None:
        return FileWriteback() if self.eager_writeback else None

    # ---- access -------------------------------------------------------------------
    def check_access(self, *, write: bool) -> None:
        path = Path(self._root)
        if path.exists() and not path.is_dir():
            raise StorageAccessError(
                f"cannot use {self.url}: it is a file, not a folder; give a new or existing folder"
            )
        if not write:
            return
        top = path
        while not top.exists():
            top = top.parent
        if not top.is_dir():
            raise StorageAccessError(
                f"cannot write to {self.url}: {top} is a file, not a folder; give a path under a folder"
            )
        if not os.access(top, os.W_OK | os.X_OK):
            raise StorageAccessError(f"cannot write to {self.url}: no write permission in {top}")

    # ---- zarr -----------------------------------------------------------------------
    def zarr_store(self, prefix: str, *, read_only: bool) -> Any:
        """Reads go through this Storage (regular files only, bounded metadata JSON:
        actstore.storage.zarrview); writes through zarr's LocalStore made atomic."""
        if read_only:
            from actstore.storage.zarrview import StorageZarrStore

            return StorageZarrStore(self.child(prefix) if prefix else self)
        from actstore.storage.localzarr import atomic_local_store

        return atomic_local_store(
            self.path(_checked(prefix)) if prefix else self._root, top=self._top, storage_class=LocalStorage
        )


def _parents(root: str, prefix: str) -> Iterator[str]:
    parts = prefix.split("/")
    for i in range(1, len(parts)):
        yield root + "/".join(parts[:i])


def _checked(key: str) -> str:
    """A key is a relative path inside the store: no absolute path, no '..'."""
    if key.startswith("/") or key == ".." or key.startswith("../") or "/../" in key or key.endswith("/.."):
        raise UnsafePathError(f"key {key!r} points outside the store; refusing to follow it")
    return key


def _write_stream(path: Path, parts: Iterator[bytes]) -> None:
    """A new file of `parts`, each held only while it is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o644)
    try:
        for part in parts:
            write_all(fd, (part,))
    finally:
        os.close(fd)
