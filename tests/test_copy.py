"""`actstore cp` / copy_store: exact copies local <-> S3 (moto), publication order,
refusals, resume after a kill or a failure, read-back verification, the CLI."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import forked
import numpy as np
import pytest
from click.testing import CliRunner
from factory import qa_store

import actstore
from actstore.cli import main
from actstore.copy import MARKER, CopyError, CopyVerifyError, copy_store, transfer
from actstore.errors import NotFinalizedError, StoreMismatchError, StoreNotFoundError
from actstore.storage import LocalStorage, open_storage

LAYERS = [2, 5]
D = 8


def store_files(location) -> dict[str, bytes]:
    """Every object of a store location but temporary ones, by key (local or S3 alike)."""
    st = open_storage(location)
    return {
        e.key: st.get(e.key)
        for e in st.list("")
        if e.kind == "file"
        and not any(
            p.startswith(".") and p not in (".zarray", ".zattrs", ".zgroup", ".zmetadata") for p in e.key.split("/")
        )
    }


def assert_same_reads(a, b) -> None:
    sa, sb = actstore.ActStore(a), actstore.ActStore(b)
    assert len(sa) == len(sb) > 0
    for ex in range(len(sa)):
        for layer in LAYERS:
            x, y = sa[ex, layer], sb[ex, layer]
            assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture
def src(tmp_path) -> Path:
    return qa_store(tmp_path / "src.store")


def test_local_to_s3_to_local_is_exact(tmp_path, s3_url, monkeypatch):
    src = qa_store(tmp_path / "src.store")
    qa_store(src, shards=(2,), finalize=False, seed=7)  # written after finalize: not listed
    (src / "shards" / "shard-00000.zarr" / "meta" / ".commit.json.tmp-1-dead").write_bytes(b"torn")
    expected = {k: v for k, v in store_files(src).items() if not k.startswith("shards/shard-00002.zarr/")}
    # objects over 100 kB go range by range (sample_key/0 is 4 MiB: a multipart upload to S3)
    monkeypatch.setattr(transfer, "STREAM_BYTES", 100_000)
    monkeypatch.setattr(transfer, "RANGE_BYTES", 1_500_000)
    seen = []
    up = copy_store(src, s3_url, workers=3, progress=lambda n, total: seen.append((n, total)))
    assert up.n_copied == len(expected) and up.bytes_copied == sum(map(len, expected.values())) == up.total_bytes
    assert up.unlisted_shards == ("shard-00002.zarr",) and up.n_temporary == 1
    assert up.verified and up.deep_verified is True  # deep-verified in the bucket too
    assert seen[0] == (0, up.total_bytes) and sum(n for n, _ in seen) == up.total_bytes
    assert "shard-00002.zarr" in up.summary() and "1 temporary file left out" in up.summary()
    assert store_files(s3_url) == expected
    assert_same_reads(src, s3_url)

    back = copy_store(s3_url, tmp_path / "back.store", workers=2)
    assert back.deep_verified is True and back.n_copied == len(expected) and not back.unlisted_shards
    assert store_files(tmp_path / "back.store") == expected
    assert not list((tmp_path / "back.store").rglob(".*.tmp-*")) and not (tmp_path / "back.store" / MARKER).exists()
    assert_same_reads(src, tmp_path / "back.store")

    again = copy_store(src, s3_url)  # already there: nothing is written again
    assert again.n_copied == 0 and again.n_present == len(expected)


def test_zarr_format_3_sharded_store_without_texts(tmp_path, s3_url):
    """A Zarr-sharded store whose shards have an empty text/ folder, through S3 and back."""
    src = tmp_path / "v3.store"
    rng = np.random.default_rng(3)
    with actstore.ShardWriter(src, shard=0, layers=LAYERS, d_model=D, tokens=5, zarr_format=3, shard_examples=2) as w:
        w.append(rng.standard_normal((5, 2, 5, D)).astype(np.float16))
    actstore.finalize(src)
    (src / "elsewhere").symlink_to("/etc/hostname")
    up = copy_store(f"file://{src}", s3_url)
    assert up.not_files == ("elsewhere (link)",) and "left out 1 non-file entry: elsewhere (link)" in up.summary()
    back = copy_store(s3_url, tmp_path / "copy.store")
    assert back.deep_verified is True  # the empty text/ folder is made again
    assert store_files(tmp_path / "copy.store") == {k: v for k, v in store_files(src).items() if k != "elsewhere"}
    assert_same_reads(src, tmp_path / "copy.store")


class Recording(LocalStorage):
    """A local DST that records the order of its puts, fails the put `fail` says to, and
    can damage one key's bytes."""

    def __init__(self, root, fail=None, corrupt: str | None = None):
        super().__init__(root)
        self.order: list[str] = []
        self.fail, self.corrupt = fail, corrupt

    def put(self, key, *parts, **kw):
        if self.fail is not None and self.fail(key, len(self.order)):
            raise ConnectionResetError("connection reset by peer (injected)")
        self.order.append(key)
        if key == self.corrupt:
            parts = (bytes(b"".join(bytes(p) for p in parts)[:-1]) + b"\xff",)  # same size, last byte changed
        super().put(key, *parts, **kw)


def test_publication_order(src, tmp_path):
    dst = Recording(tmp_path / "dst.store")
    copy_store(src, dst)
    order = [k for k in dst.order if k != MARKER]
    commits = [i for i, k in enumerate(order) if k.endswith("/meta/commit.json")]
    stats = [i for i, k in enumerate(order) if k.startswith("stats-")]
    assert dst.order[0] == MARKER and order[-1] == "manifest.json" and len(commits) == 2 and len(stats) == 1
    data = [i for i, k in enumerate(order) if k.startswith("shards/") and i not in commits]
    assert max(data) < min(commits) and max(commits) < order.index("actstore.json") < stats[0] < len(order) - 1


def test_source_must_be_finalized(tmp_path):
    qa_store(tmp_path / "raw.store", finalize=False)
    with pytest.raises(
        NotFinalizedError, match=r"raw\.store has writer shards but was never finalized .*run `actstore finalize"
    ):
        copy_store(tmp_path / "raw.store", tmp_path / "dst")
    with pytest.raises(StoreNotFoundError, match=r"nothing is not an actstore store \(no manifest.json\)"):
        copy_store(tmp_path / "nothing", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    with pytest.raises(ValueError, match="one lies inside the other"):
        copy_store(tmp_path / "raw.store", tmp_path / "raw.store" / "copy")


def test_different_stores_are_refused_before_writing(src, tmp_path, s3_url):
    other = qa_store(tmp_path / "other.store", d_model=16)
    before = store_files(other)
    with pytest.raises(
        StoreMismatchError, match=r"already holds a different store \(its actstore.json differs in d_model\)"
    ):
        copy_store(src, other)
    assert store_files(other) == before and not (other / MARKER).exists()

    twin = qa_store(tmp_path / "twin.store", seed=99)  # same configuration, other data
    before = store_files(twin)
    with pytest.raises(
        StoreMismatchError, match="a different store with the same configuration: the block records of its shard-0000"
    ):
        copy_store(src, twin)
    assert store_files(twin) == before

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreMismatchError, match=r"mine holds objects that are not an actstore store: notes.txt"):
        copy_store(src, tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]

    open_storage(s3_url).put("shards/shard-00000.zarr/arrays/x/0", b"old")
    with pytest.raises(StoreMismatchError, match="holds objects that are not an actstore store"):
        copy_store(src, s3_url)


def test_resume_after_sigkill(src, tmp_path, s3_url):
    """A copy to S3 killed (SIGKILL) after 25 objects leaves no readable store; a rerun finishes it."""
    script = (
        "import os, signal, sys\n"
        "from actstore.copy import copy_store\n"
        "done = []\n"
        "def progress(n, total):\n"
        "    done.append(n)\n"
        "    if len(done) > 25:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "copy_store(sys.argv[1], sys.argv[2], progress=progress, workers=2)\n"
    )
    proc = forked.run_code(script, str(src), s3_url, timeout=120)  # a process of its own, actstore imported
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = store_files(s3_url)
    assert 20 <= len(partial) < len(store_files(src)) and "manifest.json" not in partial
    with pytest.raises(NotFinalizedError):
        actstore.ActStore(s3_url)
    res = copy_store(src, s3_url)
    assert res.n_present >= 20 and res.n_copied + res.n_present == len(store_files(src))
    assert store_files(s3_url) == store_files(src)
    assert_same_reads(src, s3_url)


def test_resume_after_failed_puts(src, tmp_path):
    dst = tmp_path / "dst.store"
    twin = qa_store(tmp_path / "twin.store", seed=99)  # same configuration (same actstore.json), other data
    with pytest.raises(
        CopyError, match=r"failed: ConnectionResetError: connection reset by peer \(injected\); rerun the same command"
    ):
        copy_store(twin, Recording(dst, fail=lambda key, n: n == 40), workers=1)
    # an interrupted copy of another source: its objects are compared by content, not trusted by size
    with pytest.raises(CopyError):
        copy_store(src, Recording(dst, fail=lambda key, n: n == 30), workers=1)
    last = "shards/shard-00001.zarr/meta/commit.json"
    with pytest.raises(CopyError):  # now among the commit points: shard 0 is committed, shard 1 not
        copy_store(src, Recording(dst, fail=lambda key, n: key == last), workers=1)
    assert (dst / "shards/shard-00000.zarr/meta/commit.json").exists() and not (dst / last).exists()
    with pytest.raises(NotFinalizedError):
        actstore.ActStore(dst)
    res = copy_store(src, dst)
    n = len(store_files(src))
    assert (res.n_present, res.n_copied) == (n - 4, 4)  # shard 1's commit, actstore.json, stats, manifest
    assert res.deep_verified and store_files(dst) == store_files(src) and not (dst / MARKER).exists()
    assert_same_reads(src, dst)


def test_read_back_catches_damage(src, tmp_path):
    key = "shards/shard-00001.zarr/meta/blocks.jsonl"
    with pytest.raises(
        CopyVerifyError, match=r"blocks.jsonl read back as \d+ bytes with crc32c [0-9a-f]{8}, but .* it was deleted"
    ):
        copy_store(src, Recording(tmp_path / "dst", corrupt=key), workers=1)
    assert not (tmp_path / "dst" / key).exists() and not (tmp_path / "dst" / "manifest.json").exists()
    assert copy_store(src, tmp_path / "dst").n_copied >= 1
    assert store_files(tmp_path / "dst") == store_files(src)


def test_update_of_an_older_copy(tmp_path):
    src = qa_store(tmp_path / "src.store")
    copy_store(src, tmp_path / "dst.store")
    qa_store(src, shards=(2,), seed=5)  # the source grows a shard and is finalized again
    res = copy_store(src, tmp_path / "dst.store")
    assert res.n_copied > 0 and res.n_present > 0
    assert store_files(tmp_path / "dst.store").keys() >= store_files(src).keys()
    assert {k: v for k, v in store_files(tmp_path / "dst.store").items() if k in store_files(src)} == store_files(src)
    assert_same_reads(src, tmp_path / "dst.store")


def test_cli(src, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["cp", str(src), str(tmp_path / "a"), "--json", "--workers", "2"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (
        doc["n_copied"] == len(store_files(src)) and doc["verified"] and doc["deep_verified"] and doc["warnings"] == []
    )
    res = runner.invoke(main, ["cp", str(src), str(tmp_path / "a"), "--no-verify"])
    assert (
        res.exit_code == 0
        and res.stdout.startswith(f"copied {src} to {tmp_path / 'a'}: 0 objects")
        and "not verified" in res.stdout
    )
    assert (
        runner.invoke(main, ["cp", str(src), str(tmp_path / "a"), "--quiet", "--no-verify"]).output == ""
    )  # --quiet: nothing
    qa_store(tmp_path / "raw", finalize=False)
    res = runner.invoke(main, ["cp", str(tmp_path / "raw"), str(tmp_path / "b")])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1
    assert res.stderr.startswith("actstore: error: ") and "run `actstore finalize" in res.stderr
