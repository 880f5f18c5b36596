"""Atomic file publication and path safety: data first, then a rename."""

from __future__ import annotations

import ctypes
import json
import os
import uuid
from pathlib import Path
from typing import Any

from actstore.errors import UnsafePathError

_libc = None


def tmp_name(path: Path) -> Path:
    """A hidden temporary name beside `path` (`.name.tmp-<pid>-<random>`; resume removes leftovers)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview, *, fsync: bool = False) -> None:
    """Write `data` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False) -> None:
    """Serialise `obj` as indented JSON and publish it atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"), fsync=fsync)


def create_exclusive_json(path: str | os.PathLike, obj: Any) -> bool:
    """Publish `obj` at `path` only if nothing is there yet; return False if something was.

    Uses link(2), which fails when the target exists, so two processes racing to create
    the same file cannot both succeed and nobody ever sees a half-written file.
    """
    path = Path(path)
    tmp = tmp_name(path)
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def syncfs(path: str | os.PathLike) -> None:
    """Flush every dirty page of the filesystem holding `path` (Linux syncfs, else sync)."""
    global _libc
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc is None:
            try:
                _libc = ctypes.CDLL(None, use_errno=True)
                _libc.syncfs  # noqa: B018  (raises AttributeError where missing)
            except (OSError, AttributeError):
                _libc = False
        if _libc:
            _libc.syncfs(fd)
        else:
            os.sync()
    finally:
        os.close(fd)


def safe_child(root: str | os.PathLike, relative: str) -> Path:
    """Resolve `relative` under `root`, refusing absolute paths, `..` and symlinks that leave it."""
    if not isinstance(relative, str) or not relative:
        raise UnsafePathError(f"expected a relative path inside the store, got {relative!r}")
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise UnsafePathError(
            f"path {relative!r} in the store's metadata points outside the store {str(root)!r}; "
            "refusing to follow it"
        )
    root_resolved = Path(root).resolve()
    full = (Path(root) / rel).resolve()
    if full != root_resolved and root_resolved not in full.parents:
        raise UnsafePathError(
            f"path {relative!r} resolves to {str(full)!r}, outside the store {str(root_resolved)!r} "
            "(a symlink leaving the store?); refusing to follow it"
        )
    return Path(root) / rel
