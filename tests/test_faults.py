"""Fault injection: SIGKILL at random moments of write, finalize and export-saev; a full
disk during write; damaged chunk files; readers racing a writer.

Every kill trial must leave the old state or the new one (never partial data visible to a
reader) and a rerun must complete. Each stage runs ACTSTORE_FAULT_TRIALS trials (default
20) and prints its counts. Kill moments come from a seeded RNG (ACTSTORE_FAULT_SEED).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import faultlib as F
import numpy as np
import pytest

from actstore import ActStore, finalize
from actstore.errors import DiskFullError
from actstore.verify import verify_store
from actstore.write.finalize import load_manifest

pytestmark = pytest.mark.slow  # writers killed mid-write, full disks, readers racing finalize

TRIALS = int(os.environ.get("ACTSTORE_FAULT_TRIALS", "20"))
SEED = int(os.environ.get("ACTSTORE_FAULT_SEED", "20251122"))
N0, N1 = 8, 24
SH1 = "shards/shard-00001.zarr"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Shard 0 with N0 examples, finalized."""
    root = tmp_path_factory.mktemp("faults") / "base"
    F.write_shard(root, 0, N0)
    finalize(root)
    return root


@pytest.fixture(scope="module")
def base_plus(base, tmp_path_factory) -> Path:
    """`base` plus shard 1 (N1 examples) complete but not yet finalized."""
    root = F.copy_store(base, tmp_path_factory.mktemp("faults") / "plus")
    F.write_shard(root, 1, N1)
    return root


def _say(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n[fault suite] {line}", flush=True)


def _median(xs) -> float:
    """Work time of a stage: the median of calibration runs (machines under load vary)."""
    return sorted(xs)[1]


def _errors(root) -> list:
    return verify_store(root, deep=True).errors


def test_sigkill_during_write(base, tmp_path, capsys):
    duration = _median(
        F.run_to_end("write", str(F.copy_store(base, tmp_path / f"calib{i}")), "1", str(N1)) for i in range(3)
    )
    rng = random.Random(SEED)
    outcomes, prefixes = Counter(), []
    for t in range(TRIALS):
        root = F.copy_store(base, tmp_path / f"w{t}")
        outcomes["killed mid-work"] += F.kill_after(
            F.spawn("write", str(root), "1", str(N1)), rng.uniform(0, 1.1 * duration)
        )
        st = ActStore(root)  # readers see the old manifest: shard 0 only, intact
        assert len(st) == N0
        np.testing.assert_array_equal(st[N0 - 1, 7], F.expected(0, N0 - 1, 7))
        assert _errors(root) == []
        sdir = root / SH1
        if not sdir.exists():
            outcomes["before the shard existed"] += 1
        else:
            rec = json.loads((sdir / "meta/commit.json").read_text())
            n = rec["n_committed"]
            prefixes.append(n)
            outcomes["complete" if rec["complete"] else "at a committed prefix"] += 1
            if 0 < n:  # the committed prefix is exactly what was written
                peek = F.copy_store(root, tmp_path / f"peek{t}")
                finalize(peek, allow_partial=True)
                F.check_store_values(peek, {0: N0, 1: n})
                assert _errors(peek) == []
                shutil.rmtree(peek)
        F.write_shard(root, 1, N1)  # the rerun resumes and completes
        finalize(root)
        F.check_store_values(root, {0: N0, 1: N1})
        assert _errors(root) == []
        outcomes["reruns completed"] += 1
        shutil.rmtree(root)
    _say(
        capsys,
        f"write: {TRIALS} SIGKILL trials (work {duration:.3f}s): {dict(outcomes)}; committed prefixes seen {sorted(set(prefixes))}",
    )
    assert outcomes["reruns completed"] == TRIALS >= 20 and outcomes["killed mid-work"] >= TRIALS // 4


def test_sigkill_during_finalize(base, base_plus, tmp_path, capsys):
    calib = F.copy_store(base_plus, tmp_path / "calib")
    duration = _median(F.run_to_end("finalize", str(calib)) for _ in range(3))
    old_stats, new_stats = ActStore(base).stats(), ActStore(calib).stats()
    rng = random.Random(SEED + 1)
    outcomes = Counter()
    for t in range(TRIALS):
        root = F.copy_store(base_plus, tmp_path / f"f{t}")
        outcomes["killed mid-work"] += F.kill_after(F.spawn("finalize", str(root)), rng.uniform(0, 1.2 * duration))
        n = load_manifest(root).n_examples
        assert n in (N0, N0 + N1)
        outcomes["old manifest" if n == N0 else "new manifest"] += 1
        st = ActStore(root, verify="deep")
        F.check_store_values(root, {0: N0} if n == N0 else {0: N0, 1: N1})
        want = old_stats if n == N0 else new_stats  # the statistics belong to the manifest that names them
        np.testing.assert_array_equal(st.stats().count, want.count)
        np.testing.assert_allclose(st.stats().mean, want.mean)
        finalize(root)
        assert load_manifest(root).n_examples == N0 + N1 and _errors(root) == []
        outcomes["reruns completed"] += 1
        shutil.rmtree(root)
    _say(capsys, f"finalize: {TRIALS} SIGKILL trials (work {duration:.3f}s): {dict(outcomes)}")
    assert outcomes["reruns completed"] == TRIALS >= 20 and outcomes["killed mid-work"] >= TRIALS // 4


def test_sigkill_during_export_saev(base_plus, tmp_path, capsys):
    from actstore.saev import export_saev, verify_saev

    store = F.copy_store(base_plus, tmp_path / "store")
    finalize(store)
    duration = _median(F.run_to_end("export-saev", str(store), str(tmp_path / f"calib{i}")) for i in range(3))
    (ref,) = [p for p in (tmp_path / "calib0").iterdir()]
    ref_files = {p.name: p.read_bytes() for p in ref.iterdir()}
    rng = random.Random(SEED + 2)
    outcomes = Counter()
    for t in range(TRIALS):
        dump = tmp_path / f"d{t}"
        outcomes["killed mid-work"] += F.kill_after(
            F.spawn("export-saev", str(store), str(dump)), rng.uniform(0, 1.2 * duration)
        )
        visible = [p for p in dump.iterdir() if not p.name.startswith(".")] if dump.exists() else []
        if visible:  # published: complete and identical, never a partial directory
            assert [p.name for p in visible] == [ref.name]
            assert verify_saev(visible[0]).problems == []
            assert {p.name: p.read_bytes() for p in visible[0].iterdir()} == ref_files
            outcomes["published"] += 1
        else:
            outcomes["nothing visible"] += 1
        out = export_saev(store, dump, **F.saev_kwargs())
        assert {p.name: p.read_bytes() for p in out.path.iterdir()} == ref_files
        assert [p.name for p in dump.iterdir()] == [ref.name]  # the killed build's temporary folder is gone
        outcomes["reruns completed"] += 1
        shutil.rmtree(dump, ignore_errors=True)
    _say(capsys, f"export-saev: {TRIALS} SIGKILL trials (work {duration:.3f}s): {dict(outcomes)}")
    assert outcomes["reruns completed"] == TRIALS >= 20 and outcomes["killed mid-work"] >= TRIALS // 4


@pytest.mark.parametrize(
    "limit, doing, then",
    [
        (
            100,
            "writing chunk files of shard 0",
            "this batch of 4 examples was not added; the shard keeps its last commit (8 examples). "
            "Free space, then append again, or reopen with ShardWriter(..., shard=0, resume=True)",
        ),
        (
            1000,
            "committing shard 0",
            "the shard keeps its last commit (8 examples); the 4 examples appended since were not committed. "
            "Free space, then continue with ShardWriter(..., shard=0, resume=True)",
        ),
    ],
)
def test_full_disk_during_write_is_clear_and_resumable(tmp_path, limit, doing, then):
    """RLIMIT_FSIZE in a subprocess: the kernel refuses writes past `limit` bytes (EFBIG)."""
    root = tmp_path / "s"
    proc = F.spawn("write-fsize", str(root), "0", "20", "8", str(limit))
    F.wait_ready(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    line = out.splitlines()[0]
    assert line.startswith(f"DiskFullError {errno.EFBIG} out of disk space while {doing} of {root} (File too large")
    assert line.endswith(f"); {then}")
    with F.writer(root, 0, resume=True) as w:
        assert w.n_committed == 8
        F.append_range(w, 0, 8, 20)
    finalize(root)
    F.check_store_values(root, {0: 20})
    assert _errors(root) == []


def test_enospc_mid_append_leaves_a_consistent_writer(tmp_path, monkeypatch):
    from actstore.storage import LocalStorage

    real, calls, failed = LocalStorage.put, [], []

    def full_on_call_60(self, key, *parts, atomic=True, **kw):
        # 8 chunk files per example (prompt 2 layers x 3, response 2 x 1), 4 per batch: call 60
        # is in the second batch's response segment, after its prompt chunks were written
        if not atomic:  # chunk files are written in place; records and metadata atomically
            calls.append(key)
            if len(calls) == 60:  # as a real put says it: naming the file (LocalStorage names every write's)
                failed.append(self.path(key))
                raise OSError(errno.ENOSPC, "No space left on device", self.path(key))
        real(self, key, *parts, atomic=atomic, **kw)

    monkeypatch.setattr(LocalStorage, "put", full_on_call_60)
    root = tmp_path / "s"
    w = F.writer(root, 0)
    F.append_range(w, 0, 0, 4)
    with pytest.raises(DiskFullError) as ei:
        F.append_range(w, 0, 4, 8)
    assert str(ei.value) == (
        f"out of disk space while writing chunk files of shard 0 of {root} (No space left on device: "
        f"{failed[0]}); this batch of 4 examples "
        "was not added; the shard keeps its last commit (4 examples). Free space, then append again, or reopen with "
        "ShardWriter(..., shard=0, resume=True)"
    )
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC and w.n_written == 4
    monkeypatch.setattr(LocalStorage, "put", real)  # space freed: the same batch goes in again
    F.append_range(w, 0, 4, 12)
    w.close()
    finalize(root)
    F.check_store_values(root, {0: 12})
    assert _errors(root) == []
    ref = tmp_path / "ref"  # counters and statistics exclude the failed attempt
    F.write_shard(ref, 0, 12)
    finalize(ref)
    a, b = ActStore(root).stats(), ActStore(ref).stats()
    np.testing.assert_array_equal(a.count, b.count)
    np.testing.assert_allclose(a.m2, b.m2)


def test_enospc_at_commit_closes_the_writer_and_resume_continues(tmp_path, monkeypatch):
    from actstore.storage import LocalStorage

    root = tmp_path / "s"
    w = F.writer(root, 0)
    F.append_range(w, 0, 0, 4)
    real = LocalStorage.put

    def full(self, key, *parts, atomic=True, **kw):
        if atomic:  # the commit's writes (per-sample arrays, records); chunk files go in place
            raise OSError(errno.ENOSPC, "No space left on device", self.path(key))
        real(self, key, *parts, atomic=atomic, **kw)

    monkeypatch.setattr(LocalStorage, "put", full)
    with pytest.raises(DiskFullError) as ei:
        F.append_range(w, 0, 4, 8)
    assert str(ei.value).startswith(
        f"out of disk space while committing shard 0 of {root} (No space left on device: {root}/"
    )
    assert str(ei.value).endswith(
        "); the shard keeps its last commit (4 examples); the 4 examples appended since were not committed. "
        "Free space, then continue with ShardWriter(..., shard=0, resume=True)"
    )
    with pytest.raises(ValueError, match="is closed"):
        w.append(np.zeros((1, 2, 12, 16)), response=np.zeros((1, 2, 5, 16)))
    monkeypatch.undo()
    F.write_shard(root, 0, 10)
    finalize(root)
    F.check_store_values(root, {0: 10})
    assert _errors(root) == []


@pytest.mark.parametrize("damage", ["truncated", "zero-filled", "bit-flipped"])
def test_damaged_chunk_files_are_found_by_deep_verify(base, tmp_path, damage):
    rng = random.Random(f"{SEED}-{damage}")
    root = F.copy_store(base, tmp_path / "s")
    # chunk files holding data (a padding-only chunk is all zeros already)
    chunks = sorted(
        p for p in (root / "shards/shard-00000.zarr/arrays").glob("*_activations/*.*.*.0") if any(p.read_bytes())
    )
    for target in rng.sample(chunks, 3):
        size = target.stat().st_size
        if damage == "truncated":
            F.truncate(target, rng.randrange(size))
        elif damage == "zero-filled":
            F.zero_fill(target)
        else:
            F.flip_bit(target, rng.randrange(size), rng.randrange(8))
        ex, lp = (int(x) for x in target.name.split(".")[:2])
        seg = target.parent.name.removesuffix("_activations")
        found = verify_store(root, deep=True).errors
        assert [(p.example, p.layer, p.segment) for p in found] == [(ex, F.LAYERS[lp], seg)], (damage, target)
        assert found[0].path.startswith(f"shards/shard-00000.zarr/arrays/{seg}_activations/{ex}.{lp}.")
        shutil.copyfile(base / target.relative_to(root), target)  # repair, next target
    assert verify_store(root, deep=True).problems == []


class _Reads:
    """A map-style dataset: each item opens the store afresh and checks one example."""

    def __init__(self, root: Path, n: int):
        self.root, self.n = root, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        st = ActStore(self.root)
        ok = all(np.array_equal(st[i, layer], F.expected(0, i, layer)) for layer in F.LAYERS)
        return i, len(st), ok, st.sample(i)["sample_key"]


@pytest.mark.torch  # a DataLoader
def test_dataloader_readers_never_see_a_shard_before_finalize(base, tmp_path):
    from torch.utils.data import DataLoader

    root = F.copy_store(base, tmp_path / "s")
    n1 = 60
    proc = F.spawn("write", str(root), "1", str(n1), "--sleep", "0.1")
    F.wait_ready(proc)
    commit = root / SH1 / "meta/commit.json"
    deadline = time.monotonic() + 60
    while not (commit.exists() and json.loads(commit.read_text())["n_committed"] > 0):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    committed_before = json.loads(commit.read_text())["n_committed"]
    loader = DataLoader(
        _Reads(root, N0), batch_size=1, num_workers=8, collate_fn=lambda b: b[0], multiprocessing_context="fork"
    )
    seen = []
    for _epoch in range(2):
        for i, n, ok, key in loader:
            assert (n, ok, key) == (N0, True, f"0-{i}")
            seen.append(i)
    writer_was_running = proc.poll() is None or json.loads(commit.read_text())["n_committed"] > committed_before
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert sorted(seen) == sorted(list(range(N0)) * 2) and writer_was_running
    assert len(ActStore(root)) == N0  # written and closed, but not finalized: still invisible
    finalize(root)
    F.check_store_values(root, {0: N0, 1: n1})


def test_full_disk_during_finalize_keeps_the_previous_manifest(base_plus, tmp_path, monkeypatch):
    from actstore.storage import LocalStorage

    root = F.copy_store(base_plus, tmp_path / "s")
    before = (root / "manifest.json").read_bytes()
    real_put = LocalStorage.put

    def full(self, key, *parts, **kw):
        if key == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, key, *parts, **kw)

    monkeypatch.setattr(LocalStorage, "put", full)
    with pytest.raises(DiskFullError) as ei:
        finalize(root)
    assert str(ei.value) == (
        f"out of disk space while finalizing {root} (No space left on device writing {root}/manifest.json); the previous "
        f"manifest is unchanged. Free space, then rerun `actstore finalize {root}`"
    )
    assert (root / "manifest.json").read_bytes() == before and len(ActStore(root)) == N0
    monkeypatch.undo()
    finalize(root)
    F.check_store_values(root, {0: N0, 1: N1})
