"""Atomic publication of a directory: build under a hidden temporary name beside the target,
then rename. A killed build leaves only a hidden temporary directory, removed by the next
build of the same hash on the same host once its process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from actstore.storage.durable import exchange_paths, fsync_dir


def temp_dir(parent: Path, name: str) -> Path:
    """Create and return a fresh hidden directory `.<name>.tmp-<host>-<pid>-<rand>` in `parent`."""
    tmp = parent / f".{name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def remove_stale(parent: Path, name: str) -> list[Path]:
    """Remove temporary directories of `name` left by dead processes on this host; return them."""
    pat = re.compile(rf"^\.{re.escape(name)}\.(?:tmp|old)-(.+)-(\d+)-[0-9a-f]{{8}}$")
    removed = []
    if not parent.is_dir():
        return removed
    for entry in os.scandir(parent):
        m = pat.match(entry.name)
        if m and m.group(1) == _host() and not _alive(int(m.group(2))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def publish(tmp: Path, target: Path, *, replace: bool) -> bool:
    """Rename `tmp` to `target`. Returns False (leaving both) when `target` exists and not `replace`.

    With `replace`, the old directory is swapped out atomically (renameat2 RENAME_EXCHANGE
    where the kernel has it; else two renames) and deleted.
    """
    if not replace or not target.exists():
        try:
            os.rename(tmp, target)
            fsync_dir(target.parent)
            return True
        except OSError:
            if not target.exists():
                raise
            if not replace:
                return False
    if exchange_paths(tmp, target):
        shutil.rmtree(tmp)  # now holds the old directory
    else:
        old = target.parent / f".{target.name}.old-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old)
    fsync_dir(target.parent)
    return True


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
