"""Object-store requests stay few and do not grow with the store (issue 26): a writer's fixed
cost for a one-commit shard, each further commit, opening a store, reading a shard, and the
store-wide operations whose cost per shard must not depend on how many shards there are.
Counted on moto's S3 server behind a counting proxy (tests/faultproxy.py with no faults)."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
from faultproxy import FaultProxy

import actstore
from actstore.verify import verify_store
from actstore.verify.check import Listing

SHARDED = {"zarr_format": 3, "shard_examples": 64}


def _writer(url: str, shard: int = 0, commits: int = 1, **kw) -> None:
    with actstore.ShardWriter(
        url, shard=shard, layers=[0, 1], d_model=8, tokens=4, fields={"label": "int64"}, **{**SHARDED, **kw}
    ) as w:
        for c in range(commits):
            w.append(np.ones((4, 2, 4, 8), np.float16), fields={"label": np.arange(4) + c})
            if c < commits - 1:
                w.commit()


def _requests(proxy: FaultProxy, since: int) -> list[tuple[str, str]]:
    return [(m, p.split("?")[0]) for m, p in proxy.requests[since:]]


@pytest.fixture
def proxy(s3_endpoint, monkeypatch):
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        # An hour's lease: its renewals (every TTL/4) are timed, not counted here; a writer
        # slowed past 15 s by a loaded machine would add a renewal's requests to the count.
        monkeypatch.setenv("ACTSTORE_LEASE_TTL", "3600")
        yield p


def test_a_one_commit_shard_costs_at_most_20_requests_and_puts_each_metadata_document_once(s3_url, proxy):
    _writer(s3_url, stats=True)  # its statistics file is one of the 20
    reqs = _requests(proxy, 0)
    data = [r for r in reqs if r[0] == "PUT" and re.search(r"_activations/c/", r[1])]
    per_sample_chunks = [
        r for r in reqs if r[0] == "PUT" and re.search(r"/arrays/(tokens_len|sample_key|label)/c/", r[1])
    ]
    assert len(data) == 1 and len(per_sample_chunks) == 3  # one Zarr shard file; one chunk per per-sample array
    fixed = len(reqs) - len(data) - len(per_sample_chunks)
    assert fixed <= 19, reqs  # a listing claims the store (no HEAD first); the lease goes with one DELETE
    meta = collections.Counter(p for m, p in reqs if m == "PUT" and p.endswith("zarr.json"))
    assert len(meta) == 6 and set(meta.values()) == {1}, meta  # root, arrays group, four arrays: each put once
    assert not [r for r in reqs if r[0] == "HEAD" and "/shards/" in r[1]]  # nothing of the shard is asked about first


def test_each_further_commit_costs_the_same_few_requests(s3_url, proxy):
    counts = []
    for commits in (2, 3, 4):
        url = f"{s3_url}-{commits}"
        n0 = len(proxy.requests)
        _writer(url, commits=commits)
        counts.append(len(proxy.requests) - n0)
    assert counts[1] - counts[0] == counts[2] - counts[1] <= 16, (
        counts
    )  # O(1): the same per commit, whatever came before


def _sized_stores(s3_url: str) -> dict[int, str]:
    """Stores of 2, 3 and 4 one-commit shards of 4 examples each (built once, read by every
    check below: reads and verify do not change a store)."""
    urls = {}
    for n in (2, 3, 4):
        urls[n] = f"{s3_url}-{n}"
        for s in range(n):
            _writer(urls[n], shard=s)
        actstore.finalize(urls[n])
    return urls


def _opening_a_store_is_one_request_and_reading_a_shard_a_fixed_few(url: str, proxy: FaultProxy) -> None:
    n0 = len(proxy.requests)
    store = actstore.ActStore(url)
    assert _requests(proxy, n0) == [("GET", f"{url.removeprefix('s3:/')}/manifest.json")]
    per_shard = []
    for s in (0, 3, 1):
        n0 = len(proxy.requests)
        assert np.array_equal(store[4 * s + 1, 1], np.ones((4, 8), np.float16))
        per_shard.append(len(proxy.requests) - n0)
    assert len(set(per_shard)) == 1 and per_shard[0] <= 11, per_shard  # the same for any shard: no walk over the others


def _store_wide_operation_costs_the_same_requests_per_shard_at_any_size(urls, proxy, op: str) -> None:
    from actstore.read.info import store_info
    from actstore.torch import TokenStream

    run = {
        "verify": lambda u: verify_store(u),
        "verify_deep": lambda u: verify_store(u, deep=True),
        "info": lambda u: store_info(u, sinks=False),  # (the sink check reads a bounded sample: below)
        "token_plan": lambda u: TokenStream(actstore.ActStore(u), batch_size=8, seed=0).plan(0),
    }[op]
    cost = {}
    for n, url in urls.items():
        n0 = len(proxy.requests)
        out = run(url)
        if op.startswith("verify"):
            assert out.ok, out
        cost[n] = len(proxy.requests) - n0
    assert cost[4] - cost[3] == cost[3] - cost[2], (op, cost)  # linear in shards
    if op in ("info", "token_plan"):
        assert cost[2] == cost[4] <= 3, (
            op,
            cost,
        )  # read from the manifest alone (a fixed segment's lengths are its t_max)


def _the_sink_check_of_info_reads_each_sampled_example_once(url: str, proxy: FaultProxy) -> None:
    """`info`'s sink check reads a bounded sample of examples (sinkcheck.sample_examples), so
    its requests grow with the examples sampled, never past what MAX_EXAMPLES allows."""
    from actstore.read.info import store_info
    from actstore.read.sinkcheck import MAX_EXAMPLES

    n0 = len(proxy.requests)
    store_info(url, sinks=False)
    plain = len(proxy.requests) - n0
    n0 = len(proxy.requests)
    info = store_info(url)
    checked = len(proxy.requests) - n0
    n = info["n_examples"]
    assert info["sinks"] == [] and n == 16
    assert plain < checked <= plain + 11 * 4 + 2 * min(n, MAX_EXAMPLES), (plain, checked)  # shards' first reads + rows


def test_reads_and_store_wide_operations_cost_the_same_requests_per_shard_at_any_size(s3_url, proxy):
    """On stores of 2, 3 and 4 shards (made once): opening a store is one request and reading a
    shard a fixed few; verify, deep verify, info and a token plan cost the same requests per
    shard at any size; info's sink check reads each sampled example once."""
    urls = _sized_stores(s3_url)
    _opening_a_store_is_one_request_and_reading_a_shard_a_fixed_few(urls[4], proxy)
    for op in ("verify", "verify_deep", "info", "token_plan"):
        _store_wide_operation_costs_the_same_requests_per_shard_at_any_size(urls, proxy, op)
    _the_sink_check_of_info_reads_each_sampled_example_once(urls[4], proxy)


def test_the_verify_listing_answers_a_folder_from_its_sorted_range():
    class Fake:
        def list(self, prefix=""):
            from actstore.storage import Entry

            names = ["a/x", "a/y/z", "a.b", "ab/c", "a/y/w", "b"]
            return iter([Entry(n, 1, "file") for n in names])

    lst = Listing(Fake())
    assert [e.key for e in lst.under("a")] == ["a/x", "a/y/w", "a/y/z"]
    assert lst.children("a") == {"x": "file", "y": "dir"} and lst.children("") == {
        "a": "dir",
        "a.b": "file",
        "ab": "dir",
        "b": "file",
    }
    assert lst.kind("a/y") == "dir" and lst.kind("a/q") is None and lst.kind("b") == "file" and lst.under("zz") == []
