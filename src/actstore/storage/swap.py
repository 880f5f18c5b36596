"""Publishing a folder whole: it is built in a staging folder beside its target and swapped
in at the end. Every state a kill can leave is recognised by the next publication of the
same target (`recover`), which restores or renames aside, and deletes only what is
provably ours. The one publication step of views, exports, feature tables and saev dumps.

Names beside a target NAME (host and pid say which builder; `recover` touches only those
of dead processes of this host):

- `.NAME.staging-<host>-<pid>-<tag>/`: a build's stage. While it holds STAGE_MARKER it is a
  build that was never published. The marker is removed just before the swap, so a stage
  without it holds a finished build or, after the swap, the folder that was at NAME.
- `.NAME.old-<host>-<pid>-<tag>/`: the folder that was at NAME, moved aside by the
  two-rename fallback (a file system without an atomic exchange).
- `NAME.replaced-<time>-<pid>/`: a folder that was at NAME and is not provably ours (the
  caller's `ours` says no): kept there, never deleted, and a warning names it.

The swap: the marker is removed; then one renameat2(RENAME_EXCHANGE) where the file system
has it (NAME is never absent), else NAME is renamed aside (to its `.old-` name, or straight
to its `replaced-` name when it is not ours) and the stage renamed to NAME; the old folder
is then deleted when ours, else renamed to its `replaced-` name.

Recovery, per leftover: an `.old-` folder goes back to NAME when NAME is missing, else is
disposed of as above; a marked stage is deleted; an unmarked stage becomes NAME when NAME is
missing (a finished build whose swap was cut short), else is disposed of as above.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from actstore.storage.durable import exchange_paths, fsync_dir

__all__ = ["STAGE_MARKER", "make_stage", "recover", "swap_in"]

STAGE_MARKER = ".actstore-stage"  # inside a stage: this folder is a build never published
Ours = Callable[[Path], bool]  # whether a folder that was at the target may be deleted


def make_stage(target: Path) -> Path:
    """Create and return a marked stage beside `target` for this process's build."""
    stage = target.parent / f".{target.name}.staging-{_tag()}"
    stage.mkdir()
    (stage / STAGE_MARKER).write_text(json.dumps({"target": target.name, "pid": os.getpid()}) + "\n")
    return stage


def swap_in(stage: Path, target: Path, ours: Ours) -> Path | None:
    """Make the build in `stage` the folder `target`; the folder that was there is deleted
    when `ours(folder)` (or it is empty), else kept as `target.replaced-*`, which is returned."""
    (stage / STAGE_MARKER).unlink()
    if not target.exists() and not target.is_symlink():
        os.rename(stage, target)
        fsync_dir(target.parent)
        return None
    if exchange_paths(stage, target):
        old = stage  # now the folder that was at the target
    else:
        mine = _disposable(target, ours)  # a folder not ours goes straight to its visible name
        old = target.parent / f".{target.name}.old-{_tag()}" if mine else _replaced(target)
        os.rename(target, old)
        os.rename(stage, target)
    fsync_dir(target.parent)
    return _dispose(old, target, ours)


def recover(target: Path, ours: Ours) -> list[Path]:
    """Settle what killed publications of `target` left beside it (see the module doc);
    returns the folders kept as `target.replaced-*`."""
    parent, kept = target.parent, []
    if not parent.is_dir():
        return kept
    pat = re.compile(rf"^\.{re.escape(target.name)}\.(staging|old)-(.+)-(\d+)-[0-9a-f]{{8}}$")
    left = []
    for entry in os.scandir(parent):
        m = pat.match(entry.name)
        if m and entry.is_dir(follow_symlinks=False) and m.group(2) == _host() and not _alive(int(m.group(3))):
            left.append((m.group(1) != "old", entry.name))  # the old folders first: they go back first
    for _, name in sorted(left):
        path = parent / name
        if (path / STAGE_MARKER).is_file():
            shutil.rmtree(path)  # a build never published
        elif not target.exists() and not target.is_symlink():
            os.rename(path, target)  # the folder that was there, or a finished build: back at its name
        else:
            kept.append(_dispose(path, target, ours))
    return [k for k in kept if k is not None]


def _dispose(old: Path, target: Path, ours: Ours) -> Path | None:
    if _disposable(old, ours):
        shutil.rmtree(old)
        return None
    keep = old if old.name.startswith(f"{target.name}.replaced-") else _replaced(target)
    if keep != old:
        os.rename(old, keep)
    print(
        f"actstore: warning: {target} was not written by this command; the old folder is kept as {keep}",
        file=sys.stderr,
    )
    return keep


def _disposable(folder: Path, ours: Ours) -> bool:
    if folder.is_symlink() or not folder.is_dir():
        return False
    return not any(folder.iterdir()) or ours(folder)


def _replaced(target: Path) -> Path:
    base = f"{target.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path, n = target.parent / base, 1
    while path.exists() or path.is_symlink():
        path, n = target.parent / f"{base}-{n}", n + 1
    return path


def _tag() -> str:
    return f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


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
