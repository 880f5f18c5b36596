"""Output folders written whole: a view or export is built in a staging folder beside its
target and swapped in at the end, so a killed or out-of-space build leaves the old folder
as it was (never a mix of two builds), and a second build into the same folder is refused
while the first runs.

- The lock: `.<name>.lock` beside the target, held with flock (released by the kernel when
  the process dies, so a killed build never blocks the next one).
- The stage and the swap: actstore.storage.swap (the one publication step): a marked
  stage beside the target, swapped in by one renameat2(RENAME_EXCHANGE) where Linux offers
  it (the target is never absent), else two renames. What a killed build left (a stage, or
  the old folder under a stage's or an `.old-` name) is settled by the next build (which
  holds the lock): restored, renamed aside, or deleted only when provably ours.
- An existing folder is replaced only with `overwrite` (an empty one needs nothing). The old
  folder is deleted when it holds the marker file a build of the same kind wrote; any other
  folder is kept beside the new one as `<name>.replaced-<time>` (never deleted: it was not
  ours), and a warning says where.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from actstore.errors import DiskFullError, OutputBusyError, OutputExistsError
from actstore.read.interface import Reader
from actstore.read.state import check_unchanged
from actstore.storage.swap import make_stage, recover, swap_in

MARKER = ".actstore-output"  # {"kind": ...}: this folder was written by that command
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _lock(path: Path) -> int:
    """An exclusive flock on `path` (created), or OutputBusyError at once."""
    import fcntl

    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(
                f"another process is writing {path.name[1:-5]} now (it holds {path}); wait for it to finish"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd  # still the file at that name (a finishing build unlinks it)
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OutputBusyError(f"cannot take the lock {path}: other builds keep replacing it")


def _owned(out: Path, kind: str) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("kind") == kind
    except (OSError, ValueError, AttributeError):
        return False


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse an existing `out` unless it is an empty folder or `overwrite`."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if not overwrite:
        raise OutputExistsError(f"{out} exists: pass --overwrite to replace it (it is swapped in whole at the end)")
    if out.is_symlink() or not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder: name another --out; it is never replaced")


@contextmanager
def staged_folder(
    out: str | os.PathLike, *, kind: str, overwrite: bool = False, source: Reader | None = None
) -> Iterator[Path]:
    """Yield an empty staging folder beside `out`; when the block ends without an error it
    becomes `out` in one swap (the old folder is deleted after), else it is deleted and `out`
    is untouched. A write that runs out of space becomes a DiskFullError naming the file. A
    `source` store that is no longer the state it was opened in when the block ends is a
    StoreChangedError (actstore.read.state): the build is not published."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    fd = _lock(lock_path)
    ours = partial(_owned, kind=kind)
    try:
        recover(out, ours)  # what a killed build left: under the lock, no build of `out` runs
        check_target(out, overwrite)
        stage = make_stage(out)
        try:
            yield stage
            if source is not None:
                check_unchanged(source, f"`{kind}`")
            (stage / MARKER).write_text(json.dumps({"kind": kind}) + "\n")
        except OSError as e:
            shutil.rmtree(stage, ignore_errors=True)
            if e.errno in _FULL:
                raise DiskFullError(
                    f"no space left writing {e.filename or stage}: {out} is unchanged; free space and rerun"
                ) from None
            raise
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        swap_in(stage, out, ours)
    finally:
        lock_path.unlink(missing_ok=True)  # while held: a waiter re-checks the inode
        os.close(fd)
