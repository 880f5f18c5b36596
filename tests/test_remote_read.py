"""Reading a store in object storage (moto's S3 server on 127.0.0.1, requests counted by a
proxy): TokenStream and PairDataset over the URL equal their local results on every
layout, the units of one object go out as one request, a local cache serves the next
epoch, and a read that fails mid-stream raises the project's error, never garbage."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
from factory import LAYOUTS
from factory import pairs_store as qa_store
from faultproxy import FaultProxy

import actstore
from actstore.storage import ObjectStorage
from actstore.torch import PairDataset, TokenStream


def batches(store, **kw):
    return [{k: v.clone() for k, v in b.items()} for b in TokenStream(store, return_index=True, **kw)]


def same(a, b) -> bool:
    return len(a) == len(b) > 0 and all(
        sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def chunk_gets(proxy, since: int) -> list[str]:
    """Paths of the GETs of activation objects after request number `since`."""
    return [p for m, p in proxy.requests[since:] if m == "GET" and "_activations/" in p]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_stream_over_a_url_equals_local_with_masks_segments_and_runs(s3_endpoint, s3_url, tmp_path, layout):
    qa_store(tmp_path / "local", n=9, **LAYOUTS[layout])
    qa_store(s3_url, n=9, **LAYOUTS[layout])
    local, remote = actstore.ActStore(tmp_path / "local"), actstore.ActStore(s3_url)
    for kw in (
        {"token_mask": "content"},
        {"run_bytes": 3 * 9 * 8 * 2, "normalize": "standardize"},
        {"shuffle": False, "segments": "response"},
    ):
        kw = dict(batch_size=6, seed=5, buffer_bytes=6 * 8 * 2 * 4, threads=3, **kw)  # windows of 4 batches
        got = batches(remote, **kw)
        assert same(got, batches(local, mmap=False, **kw)), kw
        assert same(got, batches(local, **kw)), kw  # and the mapped local path


def test_the_units_of_one_shard_file_are_one_request(s3_endpoint, s3_url, tmp_path, monkeypatch):
    x = np.random.default_rng(3).standard_normal((16, 2, 5, 8)).astype(np.float16)
    with actstore.ShardWriter(s3_url, layers=[0, 1], d_model=8, tokens=5, zarr_format=3, shard_examples=4) as w:
        w.append(x)
    actstore.finalize(s3_url)
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = actstore.ActStore(s3_url)
        ts = TokenStream(store, batch_size=10, seed=1)  # one window holds every unit
        start = len(proxy.requests)
        it = iter(ts)
        got = [next(it).float()]
        gets = chunk_gets(proxy, start)  # the window is read before its first batch (the next epoch's after its last)
        assert sorted(gets) == sorted(set(gets)) and len(gets) == 4  # each shard file: one GET, its index included
        got = torch.cat(got + [b.float() for b in it])
        # Windows of 2 batches in store order: a window's 4 units (2 examples x 2 layers) lie
        # in one shard file, read with at most 2 requests (its ranges, its index once), where
        # reading unit by unit would take 4.
        ts = TokenStream(store, batch_size=10, seed=1, buffer_bytes=10 * 8 * 2 * 2, shuffle=False)
        start = len(proxy.requests)
        assert sum(len(b) for b in ts) == 160
        n_windows = 160 // 20 + 1  # and the next epoch's first, read ahead
        assert len(chunk_gets(proxy, start)) <= 2 * n_windows < 4 * n_windows
    want = torch.from_numpy(x.astype(np.float32).reshape(-1, 8))
    assert torch.equal(got.sort(dim=0).values, want.sort(dim=0).values)


def test_pair_batches_over_a_url_equal_local_and_go_out_by_object(s3_endpoint, s3_url, tmp_path, monkeypatch):
    qa_store(tmp_path / "local", n=9, zarr_format=3, shard_examples=4)
    qa_store(s3_url, n=9, zarr_format=3, shard_examples=4)
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote = PairDataset(actstore.ActStore(s3_url), threads=4, return_mask=True)
        local = PairDataset(actstore.ActStore(tmp_path / "local"), threads=4, return_mask=True)
        for idx in remote.sampler(batch_size=7, k=2, seed=3):
            start = len(proxy.requests)
            a, b = remote[idx], local[idx]
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
            files = {(int(e) // 9, int(e) % 9 // 4) for e in idx.examples}  # (writer shard, shard file)
            assert len(chunk_gets(proxy, start)) <= 2 * 2 * len(files)  # per file and segment: its index and one batch


def test_a_local_cache_serves_the_next_epochs_of_a_stream(s3_endpoint, s3_url, tmp_path, monkeypatch):
    qa_store(s3_url, n=9, zarr_format=3, shard_examples=4)
    kw = dict(batch_size=6, seed=2, buffer_bytes=6 * 8 * 2 * 4)
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        cached = actstore.ActStore(s3_url, cache_dir=tmp_path / "cache", cache_bytes=2**24)
        first = batches(cached, **kw)
        assert chunk_gets(proxy, 0)
        again = actstore.ActStore(
            s3_url, cache_dir=tmp_path / "cache", cache_bytes=2**24
        )  # e.g. the next run, a worker
        start = len(proxy.requests)
        second = batches(again, **kw)
        assert chunk_gets(proxy, start) == []  # every chunk and index from the local cache
    assert same(first, second)


def test_a_read_failing_mid_stream_raises_instead_of_yielding_garbage(s3_endpoint, s3_url, tmp_path, monkeypatch):
    qa_store(tmp_path / "local", n=9, zarr_format=3, shard_examples=4)
    qa_store(s3_url, n=9, zarr_format=3, shard_examples=4)
    kw = dict(batch_size=4, seed=1, buffer_bytes=4 * 8 * 2 * 2, prefetch=0)  # many windows of 2 batches
    want = batches(actstore.ActStore(tmp_path / "local"), **kw)
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        storage = ObjectStorage(
            s3_url,
            retry_config={
                "max_retries": 1,
                "retry_timeout": timedelta(seconds=2),
                "backoff": {"init_backoff": timedelta(milliseconds=10)},
            },
        )
        got = []
        with pytest.raises(
            actstore.errors.StorageAccessError, match=r"cannot read (the index of shard file )?s3://.*_activations/c/"
        ):
            for b in TokenStream(actstore.ActStore(storage), return_index=True, **kw):
                got.append({k: v.clone() for k, v in b.items()})
                if len(got) == 2:
                    proxy.p = (1.0, 0.0, 0.0)  # from now on every request fails (503)
    assert 2 <= len(got) < len(want) and same(got, want[: len(got)])  # what came before the failure is exact
