"""Atomic publication of a saev `<HASH>` directory (and of an export-saelens folder):
built in a stage beside the target, then swapped in by actstore.storage.swap, the one
publication step. A killed build leaves only a hidden stage (or the old directory under a
hidden name), which the next build of the same target settles.
"""

from __future__ import annotations

from pathlib import Path

from actstore.layout import saevspec as P
from actstore.storage.swap import make_stage, recover, swap_in


def temp_dir(parent: Path, name: str) -> Path:
    """Create and return a fresh marked stage for `parent/name`."""
    return make_stage(parent / name)


def remove_stale(parent: Path, name: str, marker: str = P.METADATA_FILE) -> list[Path]:
    """Settle what killed builds of `parent/name` left (dead processes of this host); returns
    the folders kept as `name.replaced-*` (they hold no `marker` file: not an export)."""
    return recover(parent / name, _ours(marker))


def publish(tmp: Path, target: Path, *, replace: bool, marker: str = P.METADATA_FILE) -> bool:
    """Make the stage `tmp` the directory `target`. Returns False (leaving both) when
    `target` exists and not `replace`. With `replace`, the old directory is swapped out
    atomically and deleted when it holds `marker` (an earlier export), else kept as
    `target.replaced-*`."""
    if not replace and (target.exists() or target.is_symlink()):
        return False
    try:
        swap_in(tmp, target, _ours(marker))
    except OSError:
        if replace or not target.exists():
            raise
        return False  # another process published the same target meanwhile
    return True


def _ours(marker: str):
    return lambda folder: (folder / marker).is_file()
