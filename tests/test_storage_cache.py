"""CachedStorage: a size-bounded local cache of a finalized store's data objects, over a
local folder and over S3 (moto): hits never ask the inner storage, LRU eviction keeps the
byte limit, namespaces and non-cacheable keys are respected, damaged entries are
refetched, and processes sharing one cache directory read exact bytes."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import StorageAccessError
from actstore.storage import KeyNotFound, ObjectStorage, Storage, open_storage
from actstore.storage.cache import CachedStorage, ReadOnlyCacheError
from actstore.storage.cachedir import HEADER, LOW_WATER, RESCAN_FRACTION

MiB = 2**20


def data_only(key: str) -> bool:
    """The kind of predicate the reader passes: data objects yes, JSON records never."""
    return not key.endswith(".json")


class Counting(Storage):
    """Passes every read to `inner` and counts the calls by method."""

    def __init__(self, inner: Storage, calls: Counter | None = None):
        self.inner, self.url, self.calls = inner, inner.url, Counter() if calls is None else calls

    def _call(self, name, *args, **kw):
        self.calls[name] += 1
        return getattr(self.inner, name)(*args, **kw)

    def child(self, prefix):
        return Counting(self.inner.child(prefix), self.calls)  # one count for the whole store

    def get(self, key, *, max_bytes=None):
        return self._call("get", key, max_bytes=max_bytes)

    def get_range(self, key, start, length):
        return self._call("get_range", key, start, length)

    def read_into(self, key, dest, offset=0):
        return self._call("read_into", key, dest, offset)

    def read_object_into(self, key, dest):
        return self._call("read_object_into", key, dest)

    def size(self, key):
        return self._call("size", key)

    def kind(self, key):
        return self._call("kind", key)

    def list(self, prefix=""):
        return self._call("list", prefix)

    def list_dir(self, prefix=""):
        return self._call("list_dir", prefix)

    def zarr_store(self, prefix, *, read_only):
        return self.inner.zarr_store(prefix, read_only=read_only)

    put = put_if_absent = append = truncate = delete = delete_prefix = sync = None


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.dev)])  # s3: moto
def inner(request, tmp_path):
    if request.param == "local":
        return open_storage(tmp_path / "store")
    return open_storage(request.getfixturevalue("s3_url"))


def payload(i: int, n: int = 1000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def entries(cache_dir: Path) -> list[Path]:
    """Every entry file of every namespace (no lock file, no temporary files)."""
    return [p for p in cache_dir.glob("*/*/*") if not p.name.startswith(".")]


def dir_bytes(cache_dir: Path) -> int:
    return sum(p.stat().st_size for p in entries(cache_dir))


def test_first_read_misses_second_hits_without_inner(inner, tmp_path):
    body = payload(1, 5000)
    inner.put("shards/s0/acts/c/0", body)
    inner.put("meta/commit.json", b'{"n": 1}')
    counting = Counting(inner)
    cache = CachedStorage(counting, tmp_path / "cache", max_bytes=MiB, namespace="gen-1", cacheable=data_only)
    key = "shards/s0/acts/c/0"

    def read_all():
        buf, whole = bytearray(100), bytearray(5000)
        out = [
            cache.get(key),
            cache.get_range(key, 10, 100),
            cache.get_range(key, 4990, 100),
            cache.read_into(key, memoryview(buf), 10),
            bytes(buf),
            cache.read_object_into(key, memoryview(whole)),
            bytes(whole),
            cache.size(key),
            cache.exists(key),
        ]
        return out

    assert not cache.read_cached(key, memoryview(bytearray(5000)), 0)
    first = read_all()
    assert first == [body, body[10:110], body[4990:], 100, body[10:110], 5000, body, 5000, True]
    fetched = dict(counting.calls)
    assert fetched == {"get": 1, "get_range": 2, "size": 1}  # read_into and read_object_into hit entries
    assert read_all() == first
    assert counting.calls == fetched  # the second epoch: not one call to inner
    whole, part = bytearray(5000), bytearray(100)
    assert cache.read_cached(key, memoryview(whole), 0) and bytes(whole) == body
    assert cache.read_cached(key, memoryview(part), 10) and bytes(part) == body[10:110]
    assert not cache.read_cached(key, memoryview(bytearray(100)), 20)  # never fetched: no answer
    assert not cache.read_cached(key, memoryview(bytearray(4999)), 0)  # a whole object of another size
    assert counting.calls == fetched
    s = cache.stats()
    assert (s["misses"], s["miss_bytes"]) == (4, 5000 + 100 + 10)
    assert s["hits"] == 3 + 7 + 2 and s["damaged"] == s["errors"] == 0


def test_read_object_into_fills_the_entry_get_uses(inner, tmp_path):
    inner.put("c/0", b"0123456789")
    counting = Counting(inner)
    cache = CachedStorage(counting, tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=data_only)
    small = bytearray(4)
    assert cache.read_object_into("c/0", memoryview(small)) == 10  # a wrong-sized buffer: not cached
    buf = bytearray(10)
    assert cache.read_object_into("c/0", memoryview(buf)) == 10 and bytes(buf) == b"0123456789"
    assert cache.get("c/0") == b"0123456789"
    assert cache.read_object_into("c/0", memoryview(small)) == 10 and bytes(small) == b"0123"  # from the cache
    assert counting.calls == {"read_object_into": 2}


def test_s3_second_epoch_reads_with_the_server_gone(s3_url, tmp_path, monkeypatch):
    warm = open_storage(s3_url)
    for i in range(4):
        warm.put(f"shards/s0/c/{i}", payload(i))
    cache = CachedStorage(warm, tmp_path / "cache", max_bytes=MiB, namespace="gen-1", cacheable=data_only)
    shard = cache.child("shards/s0")
    assert [shard.get(f"c/{i}") for i in range(4)] == [payload(i) for i in range(4)]
    assert shard.size("c/1") == 1000

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    # The endpoint answered before, so refused connections are retried until the deadline
    # (120 s by default): 1 s here, the same give-up path without the wait.
    monkeypatch.setenv("ACTSTORE_RETRY_SECONDS", "1")
    quick = {"max_retries": 0, "retry_timeout": timedelta(seconds=2)}
    dead = ObjectStorage(s3_url, retry_config=quick)
    with pytest.raises(StorageAccessError) as gone:  # the server is gone: named, with the URL
        dead.get("shards/s0/c/0")
    assert "shards/s0/c/0" in str(gone.value) and not isinstance(gone.value, KeyNotFound)
    cold = CachedStorage(dead, tmp_path / "cache", max_bytes=MiB, namespace="gen-1", cacheable=data_only)
    assert [cold.get(f"shards/s0/c/{i}") for i in range(4)] == [payload(i) for i in range(4)]
    assert cold.child("shards").child("s0").size("c/1") == 1000  # child of a child: the same keys
    buf = bytearray(1000)
    assert cold.read_cached("shards/s0/c/3", memoryview(buf)) and bytes(buf) == payload(3)
    assert cold.stats()["hits"] == 6 and cold.stats()["misses"] == 0


def test_non_cacheable_keys_always_go_to_inner(inner, tmp_path):
    inner.put("manifest.json", b"{}")
    counting = Counting(inner)
    cache = CachedStorage(counting, tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=data_only)
    for _ in range(3):
        assert cache.get("manifest.json") == b"{}"
        assert cache.get_range("manifest.json", 0, 1) == b"{"
        assert cache.size("manifest.json") == 2
    assert counting.calls == {"get": 3, "get_range": 3, "size": 3}
    assert not cache.read_cached("manifest.json", memoryview(bytearray(2)))
    assert entries(tmp_path / "cache") == [] and cache.stats()["hits"] == cache.stats()["misses"] == 0


def test_the_predicate_sees_keys_from_the_store_root(tmp_path):
    inner = open_storage(tmp_path / "store")
    inner.put("shards/s0/c/0", b"abc")
    seen = []
    cache = CachedStorage(
        inner, tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=lambda k: seen.append(k) or True
    )
    assert cache.child("shards/").child("s0").get("c/0") == b"abc"
    assert seen == ["shards/s0/c/0"]
    assert cache.get("shards/s0/c/0") == b"abc" and cache.stats()["hits"] == 1  # one entry for both
    assert cache.child("shards").child("").get("s0/c/0") == b"abc" and cache.stats()["hits"] == 2


def test_namespaces_never_serve_each_others_bytes(inner, tmp_path):
    inner.put("c/0", b"generation one")
    one = CachedStorage(inner, tmp_path / "cache", max_bytes=MiB, namespace="url+manifest-1", cacheable=data_only)
    assert one.get("c/0") == b"generation one"
    inner.delete("c/0")
    inner.put("c/0", b"generation two")  # a rewritten store: a new manifest, a new namespace
    two = CachedStorage(inner, tmp_path / "cache", max_bytes=MiB, namespace="url+manifest-2", cacheable=data_only)
    assert two.get("c/0") == b"generation two" and two.stats()["misses"] == 1
    assert one.get("c/0") == b"generation one"  # each namespace its own entries
    assert len(entries(tmp_path / "cache")) == 2 and len(list((tmp_path / "cache").iterdir())) == 3  # 2 ns + lock


def expected_evictions(n_entries: int, entry_bytes: int, max_bytes: int) -> int:
    total, k = n_entries * entry_bytes, 0
    if total > max_bytes:
        while total > int(max_bytes * LOW_WATER):
            total, k = total - entry_bytes, k + 1
    return k


def test_least_recently_used_go_first_and_the_limit_holds(inner, tmp_path):
    keys = [f"c/{i}" for i in range(8)]
    for i, k in enumerate(keys):
        inner.put(k, payload(i))
    entry_bytes = HEADER.size + 1000
    max_bytes = 5 * entry_bytes + 10
    counting = Counting(inner)
    cache = CachedStorage(counting, tmp_path / "cache", max_bytes=max_bytes, namespace="n", cacheable=data_only)
    for k in keys[:5]:  # c/0 .. c/4, c/0 the oldest
        cache.get(k)
    assert dir_bytes(tmp_path / "cache") == 5 * entry_bytes
    assert cache.get(keys[0]) == payload(0)  # a hit: c/0 is now the most recently used
    cache.get(keys[5])  # 6 entries > the limit: the least recently used go
    n_gone = expected_evictions(6, entry_bytes, max_bytes)
    assert n_gone == 2 and cache.stats()["evicted"] == 2 and cache.stats()["evicted_bytes"] == 2 * entry_bytes
    assert dir_bytes(tmp_path / "cache") == 4 * entry_bytes <= max_bytes
    survivors = [k for k in keys[:6] if cache.read_cached(k, memoryview(bytearray(1000)))]
    assert survivors == ["c/0", "c/3", "c/4", "c/5"]  # c/1 and c/2 were least recently used
    for k in keys:  # through every key twice more: never over the limit
        for _ in range(2):
            assert cache.get(k) == payload(int(k[2:]))
            assert dir_bytes(tmp_path / "cache") <= max_bytes


def test_an_object_larger_than_the_cache_is_read_not_cached(tmp_path):
    inner = open_storage(tmp_path / "store")
    inner.put("big", payload(0, 5000))
    cache = CachedStorage(inner, tmp_path / "cache", max_bytes=4096, namespace="n", cacheable=data_only)
    assert cache.get("big") == cache.get("big") == payload(0, 5000)
    assert cache.stats()["skipped"] == 2 and entries(tmp_path / "cache") == []


def test_a_scan_removes_only_stale_temporary_files(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = CachedStorage(
        open_storage(tmp_path / "store"), cache_dir, max_bytes=MiB, namespace="n", cacheable=data_only
    )
    sub = cache_dir / ("ab" * 8) / "cd"
    sub.mkdir(parents=True)
    stale, fresh, foreign = sub / f".{'e' * 40}.tmp-1-0123abcd", sub / f".{'f' * 40}.tmp-2-0123abcd", sub / "notes.txt"
    for p in (stale, fresh, foreign):
        p.write_bytes(b"x")
    os.utime(stale, (1, 1))  # a writer that crashed long ago
    open_storage(tmp_path / "store").put("c/0", b"abc")
    cache.get("c/0")  # the first write of a process scans the directory
    assert not stale.exists() and fresh.exists() and foreign.exists()
    assert cache.stats()["evicted"] == 0


def test_threads_share_a_small_cache(tmp_path):
    inner = open_storage(tmp_path / "store")
    for i in range(30):
        inner.put(f"c/{i}", payload(i))
    cache = CachedStorage(inner, tmp_path / "cache", max_bytes=8000, namespace="n", cacheable=data_only)

    def reader(seed: int) -> int:
        rng, wrong = random.Random(seed), 0
        for _ in range(200):
            i = rng.randrange(30)
            buf = bytearray(1000)
            n = cache.read_into(f"c/{i}", memoryview(buf), 0)
            wrong += n != 1000 or bytes(buf) != payload(i)
        return wrong

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(reader, range(4))) == [0] * 4
    assert dir_bytes(tmp_path / "cache") <= 8000 and cache.stats()["errors"] == cache.stats()["damaged"] == 0


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "bad-magic", "grow", "empty", "folder"])
def test_damaged_entries_are_dropped_and_refetched(inner, tmp_path, damage):
    body = payload(7, 3000)
    inner.put("c/0", body)
    counting = Counting(inner)
    cache = CachedStorage(counting, tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=data_only)
    cache.get("c/0")
    cache.get_range("c/0", 100, 200)
    for path in entries(tmp_path / "cache"):
        raw = bytearray(path.read_bytes())
        if damage == "truncate":
            raw = raw[:-1]
        elif damage == "flip-byte":
            raw[-5] ^= 0xFF
        elif damage == "bad-magic":
            raw[0] ^= 1
        elif damage == "grow":
            raw += b"\0"
        elif damage == "empty":
            raw = b""
        if damage == "folder":
            path.unlink()
            path.mkdir()
        else:
            path.write_bytes(raw)
    buf = bytearray(3000)
    assert not cache.read_cached("c/0", memoryview(buf))  # never the damaged bytes
    assert cache.get("c/0") == body and cache.get_range("c/0", 100, 200) == body[100:300]
    assert counting.calls["get"] == 2 and counting.calls["get_range"] == 2  # refetched
    assert cache.stats()["damaged"] >= 2
    if damage != "folder":  # a folder in an entry's place is left alone; the read still works
        assert cache.read_cached("c/0", memoryview(buf)) and bytes(buf) == body  # the fresh entry


def test_writes_are_refused(tmp_path):
    cache = CachedStorage(
        open_storage(tmp_path / "store"), tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=data_only
    )
    for call in (
        lambda: cache.put("c/0", b"x"),
        lambda: cache.put_if_absent("c/0", b"x"),
        lambda: cache.append("c/0", b"x"),
        lambda: cache.truncate("c/0", 0),
        lambda: cache.delete("c/0"),
        lambda: cache.delete_prefix("c"),
        lambda: cache.put_stream("c/0", iter([b"x"])),
        lambda: cache.check_access(write=True),
        lambda: cache.zarr_store("a", read_only=False),
    ):
        with pytest.raises(ReadOnlyCacheError, match="is a read cache .* of a finalized store; write through") as ei:
            call()
        assert isinstance(ei.value, PermissionError)
    with pytest.raises(ReadOnlyCacheError, match=r"^cannot put .*store/c/0: this is a read cache"):
        cache.child("c").put("0", b"x")
    cache.check_access(write=False)
    cache.sync()
    with pytest.raises(KeyNotFound):
        cache.get("c/0")  # a missing object stays missing, and is not cached
    assert cache.size("c/0") is None and cache.read_object_into("c/0", memoryview(bytearray(1))) is None


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"max_bytes": 0}, "max_bytes must be a positive number of bytes. Got 0."),
        ({"max_bytes": 1.5}, "max_bytes must be a positive number of bytes. Got 1.5."),
        ({"namespace": ""}, "namespace must be a non-empty string. Got ''."),
        ({"cacheable": "chunks"}, "cacheable must be a callable taking a key. Got 'chunks'."),
    ],
)
def test_arguments_are_checked(tmp_path, bad, message):
    args = {"max_bytes": MiB, "namespace": "n", "cacheable": data_only, **bad}
    with pytest.raises((ValueError, TypeError)) as ei:
        CachedStorage(open_storage(tmp_path), tmp_path / "cache", **args)
    assert str(ei.value) == message


def test_zarr_reads_go_through_the_cache(inner, tmp_path):
    import zarr

    z = zarr.create_array(
        store=inner.zarr_store("fields/sample_key", read_only=False),
        shape=(10,),
        chunks=(4,),
        dtype="i8",
        zarr_format=3,
    )
    z[:] = np.arange(10) * 3
    counting = Counting(inner)
    cache = CachedStorage(counting, tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=data_only)
    for _ in range(2):
        arr = zarr.open_array(store=cache.zarr_store("fields/sample_key", read_only=True), mode="r")
        assert arr[:].tolist() == list(range(0, 30, 3))
    # Each open reads zarr.json (not cacheable) and probes the missing .zarray and .zattrs
    # (a missing key is never cached); the 3 chunks are fetched once.
    assert counting.calls["get"] == 2 * 3 + 3
    assert cache.stats()["hits"] == 3


def test_pickled_into_another_process_it_keeps_its_cache(tmp_path):
    inner = open_storage(tmp_path / "store")
    inner.put("c/0", b"bytes")
    cache = CachedStorage(inner, tmp_path / "cache", max_bytes=MiB, namespace="n", cacheable=data_only)
    cache.get("c/0")
    other = pickle.loads(pickle.dumps(cache.child("c")))
    assert other.get("0") == b"bytes" and other.stats()["hits"] == 1 and other.stats()["misses"] == 0


def _worker(args) -> tuple[int, int, dict]:
    """Reads every key several times in its own order through a shared, too-small cache."""
    cache, n_keys, seed = args
    rng = random.Random(seed)
    wrong = 0
    for _ in range(2):  # twice: the cache holds ~12 of the 40 keys, so it evicts all along
        order = list(range(n_keys))
        rng.shuffle(order)
        for i in order:
            key = f"shards/s{i % 3}/c/{i}"
            want = payload(i, 2000 + i)
            buf = bytearray(len(want))
            if rng.random() < 0.5:
                got = (
                    cache.get(key)
                    if rng.random() < 0.5
                    else (buf if cache.read_object_into(key, memoryview(buf)) == len(want) else None)
                )
            else:
                got = buf if cache.read_cached(key, memoryview(buf)) else cache.get_range(key, 0, len(want))
            wrong += bytes(got) != want
            part = bytearray(500)
            n = cache.read_into(key, memoryview(part), 1000)
            wrong += bytes(part[:n]) != want[1000:1500]
    return wrong, os.getpid(), cache.stats()


def test_processes_sharing_a_cache_dir_read_exact_bytes(inner, tmp_path):
    n_keys = 40
    for i in range(n_keys):
        inner.put(f"shards/s{i % 3}/c/{i}", payload(i, 2000 + i))
    max_bytes = 30_000  # room for ~12 of 40 objects (+ ranges): constant eviction
    cache = CachedStorage(inner, tmp_path / "cache", max_bytes=max_bytes, namespace="n", cacheable=data_only)
    ctx = multiprocessing.get_context("forkserver")  # fresh processes, forked with their imports done
    with ctx.Pool(3) as pool:
        results = pool.map(_worker, [(cache, n_keys, seed) for seed in range(3)])
    assert [wrong for wrong, _, _ in results] == [0, 0, 0]
    assert len({pid for _, pid, _ in results}) == 3
    assert sum(s["hits"] for _, _, s in results) > 0 and sum(s["evicted"] for _, _, s in results) > 0
    assert sum(s["errors"] + s["damaged"] for _, _, s in results) == 0
    assert not [p for p in (tmp_path / "cache").glob("*/*/.*")]  # no temporary file left
    # Each process rescans after writing RESCAN_FRACTION of the limit: the bound on the overshoot.
    largest = HEADER.size + 2000 + n_keys
    assert dir_bytes(tmp_path / "cache") <= max_bytes * LOW_WATER + 3 * (max_bytes * RESCAN_FRACTION + largest)


def data_and_no_dotfiles(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return not (name.endswith(".json") or name.startswith("."))


@pytest.mark.parametrize("layout", [{}, {"zarr_format": 3, "shard_examples": 4}], ids=["chunk-files", "zarr-shards"])
def test_a_store_read_twice_reads_its_chunks_from_the_cache(tmp_path, layout):
    import actstore

    acts = np.random.default_rng(0).standard_normal((10, 2, 9, 16)).astype(np.float16)
    path = tmp_path / "acts.store"
    with actstore.ShardWriter(path, shard=0, layers=[1, 3], d_model=16, tokens=9, **layout) as w:
        w.append(acts, sample_keys=[f"k{i}" for i in range(10)])
    actstore.finalize(path)
    counting = Counting(open_storage(path))
    cache = CachedStorage(
        counting, tmp_path / "cache", max_bytes=MiB, namespace=str(path), cacheable=data_and_no_dotfiles
    )
    data_reads = ("get_range", "read_into", "read_object_into")
    for epoch in range(2):
        before = sum(counting.calls[k] for k in data_reads)
        store = actstore.ActStore(cache)
        for ex in range(10):
            assert np.array_equal(store[ex, 1], acts[ex, 0]) and np.array_equal(store[ex, 3], acts[ex, 1])
        fetched = sum(counting.calls[k] for k in data_reads) - before
        assert (fetched > 0) if epoch == 0 else (fetched == 0)  # the second epoch: chunks from the cache
