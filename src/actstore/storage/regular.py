"""Opening only regular files, and writing nowhere a symbolic link leads.

A store (or an export, a legacy directory) holds regular files and folders only. A FIFO
planted where a file belongs would block a reader forever, a device would feed it
endless bytes, a folder gives IsADirectoryError, and a symbolic link may lead anywhere.
So every file is opened without following a final link and without blocking
(O_NOFOLLOW | O_NONBLOCK), then checked with fstat before a byte is read; what stands
there instead is named in the project's error. Writes check once per folder that no
folder between the store's root and the file is a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from actstore.errors import ActstoreError, CorruptStoreError, UnsafePathError

O_BINARY = getattr(os, "O_BINARY", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
READ_FLAGS = os.O_RDONLY | O_BINARY | O_NOFOLLOW | O_NONBLOCK
STORE_HINT = "the store is damaged (run `actstore verify`)"


def kind_of(mode: int) -> str:
    """ "file", "dir", "link" or "other" (a FIFO, socket or device), as Storage.kind says."""
    for test, kind in ((stat.S_ISREG, "file"), (stat.S_ISLNK, "link"), (stat.S_ISDIR, "dir")):
        if test(mode):
            return kind
    return "other"


_OTHER = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def describe(mode: int) -> str:
    """What a file mode is, in words."""
    kind = kind_of(mode)
    if kind != "other":
        return {"file": "a regular file", "link": "a symbolic link", "dir": "a folder"}[kind]
    return next((words for test, words in _OTHER if test(mode)), "not a regular file")


def open_regular(
    path: str,
    *,
    error: type[ActstoreError] = CorruptStoreError,
    hint: str = STORE_HINT,
    missing: type[BaseException] | None = None,
) -> int:
    """A read-only fd of the regular file at `path`, never blocking.

    Args:
        path: the file.
        error: the class raised when something other than a regular file stands there
            (a symbolic link raises UnsafePathError when `error` is a CorruptStoreError).
        hint: what to do about it, appended to the message.
        missing: the class raised when nothing is there (default FileNotFoundError).
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        raise (missing or FileNotFoundError)(f"{path} does not exist") from None
    except OSError as e:
        raise not_regular(path, e.errno, error=error, hint=hint) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path} is {describe(mode)} where a file belongs; {hint}")
    return fd


def not_regular(
    path: str, err: int | None = None, *, error: type[ActstoreError] = CorruptStoreError, hint: str = STORE_HINT
) -> ActstoreError:
    """The error for `path` when opening it as a regular file failed (or a read of it did)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        return error(f"{file_parent(path)} is a file where a folder belongs (it holds {path}); {hint}")
    except OSError as e:
        return error(f"{path} cannot be read ({e.strerror}); {hint}")
    if st is not None and stat.S_ISLNK(st.st_mode) or err == errno.ELOOP:
        cls = UnsafePathError if issubclass(error, CorruptStoreError) else error
        if hint == STORE_HINT:
            return cls(
                f"{path} is a symbolic link; actstore never writes links inside a store, so the store was altered: "
                "refusing to follow it (run `actstore verify`)"
            )
        return cls(f"{path} is a symbolic link where a file belongs; refusing to follow it; {hint}")
    if st is None:
        if err == errno.ENOTDIR:
            return error(f"{file_parent(path)} is a file where a folder belongs (it holds {path}); {hint}")
        return error(f"{path} does not exist; {hint}")
    if not stat.S_ISREG(st.st_mode):
        return error(f"{path} is {describe(st.st_mode)} where a file belongs; {hint}")
    return error(f"{path} cannot be read ({os.strerror(err) if err else 'unknown error'}); {hint}")


def file_parent(path: str) -> str:
    """The first component of `path` (from the top) that is a file, not a folder."""
    parts = path.split(os.sep)
    for i in range(1, len(parts)):
        head = os.sep.join(parts[:i]) or os.sep
        try:
            if not stat.S_ISDIR(os.stat(head).st_mode):
                return head
        except OSError:
            break
    return os.path.dirname(path)


def check_no_links(top: str, folder: str) -> None:
    """Refuse to write into `folder` when a folder between `top` (the store's root, which may
    itself be a link the user chose) and `folder` is a symbolic link."""
    top = top.rstrip(os.sep) or os.sep
    if folder == top or not folder.startswith(top.rstrip(os.sep) + os.sep):
        return
    rel = folder[len(top.rstrip(os.sep)) + 1 :].split(os.sep)
    path = top.rstrip(os.sep)
    for part in rel:
        path = f"{path}{os.sep}{part}"
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return  # created below by the writer itself
        if stat.S_ISLNK(mode):
            raise UnsafePathError(
                f"{path} is a symbolic link inside the store {top}; actstore never writes through links "
                "(it could write outside the store): replace it with a real folder"
            )
        if not stat.S_ISDIR(mode):
            raise CorruptStoreError(f"{path} is {describe(mode)} where the store has a folder; {STORE_HINT}")


@contextlib.contextmanager
def named_writes(path: str) -> Iterator[None]:
    """An OSError of a write that names no file (os.write, os.fsync on a descriptor) names
    `path`: a full disk says which file it could not write."""
    try:
        yield
    except OSError as e:
        if not e.filename and type(e).__module__ == "builtins":
            e.filename = path
        raise


def open_write(path: str, flags: int) -> int:
    """os.open for writing; a symbolic link at `path` (O_NOFOLLOW) is the project's error."""
    try:
        return os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{path} is a symbolic link; actstore never writes through links (it could write "
                "outside the store): delete the link"
            ) from None
        raise
