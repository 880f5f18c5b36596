"""The write pipeline (actstore.write.pipeline): bounded memory, errors on the appending
thread, and the layouts that use it writing exactly what a synchronous writer would."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest

import actstore
from actstore.storage import open_storage
from actstore.write.pipeline import WritePipeline


def test_submit_waits_while_the_bytes_in_flight_exceed_the_bound(tmp_path):
    p = WritePipeline(open_storage(tmp_path), threads=4, max_bytes=100)
    gate = threading.Event()
    in_flight, peak, lock = [0], [0], threading.Lock()

    def write():
        with lock:
            in_flight[0] += 40
            peak[0] = max(peak[0], in_flight[0])
        gate.wait(5)
        with lock:
            in_flight[0] -= 40

    p.submit(write, 40)
    p.submit(write, 40)  # 80 of 100: admitted
    blocked = threading.Thread(target=p.submit, args=(write, 40))
    blocked.start()
    time.sleep(0.3)
    assert blocked.is_alive()  # 120 > 100: waits for a write to finish
    assert p.stats().pending_bytes == 80
    gate.set()
    blocked.join(5)
    p.drain()
    s = p.stats()
    assert (s.pending_bytes, s.written_bytes, s.objects, s.peak_pending_bytes) == (0, 120, 3, 80)
    assert peak[0] <= 80 and s.waited_seconds > 0.2
    p.close()


def test_an_object_larger_than_the_bound_is_admitted_alone(tmp_path):
    p = WritePipeline(open_storage(tmp_path), threads=2, max_bytes=10)
    seen = []
    p.submit(lambda: seen.append(1), 1000)
    p.submit(lambda: seen.append(2), 1000)
    p.drain()
    assert sorted(seen) == [1, 2] and p.stats().peak_pending_bytes == 1000
    p.close()


def test_an_error_is_raised_on_the_appending_thread_and_later_writes_are_skipped(tmp_path):
    p = WritePipeline(open_storage(tmp_path), threads=1)
    released, ran, gate = [], [], threading.Event()

    def fail():
        gate.wait(5)
        raise OSError(errno.ENOSPC, "No space left on device")

    p.submit(fail, 10, done=lambda: released.append("a"))
    p.submit(lambda: ran.append("b"), 10, done=lambda: released.append("b"))  # queued behind it
    gate.set()
    with pytest.raises(OSError) as ei:
        p.drain()
    assert ei.value.errno == errno.ENOSPC
    assert ran == [] and released == ["a", "b"]  # skipped, but its buffer came back
    with pytest.raises(OSError):
        p.submit(lambda: None, 1)  # the error stays until the writer closes
    p.close()


def test_wait_forgets_an_error_that_concerned_only_the_awaited_writes(tmp_path):
    p = WritePipeline(open_storage(tmp_path), threads=2)
    futs = [p.submit(lambda: (_ for _ in ()).throw(OSError(errno.EFBIG, "File too large")), 5)]
    with pytest.raises(OSError, match="File too large"):
        p.wait(futs)
    ran = []
    p.wait([p.submit(lambda: ran.append(1), 5)])  # the next batch goes ahead
    assert ran == [1]
    p.close()


@pytest.mark.parametrize("layout", [{"zarr_format": 2}, {"zarr_format": 3, "shard_examples": 4}])
@pytest.mark.parametrize("threads", [1, 3])
def test_stores_written_with_any_thread_count_are_byte_identical(tmp_path, layout, threads):
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((3, 2, 5, 8)).astype(np.float32) for _ in range(7)]

    def write(path, **kw):
        with actstore.ShardWriter(path, layers=[0, 1], d_model=8, tokens=5, commit_bytes=300, **layout, **kw) as w:
            for b in batches:
                w.append(b)
        actstore.finalize(path)
        return w.io_stats()

    ref = write(tmp_path / "ref", io_threads=1, io_bytes=1)
    got = write(tmp_path / "got", io_threads=threads, io_bytes=2**20)
    assert ref.written_bytes == got.written_bytes
    if layout.get("shard_examples"):  # commits mid-shard write the partial shard file, rewritten once it fills
        assert got.written_bytes > 21 * 160 and got.objects > 21 // 4
    else:  # one write per example, 160 bytes each
        assert (got.written_bytes, got.objects) == (21 * 160, 21)
    files = {p.relative_to(tmp_path / "ref"): p.read_bytes() for p in (tmp_path / "ref").rglob("*") if p.is_file()}
    other = {p.relative_to(tmp_path / "got"): p.read_bytes() for p in (tmp_path / "got").rglob("*") if p.is_file()}
    assert files.keys() == other.keys()
    data = [k for k in files if not k.name.startswith(".") and not k.name.endswith(".json")]  # no timestamps in these
    assert sum("activations" in str(k) for k in data) == (
        6 if layout.get("shard_examples") else 21 * 2
    )  # shard files or chunk files
    for k in data:
        assert files[k] == other[k], k
    want = np.concatenate(batches).astype(np.float16)
    s = actstore.ActStore(tmp_path / "got")
    assert np.array_equal(s[0:21, :], want)


def test_progress_sees_the_pipeline(tmp_path):
    with actstore.ShardWriter(tmp_path / "s", layers=[0], d_model=4, tokens=3, zarr_format=3, shard_examples=2) as w:
        w.append(np.ones((5, 1, 3, 4), np.float16))
        w.commit()
        s = w.io_stats()
    assert s.pending_bytes == 0 and s.objects >= 3 and s.written_bytes >= 5 * 3 * 4 * 2
    from actstore.capture.capture_bar import io_note

    assert io_note([s, s]) == f"write {2 * s.written_bytes / 1e6:,.0f} MB done, 0/1,024 MiB queued"


@pytest.mark.parametrize(
    "layout, data_files, by",
    [({"zarr_format": 2}, 14, "actstore-fsync"), ({"zarr_format": 3, "shard_examples": 4}, 2, "actstore-io")],
)
def test_fsync_syncs_every_data_file_on_the_io_threads(tmp_path, monkeypatch, layout, data_files, by):
    """ShardWriter(fsync=True): each shard file is synced by the thread that wrote it
    (beside the next writes); small chunk files by the commit's group commit, together on
    its threads; never the whole file system (syncfs)."""
    import os

    from actstore.storage import local

    synced: list[tuple[str, str]] = []
    real = os.fsync

    def spy(fd):
        synced.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(local.os, "fsync", spy)
    syncfs = []
    real_syncfs = local.syncfs
    monkeypatch.setattr(local, "syncfs", lambda path: (syncfs.append(str(path)), real_syncfs(path)))
    x = np.arange(7 * 2 * 3 * 4, dtype=np.float16).reshape(7, 2, 3, 4)
    with actstore.ShardWriter(tmp_path / "s", layers=[0, 1], d_model=4, tokens=3, fsync=True, **layout) as w:
        w.append(x)
    meta = (".zarray", ".zattrs", "zarr.json")
    data = [
        (t, p) for t, p in synced if "/tokens_activations/" in p and not os.path.isdir(p) and not p.endswith(meta)
    ]  # data files, not their folders or metadata
    assert len(data) == len({p for _, p in data}) == data_files  # each once (a shard file under its temporary name)
    assert all(t.startswith(by) for t, _ in data)
    assert syncfs == []
    actstore.finalize(tmp_path / "s")
    assert np.array_equal(actstore.ActStore(tmp_path / "s")[0:7, :], x)


def test_resume_ignores_the_empty_folders_a_failed_shard_file_write_left(tmp_path):
    """A put that failed after its folders were made leaves them empty; a resume drops the
    uncommitted tail and must not take such a folder for an object (it raised
    IsADirectoryError, depending on which of the pipeline's writes ran first)."""
    x = np.arange(6 * 2 * 3 * 4, dtype=np.float16).reshape(6, 2, 3, 4)
    with actstore.ShardWriter(tmp_path / "s", layers=[0, 1], d_model=4, tokens=3, zarr_format=3, shard_examples=2) as w:
        w.append(x[:4])
        w.commit()
        left = tmp_path / "s/shards/shard-00000.zarr/arrays/tokens_activations/c/7/0/0"
        left.mkdir(parents=True)
        w._closed = True  # crashed: never closed
        w._layout.close()
        w._lease.release()
    with actstore.ShardWriter(
        tmp_path / "s", layers=[0, 1], d_model=4, tokens=3, zarr_format=3, shard_examples=2, resume=True
    ) as w:
        assert w.n_committed == 4
        w.append(x[4:])
    actstore.finalize(tmp_path / "s")
    assert np.array_equal(actstore.ActStore(tmp_path / "s")[0:6, :], x)
