"""saev directories read by SaevStore (actstore.open), verify-saev and import-saev: special
files, hostile JSON and absurd counts give the project's error or a listed problem, never
a hang, a traceback or a huge allocation."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc

import pytest
from factory import vit_store
from hostile import everything, outcome, run_cli, same

import actstore
from actstore.saev import export_saev, verify_saev


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hsaev")
    store = vit_store(tmp / "s", n=7)
    ex = export_saev(store, tmp / "x" / "saev" / "shards", protocol="2.1", patches_per_shard=30, progress=False)
    return ex.path, everything(ex.path)


@pytest.fixture
def saev_dir(export, tmp_path):
    dst = tmp_path / "saev" / "shards" / export[0].name
    shutil.copytree(export[0], dst)
    for p in dst.iterdir():
        os.chmod(p, 0o644)
    return dst


def _all(d, original) -> tuple[str, list[str]]:
    kind, got = outcome(everything, d, what="read")
    if kind == "ok":
        assert same(got, original), "a read returned different values without an error"
    k, rep = outcome(verify_saev, d, values=True, what="verify-saev")
    problems = rep.problems if k == "ok" else [str(rep)]
    run_cli("verify-saev", str(d))
    return kind, problems


@pytest.mark.parametrize("name", ["metadata.json", "shards.json", "acts000000.bin", "acts000002.bin", "labels.bin"])
@pytest.mark.parametrize("kind", ["fifo", "dir", "link"])
def test_special_files_in_a_saev_directory(saev_dir, export, tmp_path, name, kind):
    path = saev_dir / name
    data = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:  # a link to a copy of the same bytes, outside the directory
        (tmp_path / "elsewhere").write_bytes(data)
        path.symlink_to(tmp_path / "elsewhere")
    read, problems = _all(saev_dir, export[1])
    assert read == "error" and problems
    code, out = run_cli("import-saev", str(saev_dir), str(tmp_path / "imported.store"), "--quiet")
    assert code == 1


def test_fifo_shard_file_is_named(saev_dir):
    path = saev_dir / "acts000001.bin"
    path.unlink()
    os.mkfifo(path)
    kind, e = outcome(actstore.open, saev_dir)
    assert kind == "error"
    assert str(e) == f"{path} is a FIFO (named pipe) where a shard file belongs; run `actstore verify-saev {saev_dir}`"
    assert (
        "acts000001.bin: a FIFO (named pipe) where a shard file belongs (readers refuse it)"
        in verify_saev(saev_dir).problems
    )


@pytest.mark.parametrize("name", ["metadata.json", "shards.json"])
def test_nested_json(saev_dir, export, name):
    (saev_dir / name).write_text("[" * 100_000 + "]" * 100_000)
    read, problems = _all(saev_dir, export[1])
    assert read == "error"
    assert f"{name}: not valid UTF-8 JSON (nested deeper than JSON parsing allows)" in problems


def test_absurd_example_count_allocates_nothing(saev_dir, export):
    """n_examples of 10**15 at one example per shard: 10**15 shard counts, listed in full."""
    md = json.loads((saev_dir / "metadata.json").read_text())
    md["n_examples"] = 10**15
    (saev_dir / "metadata.json").write_text(json.dumps(md))
    tracemalloc.start()
    read, problems = _all(saev_dir, export[1])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert read == "error" and peak < 16 * 2**20
    assert "shards.json: lists 3 shards; 1000000000000000 examples at 3 per shard make 333333333333334" in problems
