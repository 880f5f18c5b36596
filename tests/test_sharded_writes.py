"""Zarr-sharded stores written directly: background shard-file writes, commits that cover a
partly filled shard, resume from such a commit, a failed background write, and batches
that reuse the caller's buffer (every buffered path copies what it keeps)."""

from __future__ import annotations

import errno
import json

import numcodecs
import numpy as np
import pytest
import zarr

from actstore import ActStore, ShardWriter, finalize
from actstore.errors import DiskFullError
from actstore.verify import verify_store

LAYERS, D, P, R = [0, 3], 8, 6, 4
SEG = {"prompt": P, "response": R}


def batch(seed: int, b: int):
    """A (prompt, response, lengths, source_lengths) batch; some examples truncated."""
    rng = np.random.default_rng(seed)
    src = {"prompt": rng.integers(1, P + 3, b), "response": rng.integers(0, R + 1, b)}
    lens = {k: np.minimum(v, SEG[k]) for k, v in src.items()}
    acts = {}
    for k, t in SEG.items():
        x = rng.standard_normal((b, len(LAYERS), t, D)).astype(np.float16)
        for i in range(b):
            x[i, :, lens[k][i] :] = 0
        acts[k] = x
    return acts, lens, src


def writer(path, **kw) -> ShardWriter:
    return ShardWriter(
        path, shard=0, layers=LAYERS, d_model=D, segments=SEG, zarr_format=3, shard_examples=8, stats=True, **kw
    )


def append(w: ShardWriter, seeds_sizes) -> None:
    for seed, b in seeds_sizes:
        acts, lens, src = batch(seed, b)
        w.append(prompt=acts["prompt"], response=acts["response"], lengths=lens, source_lengths=src)


def expected(seeds_sizes) -> list[np.ndarray]:
    out = []
    for seed, b in seeds_sizes:
        acts, lens, _ = batch(seed, b)
        for i in range(b):
            out.append(
                [
                    np.concatenate(
                        [acts["prompt"][i, lp, : lens["prompt"][i]], acts["response"][i, lp, : lens["response"][i]]]
                    )
                    for lp in range(len(LAYERS))
                ]
            )
    return out


def check(root, plan) -> ActStore:
    st = ActStore(root)
    exp = expected(plan)
    assert len(st) == len(exp)
    for ex, rows in enumerate(exp):
        for lp, layer in enumerate(LAYERS):
            np.testing.assert_array_equal(st[ex, layer], rows[lp])
    assert verify_store(root, deep=True).errors == []
    return st


PLAN = [(1, 5), (2, 2), (3, 3), (4, 9), (5, 1), (6, 4)]  # 24 examples; shards of 8


def test_commit_inside_a_shard_then_resume_equals_one_run(tmp_path):
    ref = tmp_path / "ref"
    with writer(ref, commit_bytes=2**40) as w:
        append(w, PLAN)
    finalize(ref)

    root = tmp_path / "s"
    w = writer(root, commit_bytes=2**40)
    append(w, PLAN[:2])
    w.commit()  # 7 examples: shard file 0 holds a partial shard
    shard_file = root / "shards/shard-00000.zarr/arrays/prompt_activations/c/0/0/0/0"
    assert shard_file.exists()
    z = zarr.open_array(str(root / "shards/shard-00000.zarr/arrays/prompt_activations"), mode="r")
    assert z.shape[0] == 7
    np.testing.assert_array_equal(z[6, 1], batch(2, 2)[0]["prompt"][1, 1])
    append(w, PLAN[2:4])  # 12 more, never committed: the "crash" loses them
    del w

    w = writer(root, resume=True, commit_bytes=2**40)
    assert (w.n_committed, w.truncated) == (7, {"prompt": _trunc(PLAN[:2], "prompt"), "response": 0})
    append(w, PLAN[2:])
    w.close()
    finalize(root)
    st = check(root, PLAN)
    want = ActStore(ref)
    assert (
        st.meta["truncation"]["prompt"]["count"]
        == want.meta["truncation"]["prompt"]["count"]
        == _trunc(PLAN, "prompt")
        > 0
    )
    a, b = st.stats(), want.stats()
    np.testing.assert_array_equal(a.count, b.count)
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12)
    np.testing.assert_allclose(a.m2, b.m2, rtol=1e-9)


def _trunc(plan, seg: str) -> int:
    return sum(int(np.count_nonzero(batch(s, b)[2][seg] > SEG[seg])) for s, b in plan)


def test_automatic_commits_prefer_a_filled_shard(tmp_path):
    root = tmp_path / "s"
    ex_bytes = len(LAYERS) * (P + R) * D * 2
    with writer(root, commit_bytes=6 * ex_bytes) as w:
        append(w, [(10 + i, 4) for i in range(8)])  # 32 examples; a shard fills every 2 batches
        blocks = (root / "shards/shard-00000.zarr/meta/blocks.jsonl").read_text().splitlines()
    stops = [json.loads(b)["stop"] for b in blocks]
    assert stops[:-1] and all(s % 8 == 0 for s in stops)  # every automatic commit at a shard boundary
    finalize(root)
    check(root, [(10 + i, 4) for i in range(8)])


def test_failed_background_write_is_a_clear_error_and_resume_continues(tmp_path, monkeypatch):
    from actstore.storage import LocalStorage

    root = tmp_path / "s"
    w = writer(root, commit_bytes=2**40)
    append(w, PLAN[:3])  # 10 examples
    w.commit()
    real = LocalStorage._write_file

    def full(self, path, parts, durable, writeback):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(LocalStorage, "_write_file", full)
    with pytest.raises(DiskFullError) as ei:
        append(w, PLAN[3:4])  # 9 examples fill shard 1: its background write fails
        w.commit()
    assert str(ei.value).startswith(
        f"out of disk space while writing shard files of shard 0 of {root} (No space left on device: "
    )
    assert str(ei.value).endswith(
        "); the shard keeps its last commit (10 examples); the 9 examples appended since were not committed. "
        "Free space, then continue with ShardWriter(..., shard=0, resume=True)"
    )
    assert ei.value.errno == errno.ENOSPC
    with pytest.raises(ValueError, match="is closed"):
        append(w, PLAN[5:])
    monkeypatch.setattr(LocalStorage, "_write_file", real)
    with writer(root, resume=True, commit_bytes=2**40) as w:
        assert w.n_committed == 10
        append(w, PLAN[3:])
    finalize(root)
    check(root, PLAN)


@pytest.mark.parametrize(
    "kw",
    [
        dict(zarr_format=3, shard_examples=4),
        dict(zarr_format=2, compressor=numcodecs.Zstd()),
        dict(zarr_format=3, shard_examples=4, compressor=zarr.codecs.ZstdCodec()),
    ],
    ids=["sharded-direct", "zarr-v2-zstd", "zarr-v3-sharded-zstd"],
)
def test_buffered_writes_copy_a_reused_caller_buffer(tmp_path, kw):
    root = tmp_path / "s"
    buf = np.empty((3, 2, 5, D), np.float16)
    want = []
    with ShardWriter(root, shard=0, layers=[1, 2], d_model=D, tokens=5, commit_bytes=2**40, **kw) as w:
        for i in range(5):
            buf[:] = np.random.default_rng(i).standard_normal(buf.shape)  # the caller refills one buffer
            want.append(buf.copy())
            w.append(buf)
    finalize(root)
    st = ActStore(root)
    want = np.concatenate(want)
    for ex in range(len(want)):
        for lp, layer in enumerate([1, 2]):
            np.testing.assert_array_equal(st[ex, layer], want[ex, lp])


def test_writeback_thread_starts_each_file_and_closes_its_descriptor(tmp_path, monkeypatch):
    import os

    from actstore.storage import durable, local

    started = []
    real = durable.sync_file_range
    if real is None:  # a system without sync_file_range: puts then never hand files over
        pytest.fail("this Linux test machine should have sync_file_range")
    import threading

    def spy(fd, off, n, flags):
        started.append((os.fstat(fd).st_ino, threading.current_thread().name))
        return real(fd, off, n, flags)

    monkeypatch.setattr(durable, "sync_file_range", spy)
    storage = local.LocalStorage(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    wb = local.FileWriteback(depth=2)
    payloads = {tmp_path / f"f{i}": os.urandom(1000 + i) for i in range(20)}
    for path, data in payloads.items():
        storage.put(path.name, memoryview(data), memoryview(b"tail"), writeback=wb)
    wb.close()
    assert len(os.listdir("/proc/self/fd")) == before  # every descriptor handed over was closed
    assert sorted(i for i, _ in started) == sorted(p.stat().st_ino for p in payloads)  # each file's writeback started
    assert {name for _, name in started} == {"actstore-writeback"}  # on the writeback thread
    assert all(p.read_bytes() == data + b"tail" for p, data in payloads.items())
