"""Importers against kills and hostile sources (issue 35), for all three formats (Activault,
SAELens, dictionary_learning), which share one driver: a run killed before its first commit
reruns to the end (the shard holds nothing yet: a fresh start, not "another source");
`--commit-mb` makes a part smaller than one commit resumable; a source's files are read
only inside its folder (a link leading out is refused with that reason, one inside is
followed); an empty dictionary_learning shard imports as no example; token-kind labels of
an export-saelens folder stay token kinds."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import forked
import numpy as np
import pytest
from click.testing import CliRunner
from import_sources import ACTIVAULT_HOOK as AV_HOOK
from import_sources import check_store, saelens_cache, tokens_of, write_cache, write_hook

import actstore
from actstore import ActStore
from actstore.cli import main
from actstore.errors import ImportSourceError
from actstore.importers import import_activault, import_dictionary_learning, import_saelens
from actstore.storage import open_storage

pytestmark = pytest.mark.torch  # Activault megabatches and SAELens caches are torch files

REPO = Path(__file__).resolve().parents[1]


def _activault(tmp: Path) -> tuple[Path, object]:
    files = write_hook(tmp, n_files=2, batch_size=2, batches_per_file=2)
    return tmp / "run" / AV_HOOK, lambda store: check_store(store, files)


def _saelens(tmp: Path) -> tuple[Path, object]:
    acts, ids = saelens_cache(tmp, n_buffers=2)

    def check(store):
        st = ActStore(store)
        assert len(st) == len(acts)
        for r in range(len(acts)):
            np.testing.assert_array_equal(np.asarray(st[r, 4]), acts[r])
            assert st.token_ids(r).tolist() == ids[r].tolist()

    return tmp / "cache", check


def _dictionary_learning(tmp: Path) -> tuple[Path, object]:
    folder, shards = write_cache(tmp, sizes=(40, 30))

    def check(store):
        np.testing.assert_array_equal(tokens_of(ActStore(store), 5), np.concatenate(shards))

    return folder, check


SOURCES = {
    "activault": (_activault, "import-activault", "actstore.importers.activault.ActivaultSource"),
    "saelens": (_saelens, "import-saelens", "actstore.importers.saelens.SaelensSource"),
    "dictionary-learning": (
        _dictionary_learning,
        "import-dictionary-learning",
        "actstore.importers.dictionary_learning.DictionaryLearningSource",
    ),
}

# The import in a child process whose source hangs after its first batch was appended: the
# shard is claimed, holds chunk files, and has no commit (nor the attrs that say whose it is).
KILL_SCRIPT = """
import importlib, sys, time
module, cls = sys.argv[1].rsplit(".", 1)
Source = getattr(importlib.import_module(module), cls)
real = Source.read
def hanging(self, part, start):
    for b in real(self, part, start):
        yield b
        print("appended", flush=True)
        time.sleep(600)
Source.read = hanging
from actstore.cli import main
main([sys.argv[2], sys.argv[3], sys.argv[4], "--workers", "1", "--quiet"])
"""


@pytest.mark.parametrize("kind", list(SOURCES))
def test_an_import_killed_before_its_first_commit_reruns_to_the_end(tmp_path, kind):
    make, command, source_class = SOURCES[kind]
    src, check = make(tmp_path)
    store = tmp_path / "s"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = forked.start("-c", source_class, command, str(src), str(store), code=KILL_SCRIPT, env=env)
    try:
        assert proc.stdout.readline().strip() == "appended"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    shard = open_storage(store).child("shards/shard-00000.zarr")
    assert json.loads(shard.get("meta/commit.json"))["n_committed"] == 0  # claimed, nothing committed
    res = CliRunner().invoke(main, [command, str(src), str(store)])
    assert res.exit_code == 0, res.output
    assert "verified" in res.output and "another source" not in res.output
    check(store)


# The import in a child process whose claim of shard 0 is delayed inside its create-only put:
# the commit record's temporary file is written, its link to meta/commit.json not yet made.
CLAIM_SCRIPT = """
import os, sys, time
real = os.link
def link(src, dst, **kw):
    if str(dst).endswith("shard-00000.zarr/meta/commit.json"):
        print("claiming", flush=True)
        time.sleep(600)
    return real(src, dst, **kw)
os.link = link
from actstore.cli import main
main(["import-saelens", sys.argv[1], sys.argv[2], "--workers", "1", "--quiet"])
"""


def test_import_saelens_killed_inside_the_shard_claim_reruns_to_the_end(tmp_path):
    src, check = _saelens(tmp_path)
    store = tmp_path / "s"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = forked.start("-c", str(src), str(store), code=CLAIM_SCRIPT, env=env)
    try:
        assert proc.stdout.readline().strip() == "claiming"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    meta = store / "shards" / "shard-00000.zarr" / "meta"
    left = os.listdir(meta)
    assert len(left) == 1 and left[0].startswith(".commit.json.tmp-")  # inside the claim: no commit record
    res = CliRunner().invoke(main, ["verify", str(store)])
    assert res.exit_code == 0, res.output  # a recognised state: warnings only
    assert "resumable" in res.output and "killed inside the claim" in res.output
    assert "not a writer shard" not in res.output
    res = CliRunner().invoke(main, ["import-saelens", str(src), str(store)])
    assert res.exit_code == 0, res.output
    assert "verified" in res.output and "not a writer shard" not in res.output
    assert not [n for n in os.listdir(meta) if n.startswith(".")]  # the dead claim's temporary file dropped
    check(store)


@pytest.mark.parametrize("kind", list(SOURCES))
def test_commit_mb_commits_a_part_in_several_blocks(tmp_path, kind):
    make, command, _ = SOURCES[kind]
    src, check = make(tmp_path)
    res = CliRunner().invoke(main, [command, str(src), str(tmp_path / "s"), "--commit-mb", "0.0001", "--quiet"])
    assert res.exit_code == 0, res.output
    check(tmp_path / "s")
    blocks = (tmp_path / "s" / "shards" / "shard-00000.zarr" / "meta" / "blocks.jsonl").read_text().splitlines()
    assert len(blocks) > 1  # a commit every ~100 bytes: a kill loses at most one of them
    bad = CliRunner().invoke(main, [command, str(src), str(tmp_path / "t"), "--commit-mb", "0"])
    assert bad.exit_code == 2 and "--commit-mb" in bad.output


def _data_file(kind: str, src: Path) -> str:
    """The name of the first data file of a source folder."""
    pattern = {"activault": "*.pt", "saelens": "*.arrow", "dictionary-learning": "shard_0.memmap"}[kind]
    return sorted(p.name for p in src.glob(pattern))[0]


def _secret(tmp_path: Path, like: Path) -> Path:
    """A file outside the source folder with the bytes of `like` (as a key file would be)."""
    out = tmp_path / "elsewhere" / like.name
    out.parent.mkdir(exist_ok=True)
    out.write_bytes(like.read_bytes())
    return out


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_data_file_linked_from_outside_the_source_folder_is_refused(tmp_path, kind):
    make, command, _ = SOURCES[kind]
    src, _ = make(tmp_path)
    name = _data_file(kind, src)
    target = _secret(tmp_path, src / name)
    (src / name).unlink()
    (src / name).symlink_to(target)
    res = CliRunner().invoke(main, [command, str(src), str(tmp_path / "s"), "--quiet"])
    assert res.exit_code == 1, res.output
    assert f"{src}/{name} is a symbolic link to {target}, outside the source folder {src}" in res.output
    assert "truncated" not in res.output and not (tmp_path / "s" / "manifest.json").exists()
    for p in (tmp_path / "s").rglob("*"):  # nothing of the file outside reached the store
        assert not p.is_file() or target.read_bytes() not in p.read_bytes() or p.stat().st_size == 0


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_link_that_stays_inside_the_source_folder_is_followed(tmp_path, kind):
    make, command, _ = SOURCES[kind]
    src, check = make(tmp_path)
    name = _data_file(kind, src)
    (src / "data").mkdir()
    (src / name).rename(src / "data" / name)
    (src / name).symlink_to(Path("data") / name)
    res = CliRunner().invoke(main, [command, str(src), str(tmp_path / "s"), "--quiet"])
    assert res.exit_code == 0, res.output
    check(tmp_path / "s")


def test_a_fifo_where_a_data_file_belongs_is_named_not_read(tmp_path):
    folder, _ = write_cache(tmp_path)
    os.remove(folder / "shard_1.memmap")
    os.mkfifo(folder / "shard_1.memmap")
    with pytest.raises(ImportSourceError, match=r"shard_1.memmap is a FIFO \(named pipe\) where a data file belongs"):
        import_dictionary_learning(folder, tmp_path / "s", progress=False)


def test_an_empty_dictionary_learning_shard_imports_as_no_example(tmp_path):
    folder, shards = write_cache(tmp_path, sizes=(23, 17, 0))  # collect's last shard, when the others took every token
    assert (folder / "shard_2.memmap").stat().st_size == 1  # numpy maps zero rows as one byte
    for size in (1, 0):
        (folder / "shard_2.memmap").write_bytes(bytes(size))
        rep = import_dictionary_learning(folder, tmp_path / f"s{size}", progress=False)
        st = ActStore(tmp_path / f"s{size}")
        assert rep.n_parts == 3 and [e.n_examples for e in st.manifest.shards] == [3, 3, 0]
        np.testing.assert_array_equal(tokens_of(st, 5), np.concatenate(shards[:2]))


def test_export_saelens_token_kinds_come_back_as_token_kinds(tmp_path):
    rng = np.random.default_rng(0)
    with actstore.ShardWriter(
        tmp_path / "src",
        layers=[2],
        d_model=4,
        tokens=5,
        token_labels=True,
        token_label_names={0: "content", 1: "special", 2: "template"},
    ) as w:
        w.append(rng.standard_normal((6, 1, 5, 4)), token_labels=rng.integers(0, 3, (6, 5)).astype(np.uint8))
    actstore.finalize(tmp_path / "src")
    from actstore.saelens.export import export_saelens

    export_saelens(
        ActStore(tmp_path / "src"), tmp_path / "exp", layer=2, context_size=4, skip_special=False, progress=False
    )
    import_saelens(tmp_path / "exp", tmp_path / "back", progress=False)
    assert ActStore(tmp_path / "back").config.token_label_names == {0: "content", 1: "special", 2: "template"}


def test_another_source_is_still_refused_once_a_shard_committed(tmp_path):
    src, _ = _activault(tmp_path)
    import_activault(src, tmp_path / "s", progress=False)
    other, _ = _dictionary_learning(tmp_path / "o")
    with pytest.raises(actstore.errors.StoreMismatchError):
        import_dictionary_learning(other, tmp_path / "s", progress=False)
    assert len(ActStore(tmp_path / "s")) == 8  # the store is as the first import left it


def _limited(*args: str) -> subprocess.CompletedProcess:
    """`actstore ARGS` in a process (forked: tests/forked.py) whose files may not grow past 64
    KiB (RLIMIT_FSIZE: the kernel refuses the write with EFBIG, as a full disk refuses it with ENOSPC)."""
    return forked.run_cli(*args, fsize=64 * 1024, timeout=300)


@pytest.mark.parametrize("zarr_format", ["3", "2"])
def test_a_file_size_limit_during_an_import_or_a_copy_names_the_file(tmp_path, zarr_format):
    folder, _ = write_cache(tmp_path, sizes=(5000,), d=6)  # 4096-token examples: 96 KiB a chunk
    store = tmp_path / "s"
    r = _limited(
        "import-dictionary-learning",
        str(folder),
        str(store),
        "--zarr-format",
        zarr_format,
        "--tokens-per-example",
        "4096",
        "--quiet",
    )
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    chunk = r"c/0/0/0/0" if zarr_format == "3" else r"\d+\.0\.0\.0"  # chunk files go up on several threads
    assert re.search(
        rf"\(File too large: {store}/shards/shard-00000\.zarr/arrays/tokens_activations/{chunk}\)", r.stderr
    )
    assert not (store / "manifest.json").exists()
    import_dictionary_learning(folder, store, tokens_per_example=4096, zarr_format=int(zarr_format), progress=False)
    r = _limited("cp", str(store), str(tmp_path / "copy"), "--quiet")
    assert (
        r.returncode == 1
        and f"File too large: '{tmp_path}/copy/shards/shard-00000.zarr/arrays/tokens_activations/" in r.stderr
    )
