"""Publishing an output folder whole: its files are written staged, then swapped in with
the manifest-like file that vouches for them (meta.json), so a failed run keeps the older
output and partial files never become visible.

- A local folder OUT: the files go to a stage beside it (actstore.storage.swap, the one
  publication step), with hard links to whatever else OUT holds (files this output does not
  own are kept), which is then exchanged with OUT in one step (renameat2 RENAME_EXCHANGE:
  readers see the old folder or the new one, never a mix; where the file system cannot
  exchange, two renames); the old folder is then removed (every file of it this output
  does not own is in the new one). What a killed run left is settled by the next one.
- An object-store prefix: the files are uploaded under `OUT/.staging-*/` first (a failure
  there leaves the older output as it was); then meta.json is deleted, the files are put
  under their names (from memory) and meta.json last; the staged copies are deleted.

An OS error while writing names the final file the staged one stands for.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from actstore.errors import FeatureError
from actstore.storage import Storage
from actstore.storage.swap import make_stage, recover, swap_in


def publish(storage: Storage, files: dict[str, bytes], last: str, owned: set[str]) -> None:
    """Replace the output at `storage` by `files` (name -> bytes), `last` published last.

    Args:
        storage: the output folder or prefix.
        files: every file of the new output (`last` among them).
        last: the file whose presence says the output is complete (meta.json).
        owned: the names an output of this kind holds: anything else in a local folder is
            carried into the new one (hard links: no data copied).
    """
    root = storage.local_root
    if root is not None:
        _publish_folder(Path(root), files, last, owned)
    else:
        _publish_prefix(storage, files, last)


def _publish_folder(root: Path, files: dict[str, bytes], last: str, owned: set[str]) -> None:
    if root.exists() and not root.is_dir():
        raise FeatureError(f"{root} is a file: give --out a folder (or a new name)")
    root.parent.mkdir(parents=True, exist_ok=True)
    recover(root, _carried)
    staging = make_stage(root)
    try:
        for name in sorted(files, key=lambda n: n == last):  # `last` written last
            _write(staging / name, files[name], root / name)
        if root.is_dir():
            _carry(root, staging, owned | set(files))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    swap_in(staging, root, _carried)


def _carried(old: Path) -> bool:
    """An output folder swapped out is deleted: every file of it this output does not own
    was carried into the new one (hard links) before the swap."""
    return True


def _carry(root: Path, staging: Path, owned: set[str]) -> None:
    """Hard-link everything of `root` that this output does not own into `staging` (a copy
    where links cannot be made): the swap keeps a user's other files."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)

    for entry in os.scandir(root):
        if entry.name in owned or ".staging-" in entry.name:
            continue
        dst = staging / entry.name
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=link)
        else:
            link(entry.path, str(dst))


def _write(path: Path, data: bytes, final: Path) -> None:
    """Write one staged file; an OS error names the file it stands for (the caller maps a
    full disk to DiskFullError: actstore.storage.files.export_os_errors)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        e.filename = str(final)
        raise


def _publish_prefix(storage: Storage, files: dict[str, bytes], last: str) -> None:
    stage = f".staging-{os.getpid()}-{uuid.uuid4().hex[:8]}/"
    try:
        for name, data in files.items():
            try:
                storage.put(stage + name, data)
            except OSError as e:
                e.filename = e.filename or storage.where(name)  # the file the staged one stands for
                raise
    except BaseException:
        _forget(storage, stage)
        raise
    if storage.exists(last):
        storage.delete(last)  # the old meta.json must not vouch for the new tables mid-swap
    for name, data in files.items():
        if name != last:
            storage.put(name, data)
    storage.put(last, files[last])
    _forget(storage, stage)


def _forget(storage: Storage, stage: str) -> None:
    try:
        storage.delete_prefix(stage)
    except OSError:
        pass  # left-over staged copies are harmless: no reader looks under .staging-*
