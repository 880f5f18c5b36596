"""The token stream's one-copy path: a local store's files mapped into a FileRegion and
each batch gathered from the page cache. It must yield exactly what the read path
yields, on every layout, with masks, several segments and several token chunks; keep
its mappings from epoch to epoch without reading again; fall back to reads when a unit
cannot be mapped; and turn damaged files into the project's errors (never a crash)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from factory import LAYOUTS, plain_vit_store
from factory import pairs_store as qa_store

import actstore
from actstore import ActStore, ShardWriter
from actstore.read.batched import map_chunks
from actstore.storage import LocalStorage
from actstore.storage.mapping import FileRegion
from actstore.torch import TokenStream


def vit_store(path, layout="v2", n=12):
    return plain_vit_store(path, n=n, stats=False, **LAYOUTS[layout])


def epoch(store, **kw):
    ts = TokenStream(store, **kw)
    return ts, [{k: v.clone() for k, v in b.items()} if isinstance(b, dict) else b.clone() for b in ts]


def spare(ts):
    """What the stream keeps between epochs (once its read-ahead of the next has finished)."""
    return ts.spares.kept()


def same(a, b) -> bool:
    if isinstance(a, dict):
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"token_mask": "content", "return_index": True},
        {"normalize": "standardize", "segments": "prompt"},
        {"shuffle": False, "layers": [5, 9]},
    ],
    ids=["plain", "masked", "normalised", "ordered"],
)
def test_mapped_batches_equal_read_batches(tmp_path, layout, kw):
    store = qa_store(tmp_path / "s", n=11, **LAYOUTS[layout])
    base = dict(batch_size=5, seed=2, buffer_bytes=5 * 8 * 2 * 3, **kw)  # windows of 3 batches
    mapped, got = epoch(store, **base)
    _, want = epoch(store, mmap=False, **base)
    assert spare(mapped).region is not None and len(got) == len(want) > 3
    assert all(same(a, b) for a, b in zip(got, want))
    n_rows = sum(len(b["acts"] if isinstance(b, dict) else b) for b in got)
    assert n_rows == mapped.n_tokens


def test_warm_epochs_map_once_and_read_nothing(tmp_path, monkeypatch):
    store = vit_store(tmp_path / "s", n=20)
    ts = TokenStream(store, batch_size=8, seed=1)
    first = [b.clone() for b in ts]
    region = spare(ts).region
    assert (
        region.stats()["mapped"] == 40 and region.stats()["pinned"] == 40
    )  # the next epoch's window, read ahead, pins them
    calls = []
    for name in ("read_into", "read_many_into", "read_cached", "map_unit"):
        real = getattr(ActStore, name)
        monkeypatch.setattr(ActStore, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    populated = []
    real_pop = FileRegion.populate
    monkeypatch.setattr(FileRegion, "populate", lambda self, *a: populated.append(a) or real_pop(self, *a))
    ts.set_epoch(0)
    again = [b.clone() for b in ts]
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(again) == len(first)
    assert calls == [] and populated == []  # every unit: remembered rows, resident pages
    it = iter(ts)
    next(it)
    with pytest.raises(RuntimeError, match=r"release\(\) while this stream is being iterated"):
        ts.release()  # its threads still gather from the mappings
    del it
    ts.release()  # mappings gone: the next epoch maps and populates every file again
    assert region.base is None and ts.spares.kept().empty and not ts.spares.reading_ahead
    ts.set_epoch(0)
    third = [b.clone() for b in ts]
    assert all(torch.equal(a, b) for a, b in zip(first, third))
    assert calls.count("map_unit") == 40 and len(populated) == 40


def test_pages_that_left_the_page_cache_are_populated_again(tmp_path):
    store = vit_store(tmp_path / "s", n=4)
    region = FileRegion(6 * 2, 5 * 6 * 2, 16)
    storage = store._shard(0).storage
    key = store._shard(0).io["tokens"].geo.chunk_key(1, 0, 0)
    slot, size = region.open(storage, key)
    assert size == 60 and region.to_populate([(slot, 0, 60)]) == [(slot, 0, 60)]  # never populated
    region.populate(slot, 0, 60)
    assert region.to_populate([(slot, 0, 60)]) == []
    rows = region.rows[region.first_row(slot, 0) : region.first_row(slot, 0) + 5]
    np.testing.assert_array_equal(rows.view(np.float16).reshape(5, 6), store[1, 0])
    from actstore.storage import mapping
    from actstore.storage.files import syncfs

    # Evict the page: unmap it from this process (MADV_DONTNEED), then drop it from the page cache.
    path = storage.where(key)
    syncfs(os.path.dirname(path))
    assert mapping._LIBC.madvise(region.base + slot * region.stride, os.sysconf("SC_PAGE_SIZE"), 4) == 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert region.to_populate([(slot, 0, 60)]) == [(slot, 0, 60)]
    region.populate(slot, 0, 60)
    assert region.to_populate([(slot, 0, 60)]) == []
    np.testing.assert_array_equal(rows.view(np.float16).reshape(5, 6), store[1, 0])
    region.unpin([slot])
    region.close()


def test_a_region_of_few_slots_unmaps_the_least_recently_used_unpinned_file(tmp_path):
    store = vit_store(tmp_path / "s", n=3)
    geo = store._shard(0).io["tokens"].geo
    storage = store._shard(0).storage
    region = FileRegion(12, 60, 2)
    a = region.open(storage, geo.chunk_key(0, 0, 0))
    b = region.open(storage, geo.chunk_key(1, 0, 0))
    assert {a[0], b[0]} == {0, 1} and region.open(storage, geo.chunk_key(2, 0, 0)) == (-1, 60)  # both pinned
    gen = region.generation(a[0])
    region.unpin([a[0]])
    c = region.open(storage, geo.chunk_key(2, 0, 0))
    assert c == (a[0], 60) and region.generation(a[0]) == gen + 1  # a's slot now holds the third file
    assert not region.repin([a[0]], [gen])  # rows remembered for the first file are stale
    assert region.open(storage, geo.chunk_key(0, 0, 5)) is None  # no such file: the fill value
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(region)
    region.close()


def test_windows_fall_back_to_reads_when_slots_run_out(tmp_path, monkeypatch):
    from actstore.storage import mapping

    monkeypatch.setattr(mapping, "MAX_SLOTS", 3)  # fewer files than one window needs
    store = vit_store(tmp_path / "s", n=12)
    ts, got = epoch(store, batch_size=6, seed=4)
    _, want = epoch(store, batch_size=6, seed=4, mmap=False)
    assert spare(ts).region.n_slots == 3 and all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)


def test_chunks_not_a_whole_number_of_rows_from_the_start_are_read(tmp_path):
    store = vit_store(tmp_path / "s", layout="v3-sharded", n=8)
    io = store._shard(0).io["tokens"]
    region = FileRegion(24, 10**4, 8)  # rows of two tokens: every odd chunk starts mid-row
    assert map_chunks(io, region, 0, 0) is not None and map_chunks(io, region, 0, 1) is None
    assert region.stats()["pinned"] == 1
    region.close()


def test_an_absent_chunk_is_not_mapped(tmp_path):
    """No rows stand for an absent chunk: the unit is read instead, which checks it against
    the writer's checksum (test_a_deleted_chunk_file_of_data_...)."""
    store = vit_store(tmp_path / "s", n=8)
    io = store._shard(0).io["tokens"]
    os.remove(io.storage.where(io.geo.chunk_key(5, 1, 0)))
    region = FileRegion(12, 10**4, 8)
    assert map_chunks(io, region, 5, 0) is not None and map_chunks(io, region, 5, 1) is None
    assert region.stats()["pinned"] == 1  # the mapped unit's file only
    region.close()


@pytest.mark.parametrize("layout", ["v2", "v3-sharded"])
def test_damaged_files_raise_the_projects_error(tmp_path, layout):
    store = vit_store(tmp_path / "s", layout=layout, n=8)
    io = store._shard(0).io["tokens"]
    path = io.where(io.geo.chunk_key(5, 1, 0) if layout == "v2" else io.geo.shard_key(5))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 20)
    fresh = ActStore(tmp_path / "s")
    with pytest.raises(actstore.CorruptChunkError, match=r"has 40 bytes, expected 60|index|cut short|truncated"):
        list(TokenStream(fresh, batch_size=4))


@pytest.mark.parametrize("mmap", [True, False])
def test_a_deleted_chunk_file_of_data_is_an_error_and_one_of_zeros_streams_as_zeros(tmp_path, mmap):
    """Absent chunks read as zeros only where the writer's checksum says zeros were written
    (the rule of every reader, docs/reliability.md), also on the mapped and batched paths."""
    store = vit_store(tmp_path / "s", n=6)
    io = store._shard(0).io["tokens"]
    os.unlink(io.where(io.geo.chunk_key(3, 0, 0)))
    with pytest.raises(actstore.CorruptChunkError, match=r"missing and reads as zeros, but the writer recorded crc32c"):
        epoch(ActStore(tmp_path / "s"), batch_size=4, mmap=mmap)
    x = np.random.default_rng(1).standard_normal((6, 2, 5, 6)).astype(np.float16)
    x[3, 0] = 0
    with ShardWriter(tmp_path / "z", zarr_format=2, shard=0, layers=[0, 1], d_model=6, tokens=5) as w:
        w.append(x)
    actstore.finalize(tmp_path / "z")
    io = ActStore(tmp_path / "z")._shard(0).io["tokens"]
    os.unlink(io.where(io.geo.chunk_key(3, 0, 0)))  # zarr-python omits such a chunk: legal
    _, got = epoch(ActStore(tmp_path / "z"), batch_size=4, return_index=True, mmap=mmap)
    rows = [
        b["acts"][i] for b in got for i in range(len(b["acts"])) if (int(b["example"][i]), int(b["layer"][i])) == (3, 0)
    ]
    assert len(rows) == 5 and not torch.stack(rows).any()
    assert sum(len(b["acts"]) for b in got) == 6 * 2 * 5


def test_stores_that_are_not_local_raw_chunks_are_read(tmp_path):
    store = vit_store(tmp_path / "s")
    assert store.mappable_files(["tokens"]) == (24, 60)
    cached = ActStore(tmp_path / "s", cache_dir=tmp_path / "cache")
    assert cached.mappable_files(["tokens"]) is None  # a CachedStorage: the read path
    assert isinstance(store._shard(0).storage, LocalStorage)
    ts, got = epoch(cached, batch_size=4, seed=1)
    assert spare(ts).region is None
    _, want = epoch(store, batch_size=4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_other_stored_dtypes_stream_the_same_mapped(tmp_path, dtype):
    store = qa_store(tmp_path / "s", n=5, dtype=dtype)
    kw = dict(batch_size=7, seed=3, buffer_bytes=7 * 8 * 4 * 3)
    _, got = epoch(store, **kw)
    _, want = epoch(store, mmap=False, **kw)
    assert (
        got[0].dtype == getattr(torch, dtype)
        and all(torch.equal(a, b) for a, b in zip(got, want))
        and len(got) == len(want)
    )


def test_forked_workers_of_a_stream_that_mapped_in_the_main_process(tmp_path):
    store = vit_store(tmp_path / "s", n=16)
    ts = TokenStream(store, batch_size=8, seed=2)
    assert sum(len(b) for b in ts) == 160  # the main process mapped the files
    ts.set_epoch(0)
    got = [b.clone() for b in ts.loader(num_workers=2, multiprocessing_context="fork")]
    want = [
        b.clone()
        for b in TokenStream(store, batch_size=8, seed=2, mmap=False).loader(
            num_workers=2, multiprocessing_context="fork"
        )
    ]
    assert len(got) == len(want) == 20 and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "read"])
def test_the_window_read_ahead_stays_with_the_epoch_that_uses_it(tmp_path, mmap):
    """Epoch 1 starts from the window read ahead at the end of epoch 0; nothing the stream
    keeps between epochs may share it meanwhile (forgetting read-aheads mid-epoch, a
    stage breakdown building its own pipeline) without breaking epoch 1."""
    store = vit_store(tmp_path / "s", n=30)
    kw = dict(batch_size=8, seed=4, buffer_bytes=8 * 12 * 3, mmap=mmap)  # windows of 3 batches
    fresh = TokenStream(store, **kw)
    fresh.set_epoch(1)
    want = [b.clone() for b in fresh]
    ts = TokenStream(store, **kw)
    assert sum(len(b) for b in ts) == 300
    it = iter(ts)  # epoch 1: its first window was read ahead
    got = [next(it).clone()]
    ts.discard_read_ahead()  # nothing read ahead is pending now: must not touch the running epoch
    got += [b.clone() for b in it]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
