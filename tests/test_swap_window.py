"""The one publication step (actstore.storage.swap) killed with SIGKILL at each of its steps,
with the atomic exchange and with the two-rename fallback (forced by taking renameat2 away):
a folder actstore did not write is never deleted (the next run keeps it aside, or puts it
back when the target is missing), an old output of ours is deleted, a build never published
is deleted, and the next publication always ends with the new folder at the target."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest

from actstore.features.staging import MARKER, staged_folder
from actstore.features.topk.publish import publish as publish_files
from actstore.saev.publish import publish as publish_dir
from actstore.saev.publish import remove_stale, temp_dir
from actstore.storage import durable, open_storage
from actstore.storage.swap import STAGE_MARKER, recover

KIND = "actstore view"

# The victim: publishes `target` through staged_folder and SIGKILLs itself at `step`:
# "unmarked" (the stage's marker removed, nothing swapped), "exchange" (right after the
# exchange), "rename1" / "rename2" (after the first / second rename of the swap).
VICTIM = r"""
import os, signal, sys
from actstore.storage import durable, swap
from actstore.features.staging import staged_folder
target, step, exchange = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if not exchange:
    durable._renameat2 = None  # a file system without an atomic exchange
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
real_exchange, real_rename, n = swap.exchange_paths, os.rename, [0]
def exchange_paths(a, b):
    if step == "unmarked":
        die()
    done = real_exchange(a, b)
    if done and step == "exchange":
        die()
    return done
def rename(a, b):
    real_rename(a, b)
    n[0] += 1
    if step == f"rename{n[0]}":
        die()
swap.exchange_paths, os.rename = exchange_paths, rename
with staged_folder(target, kind="actstore view", overwrite=True) as stage:
    (stage / "index.html").write_text("the new site")
print("not killed", flush=True)
"""


def _kill_at(target: Path, step: str, exchange: bool) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = forked.run_code(VICTIM, str(target), step, "1" if exchange else "0", env=env, timeout=120)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr[-2000:])


def _theirs(folder: Path) -> Path:
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    (folder / "figs").mkdir()
    (folder / "figs" / "a.png").write_bytes(b"\x89PNG")
    return folder


def _ours(folder: Path) -> Path:
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"kind": KIND}) + "\n")
    (folder / "index.html").write_text("the old site")
    return folder


def _names(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != ".mine.lock")


def _republish(target: Path) -> str:
    """The next publication (the real step, in this process); returns its stderr warning."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        with staged_folder(target, kind=KIND, overwrite=True) as stage:
            (stage / "index.html").write_text("the next site")
    assert (target / "index.html").read_text() == "the next site"
    return err.getvalue()


def _kept(parent: Path) -> Path:
    kept = [p for p in parent.iterdir() if p.name.startswith("mine.replaced-")]
    assert len(kept) == 1, _names(parent)
    assert (kept[0] / "thesis.tex").read_text() == "precious" and (
        kept[0] / "figs" / "a.png"
    ).read_bytes() == b"\x89PNG"
    return kept[0]


@pytest.fixture(params=[True, False], ids=["exchange", "two-renames"])
def exchange(request, monkeypatch):
    if not request.param:
        monkeypatch.setattr(durable, "_renameat2", None)
    else:
        assert durable.exchange_paths is not None and durable._renameat2 is not None
    return request.param


def test_the_swap_window_keeps_a_foreign_folder_renamed_aside(tmp_path, exchange):
    target = _theirs(tmp_path / "mine")
    step = "exchange" if exchange else "rename2"  # the new site in place, the old folder not yet aside
    _kill_at(target, step, exchange)
    assert (target / "index.html").read_text() == "the new site"
    if exchange:  # the user's folder sits under the build's stage name, unmarked
        (stage,) = [p for p in tmp_path.iterdir() if p.name.startswith(".mine.staging-")]
        assert (stage / "thesis.tex").read_text() == "precious" and not (stage / STAGE_MARKER).exists()
    else:  # the fallback renamed it straight to its visible name
        _kept(tmp_path)
    warning = _republish(target)
    kept = _kept(tmp_path)
    assert _names(tmp_path) == sorted(["mine", kept.name])  # nothing hidden left, nothing deleted
    if exchange:
        assert f"the old folder is kept as {kept}" in warning


def test_a_kill_between_the_two_renames_puts_the_folder_back_or_keeps_it(tmp_path):
    target = _theirs(tmp_path / "mine")
    _kill_at(target, "rename1", exchange=False)  # the user's folder aside, the target missing
    assert not target.exists()
    _kept(tmp_path)
    (stage,) = [p for p in tmp_path.iterdir() if p.name.startswith(".mine.staging-")]
    assert (stage / "index.html").read_text() == "the new site" and not (stage / STAGE_MARKER).exists()
    assert recover(target, lambda p: False) == []  # the finished build becomes the target
    assert (target / "index.html").read_text() == "the new site"
    _kept(tmp_path)
    assert _names(tmp_path) == sorted(["mine", _kept(tmp_path).name])


def test_an_old_output_of_ours_is_deleted_and_an_unswapped_build_too(tmp_path, exchange):
    target = _ours(tmp_path / "mine")
    _kill_at(target, "exchange" if exchange else "rename2", exchange)
    assert (target / "index.html").read_text() == "the new site"
    assert _republish(target) == ""
    assert _names(tmp_path) == ["mine"]  # the old output (ours) was deleted: no replaced- copy
    _kill_at(target, "unmarked", exchange)  # a finished build whose swap never started
    assert (target / "index.html").read_text() == "the next site"
    assert _republish(target) == "" and _names(tmp_path) == ["mine"]


def test_a_kill_after_the_old_output_moved_aside_puts_it_back(tmp_path):
    target = _ours(tmp_path / "mine")
    _kill_at(target, "rename1", exchange=False)  # ours: moved to its hidden .old- name
    assert not target.exists()
    hidden = sorted(p.name.split("-")[0] for p in tmp_path.iterdir() if p.name.startswith("."))
    assert hidden == [".mine.lock", ".mine.old", ".mine.staging"]
    assert recover(target, lambda p: (p / MARKER).exists()) == []
    assert (target / "index.html").read_text() == "the old site"  # the old folder first, back at its name
    assert _names(tmp_path) == ["mine"]  # the finished build, unpublished and ours, deleted


def test_a_stage_of_a_live_build_is_left_alone(tmp_path):
    target = tmp_path / "mine"
    stage = temp_dir(tmp_path, "mine")  # this process's: alive
    (stage / "metadata.json").write_text("{}")
    assert remove_stale(tmp_path, "mine") == [] and stage.exists()
    assert publish_dir(stage, target, replace=False) and (target / "metadata.json").exists()
    assert not (target / STAGE_MARKER).exists() and _names(tmp_path) == ["mine"]


def test_export_folders_not_ours_are_kept_by_the_saev_step(tmp_path, exchange):
    target = _theirs(tmp_path / "mine")
    stage = temp_dir(tmp_path, "mine")
    (stage / "metadata.json").write_text("{}")
    assert not publish_dir(stage, target, replace=False)  # refused: the stage is left to the caller
    assert publish_dir(stage, target, replace=True)
    assert (target / "metadata.json").exists() and not (target / STAGE_MARKER).exists()
    kept = _kept(tmp_path)
    stage = temp_dir(tmp_path, "mine")
    (stage / "metadata.json").write_text('{"second": 1}')
    assert publish_dir(stage, target, replace=True)  # an earlier export (ours): deleted
    assert _names(tmp_path) == sorted(["mine", kept.name]) and "second" in (target / "metadata.json").read_text()


def test_the_feature_tables_step_keeps_the_users_files_across_a_fallback_swap(tmp_path, exchange):
    out = _theirs(tmp_path / "mine")
    publish_files(open_storage(out), {"t.parquet": b"1", "meta.json": b"{}"}, "meta.json", {"t.parquet", "meta.json"})
    assert (out / "thesis.tex").read_text() == "precious" and (out / "figs" / "a.png").read_bytes() == b"\x89PNG"
    assert (out / "meta.json").read_bytes() == b"{}" and _names(tmp_path) == ["mine"]
