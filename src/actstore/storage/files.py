"""Files outside a store (exports, legacy directories): atomic publication and path safety.

A store's own files go through actstore.storage; exporters that write plain folders use
these helpers, built on the same primitives (temporary name, rename, directory fsync).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from actstore.errors import ActstoreError, DiskFullError, ExportWriteError, UnsafePathError
from actstore.storage.durable import fsync_dir, syncfs, tmp_name, write_all
from actstore.storage.regular import O_BINARY, open_regular

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "export_os_errors",
    "fsync_dir",
    "read_regular",
    "safe_child",
    "syncfs",
    "tmp_name",
    "write_new",
]

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FIXES = {
    errno.EACCES: "check that you may write there (its permissions and owner), or export to another folder",
    errno.EPERM: "check that you may write there (its permissions and owner), or export to another folder",
    errno.EROFS: "that file system is read-only: export to another folder",
    errno.EIO: "the disk reported an I/O error: check the device (dmesg, its health), then export again",
    errno.ENAMETOOLONG: "the path is too long for the file system: export to a shorter path",
}


@contextlib.contextmanager
def export_os_errors(what: str, out: str | os.PathLike, rerun: str, *, left: str | None = None) -> Iterator[None]:
    """Turn an OSError of an export into the project's error, naming the file and the fix:
    DiskFullError for a full disk, a quota or a file-size limit, ExportWriteError otherwise.

    Args:
        what: the job, for the message (`exporting s3://b/s to saev`).
        out: the export's target (named when the error names no file).
        rerun: the command that redoes the export once fixed.
        left: what the failed export leaves (default: nothing published, partial files removed).
    """
    try:
        yield
    except ActstoreError:
        raise
    except OSError as e:
        file = e.filename or out
        cause = os.strerror(e.errno) if e.errno else str(e)
        if e.errno in _FULL:
            space = (
                "a file-size limit (ulimit -f) was reached" if e.errno == errno.EFBIG else "the disk or quota is full"
            )
            err: OSError = DiskFullError(
                f"{what}: {cause} writing {file}: {space}. {left or f'Nothing was published to {out} and the partial files were removed'}; "
                f"free space there (or export elsewhere), then rerun {rerun}"
            )
        else:
            fix = _FIXES.get(e.errno, f"fix the cause, then rerun {rerun}")
            err = ExportWriteError(f"{what}: {cause} writing {file}; {fix}")
        err.errno, err.filename = e.errno, str(file)
        raise err from e


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object], *, fsync: bool = False) -> None:
    """Publish the file that `write(tmp)` makes at a temporary path beside `path` (a bytes
    write, PIL's `Image.save`, matplotlib's `savefig`, `os.symlink`) by renaming it over
    `path`: readers see the old file or the whole new one, never a part.

    Args:
        path: the file to publish.
        write: makes the file at the path it is given (pass the format explicitly where the
            writer guesses it from the suffix: the temporary name ends `.tmp-<pid>-<random>`).
        fsync: the file's bytes and its name survive a power loss once this returns.

    On any error, the callback's included, the temporary file is removed and the error
    raised (an OSError that names no file names `path`); `path` is left as it was.
    """
    path = Path(path)
    tmp = tmp_name(path)
    try:
        write(tmp)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY | O_BINARY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a write on a descriptor names no file
            e.filename = str(path)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview, *, fsync: bool = False) -> None:
    """Write `data` to a temporary file beside `path`, then rename it over `path` (atomic_write)."""
    atomic_write(path, lambda tmp: write_new(tmp, data), fsync=fsync)


def write_new(path: str | os.PathLike, *parts: Any) -> None:
    """Create the file `path` (never one that exists) holding the concatenation of `parts`
    (bytes-like), in one gathered write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_BINARY, 0o644)
    try:
        write_all(fd, parts)
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False) -> None:
    """Serialise `obj` as indented standard JSON and publish it atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode("utf-8"), fsync=fsync)


def safe_child(root: str | os.PathLike, relative: str) -> Path:
    """Resolve `relative` under `root`, refusing absolute paths, `..` and symlinks that leave it."""
    if not isinstance(relative, str) or not relative:
        raise UnsafePathError(f"expected a relative path inside the store, got {relative!r}")
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise UnsafePathError(
            f"path {relative!r} in the store's metadata points outside the store {str(root)!r}; refusing to follow it"
        )
    root_resolved = Path(root).resolve()
    full = (Path(root) / rel).resolve()
    if full != root_resolved and root_resolved not in full.parents:
        raise UnsafePathError(
            f"path {relative!r} resolves to {str(full)!r}, outside the store {str(root_resolved)!r} "
            "(a symlink leaving the store?); refusing to follow it"
        )
    return Path(root) / rel


def read_regular(
    path: str | os.PathLike, *, error: type[ActstoreError], hint: str, max_bytes: int | None = None
) -> bytes:
    """The bytes of the regular file `path` (an export's or a legacy directory's file): a
    FIFO, device, folder or link there raises `error` (never blocking), as does a file of
    more than `max_bytes`; a missing file raises FileNotFoundError."""
    fd = open_regular(os.fspath(path), error=error, hint=hint)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise error(f"{path} has {size} bytes, more than the {max_bytes} allowed for it; {hint}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(size + 1)  # read(n) allocates n bytes up front
        if max_bytes is not None and len(data) > max_bytes:
            raise error(f"{path} grew past the {max_bytes} bytes allowed for it; {hint}")
        return data
    finally:
        os.close(fd)
