"""ActStore.read_cached: page-cache-only reads (preadv2 RWF_NOWAIT) that never wait for the
disk and never return other bytes than read_into; and the token stream's use of them
(cached units copied on the reader thread, the rest through the I/O threads)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import actstore.chunkio as chunkio
from actstore import ActStore, ShardWriter, finalize
from actstore.storage.files import syncfs
from actstore.torch import TokenStream


def make(root, **kw) -> ActStore:
    rng = np.random.default_rng(0)
    kw = {"zarr_format": 2, **kw}  # the chunk-file layout unless a test names another
    with ShardWriter(root, shard=0, layers=[2, 5], d_model=512, tokens=16, **kw) as w:
        w.append(rng.standard_normal((9, 2, 16, 512)).astype(np.float16))
    finalize(root)
    return ActStore(root)


def drop(paths) -> None:
    """Evict files from the page cache (clean pages: flushed first)."""
    paths = list(paths)
    if paths:
        syncfs(paths[0].parent)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def chunk_files(root: Path) -> list[Path]:
    return sorted(
        p for p in (root / "shards").rglob("*") if p.is_file() and p.parent.name in ("tokens_activations", "0")
    )


def test_the_nowait_path_is_live_here():
    from actstore.storage import LocalStorage

    assert LocalStorage(".").read_nowait  # Linux with RWF_NOWAIT: no silent fallback on this machine


@pytest.mark.parametrize(
    "kw", [{}, {"zarr_format": 3}, {"zarr_format": 3, "shard_examples": 4}], ids=["v2", "v3", "v3-sharded"]
)
def test_cached_reads_equal_read_into_and_decline_when_evicted(tmp_path, kw):
    st = make(tmp_path / "s", **kw)
    out = np.empty((16, 512), np.float16)
    want = np.empty_like(out)
    st.read_into(3, 5, "tokens", want)  # caches the chunk (and a shard's index)
    assert st.read_cached(3, 5, "tokens", out) is True
    np.testing.assert_array_equal(out, want)
    drop(chunk_files(tmp_path / "s"))
    out[:] = 0
    assert st.read_cached(3, 5, "tokens", out) is False  # evicted: it would wait for the disk
    st.read_into(3, 5, "tokens", out)
    np.testing.assert_array_equal(out, want)


def test_missing_or_damaged_chunks_are_left_to_read_into(tmp_path):
    st = make(tmp_path / "s")
    adir = tmp_path / "s/shards/shard-00000.zarr/arrays/tokens_activations"
    out = np.ones((16, 512), np.float16)
    os.unlink(adir / "1.0.0.0")
    assert st.read_cached(1, 2, "tokens", out) is False
    with pytest.raises(
        chunkio.CorruptChunkError, match="is missing and reads as zeros, but the writer recorded crc32c"
    ):
        st.read_into(1, 2, "tokens", out)  # a deleted chunk of data, told from one of zeros by its checksum
    with open(adir / "2.1.0.0", "r+b") as f:
        f.truncate(100)
    assert st.read_cached(2, 5, "tokens", out) is False
    with pytest.raises(chunkio.CorruptChunkError, match="has 100 bytes"):
        st.read_into(2, 5, "tokens", out)


def test_token_stream_copies_cached_units_itself_and_reads_the_rest_with_threads(tmp_path, monkeypatch):
    st = make(tmp_path / "s")
    ts = TokenStream(st, batch_size=32, threads=4, seed=1, mmap=False)  # the read path (mapped: test_loaders_mapped.py)
    want = [b.clone() for b in ts]  # first epoch: warms every chunk
    ts.discard_read_ahead()  # the next epoch's first window, read ahead in the background: done and forgotten
    calls = []
    real, real_many = ActStore.read_into, ActStore.read_many_into
    monkeypatch.setattr(ActStore, "read_into", lambda self, *a: calls.append(a[:2]) or real(self, *a))
    monkeypatch.setattr(
        ActStore, "read_many_into", lambda self, items: calls.extend(i[:2] for i in items) or real_many(self, items)
    )
    ts.set_epoch(0)
    assert [torch_equal(a, b) for a, b in zip(ts, want)] == [True] * len(want)
    assert calls == []  # warm: every unit was a cached read
    ts.discard_read_ahead()  # else its reader copies pages while they are dropped, and they stay cached
    drop(chunk_files(tmp_path / "s"))
    ts.set_epoch(0)
    assert [torch_equal(a, b) for a, b in zip(ts, want)] == [True] * len(want)
    assert sorted(calls) == sorted((e, l) for e in range(9) for l in (2, 5))  # cold: all through the I/O threads


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
