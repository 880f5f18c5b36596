"""Stores in object storage (moto's S3 server on 127.0.0.1): the same code, a URL for a path."""

from __future__ import annotations

import numpy as np
import pytest

import actstore
from actstore.layout import keys
from actstore.storage import open_storage
from actstore.verify import verify_store

LAYERS = [1, 3]


def _write(path, x, **kw):
    n = x.shape[0]
    with actstore.ShardWriter(
        path,
        layers=LAYERS,
        d_model=x.shape[3],
        tokens=x.shape[2],
        texts=["t"],
        stats=True,
        commit_bytes=x[:3].nbytes,
        **kw,
    ) as w:
        for i in range(0, n, 4):
            w.append(x[i : i + 4], texts={"t": [f"s{j}" for j in range(i, min(i + 4, n))]})
    return actstore.finalize(path)


@pytest.mark.parametrize(
    "kw", [{}, {"zarr_format": 3}, {"zarr_format": 3, "shard_examples": 4}], ids=["v2", "v3", "v3-sharded"]
)
def test_a_store_on_s3_equals_the_same_store_on_disk(s3_url, tmp_path, kw):
    x = (np.arange(11 * 2 * 5 * 8, dtype=np.float32).reshape(11, 2, 5, 8) % 97 - 48) / 4
    _write(tmp_path / "local", x, **kw)
    _write(s3_url, x, **kw)
    local, remote = open_storage(tmp_path / "local"), open_storage(s3_url)
    # Byte for byte, every object (timestamps aside: they differ between two runs anyway).
    want = {e.key: local.get(e.key) for e in local.list() if e.kind == "file"}
    got = {e.key: remote.get(e.key) for e in remote.list()}
    assert sorted(got) == sorted(want)
    volatile = {keys.IDENTITY, keys.MANIFEST, ".zattrs", "zarr.json", ".zmetadata", keys.COMMIT}
    for k in want:
        if k.rsplit("/", 1)[-1] not in {v.rsplit("/", 1)[-1] for v in volatile}:
            assert got[k] == want[k], k
    st = actstore.ActStore(s3_url)
    assert st.path == s3_url and len(st) == 11
    for ex in range(11):
        for lp, layer in enumerate(LAYERS):
            np.testing.assert_array_equal(st[ex, layer], x[ex, lp].astype(np.float16))
    np.testing.assert_array_equal(st[2:7, 3], x[2:7, 1].astype(np.float16))
    assert list(st.texts("t")) == [f"s{j}" for j in range(11)]
    assert st.stats().count.tolist() == actstore.ActStore(tmp_path / "local").stats().count.tolist()
    rep = verify_store(s3_url, deep=True)
    assert rep.ok and rep.problems == [] and rep.n_bytes_read == 11 * 2 * 5 * 8 * 2


def test_resume_on_s3_continues_exactly(s3_url):
    x = np.random.default_rng(0).standard_normal((9, 2, 5, 8)).astype(np.float16)
    w = actstore.ShardWriter(s3_url, layers=LAYERS, d_model=8, tokens=5, commit_bytes=2**40)
    w.append(x[:4])
    w.commit()
    w.append(x[4:6])  # appended, never committed: a crash here loses them
    w._close_files()
    with actstore.ShardWriter(s3_url, layers=LAYERS, d_model=8, tokens=5, resume=True) as w2:
        assert w2.n_committed == 4
        w2.append(x[4:])
    actstore.finalize(s3_url)
    st = actstore.ActStore(s3_url)
    assert len(st) == 9 and all((st[i, 3] == x[i, 1]).all() for i in range(9))
    assert verify_store(s3_url, deep=True).problems == []


def test_two_writers_racing_for_one_shard_on_s3(s3_url):
    import threading

    results: list[str] = []
    barrier = threading.Barrier(4)

    def claim() -> None:
        barrier.wait()
        try:
            actstore.ShardWriter(s3_url, shard=0, layers=LAYERS, d_model=8, tokens=5)._close_files()
            results.append("won")
        except Exception as e:  # noqa: BLE001 - each loser's error is checked below
            results.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and results.count("won") == 1, results
    # A loser sees the winner's shard (created, or created at the same instant) or its lease.
    clear = (
        ("ShardExistsError: ", "already exists"),
        ("ShardExistsError: ", "created by another writer at the same time"),
        ("ShardBusyError: ", "is being written by another writer: pid "),
    )
    assert all(any(r.startswith(k) and m in r for k, m in clear) for r in results if r != "won"), results


def test_cli_on_a_url(s3_url, tmp_path):
    from click.testing import CliRunner

    from actstore.cli import main

    x = np.ones((3, 2, 5, 8), np.float16)
    _write(s3_url, x, model_id="facebook/dinov2-small", attrs={"cls_token": True, "dataset": "/data/imgs"})
    r = CliRunner().invoke(main, ["export-saev", s3_url, str(tmp_path / "saev" / "shards")])
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "saev" / "shards").glob("*/acts*.bin"))) >= 1
    r = CliRunner().invoke(main, ["info", s3_url])
    assert r.exit_code == 0 and "3" in r.output, r.output
    r = CliRunner().invoke(main, ["verify", "--deep", s3_url])
    assert (
        r.exit_code == 0
        and r.output.startswith(f"verify (deep) {s3_url}: 3 examples in 1 shards")
        and ": OK" in r.output
    ), r.output
    r = CliRunner().invoke(main, ["finalize", s3_url])
    assert r.exit_code == 0 and f"finalized {s3_url}: 3 examples in 1 shards" in r.output


def test_an_unreliable_s3_still_gives_an_exact_store(s3_endpoint, s3_url, monkeypatch):
    """A proxy answers 503 to 10% of requests and drops 3% before and 2% after the server
    acted: obstore's retries still give an exact store, read back and verified (with short
    pauses between its tries: the retries are what is tested, not the waits)."""
    from faultproxy import FaultProxy, quick_obstore_backoff

    x = (np.arange(9 * 2 * 5 * 8, dtype=np.float32).reshape(9, 2, 5, 8) % 31) / 4
    with (
        FaultProxy(s3_endpoint, fail=0.10, drop_request=0.03, drop_response=0.02, seed=7) as proxy,
        quick_obstore_backoff(),
    ):
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        _write(s3_url, x, zarr_format=3, shard_examples=4)
        st = actstore.ActStore(s3_url)
        got = np.stack([np.stack([st[i, layer] for layer in LAYERS]) for i in range(9)])
        rep = verify_store(s3_url, deep=True)
    assert proxy.counts["failed"] > 5 and proxy.counts["dropped_request"] + proxy.counts["dropped_response"] > 2
    np.testing.assert_array_equal(got, x.astype(np.float16))
    assert rep.problems == []


def test_a_writer_killed_mid_upload_resumes_exactly(s3_url, tmp_path):
    """SIGKILL a writer process while it uploads, resume its shard: the store is exact."""
    import signal
    import time

    import forked

    from actstore import catalog

    script = tmp_path / "w.py"
    script.write_text(
        "import sys, numpy as np, actstore\n"
        "x = np.random.default_rng(5).standard_normal((64, 2, 5, 8)).astype(np.float16)\n"
        "w = actstore.ShardWriter(sys.argv[1], layers=[1, 3], d_model=8, tokens=5, commit_bytes=4 * 2 * 5 * 8 * 2)\n"
        "for i in range(0, 64, 2):\n"
        "    w.append(x[i : i + 2])\n"
        "w.close()\n"
    )
    proc = forked.start(script, s3_url)  # a process of its own, forked with actstore imported
    storage = open_storage(s3_url)
    deadline = time.time() + 60
    while time.time() < deadline and catalog.committed(storage, 0)[0] < 8 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n, complete = catalog.committed(storage, 0)
    assert 0 < n < 64 and not complete
    x = np.random.default_rng(5).standard_normal((64, 2, 5, 8)).astype(np.float16)
    with actstore.ShardWriter(s3_url, layers=LAYERS, d_model=8, tokens=5, resume=True) as w:
        w.append(x[w.n_committed :])
    actstore.finalize(s3_url)
    st = actstore.ActStore(s3_url)
    assert len(st) == 64 and all((st[i, 1] == x[i, 0]).all() and (st[i, 3] == x[i, 1]).all() for i in range(64))
    assert verify_store(s3_url, deep=True).problems == []


def test_token_stream_and_export_over_a_url_equal_their_local_results(s3_url, tmp_path):
    import torch

    from actstore.saev import export_saev
    from actstore.torch import TokenStream

    x = np.random.default_rng(2).standard_normal((10, 2, 5, 8)).astype(np.float16)
    vit = dict(
        zarr_format=3,
        shard_examples=4,
        model_id="facebook/dinov2-small",
        attrs={"cls_token": True, "dataset": "/data/imgs"},
    )
    _write(tmp_path / "local", x, **vit)
    _write(s3_url, x, **vit)

    def epoch(path):
        ts = TokenStream(actstore.ActStore(path), batch_size=7, seed=3, buffer_bytes=7 * 8 * 2 * 3, return_index=True)
        return [{k: v.clone() for k, v in b.items()} for b in ts]

    local, remote = epoch(tmp_path / "local"), epoch(s3_url)
    assert len(local) == len(remote) > 0
    for a, b in zip(local, remote):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ra = export_saev(actstore.ActStore(tmp_path / "local"), tmp_path / "a" / "saev" / "shards", progress=False)
    rb = export_saev(actstore.ActStore(s3_url), tmp_path / "b" / "saev" / "shards", progress=False)
    fa = sorted(p.relative_to(ra.path) for p in ra.path.rglob("*") if p.is_file())
    assert fa == sorted(p.relative_to(rb.path) for p in rb.path.rglob("*") if p.is_file()) and fa
    for rel in fa:
        if rel.suffix == ".bin":
            assert (ra.path / rel).read_bytes() == (rb.path / rel).read_bytes(), rel


def test_a_local_cache_serves_the_second_epoch(s3_url, tmp_path, monkeypatch):
    """ActStore(url, cache_dir=...): the second pass reads no chunk bytes from S3."""
    from actstore.storage import ObjectStorage

    x = np.random.default_rng(4).standard_normal((10, 2, 5, 8)).astype(np.float16)
    _write(s3_url, x, zarr_format=3, shard_examples=4)
    st = actstore.ActStore(s3_url, cache_dir=tmp_path / "cache", cache_bytes=2**20)
    first = [st[i, layer].copy() for i in range(10) for layer in LAYERS]
    calls = []
    real = ObjectStorage.get_range

    def counting(self, key, start, length):
        calls.append(key)
        return real(self, key, start, length)

    monkeypatch.setattr(ObjectStorage, "get_range", counting)
    again = actstore.ActStore(s3_url, cache_dir=tmp_path / "cache", cache_bytes=2**20)  # e.g. a DataLoader worker
    second = [again[i, layer] for i in range(10) for layer in LAYERS]
    assert all((a == b).all() for a, b in zip(first, second))
    assert [k for k in calls if "/c/" in k] == []  # every chunk came from the cache
    np.testing.assert_array_equal(np.stack(second[::2]), x[:, 0])


def test_a_deleted_per_sample_object_is_named_not_read_as_zeros(s3_url):
    x = np.ones((5, 2, 5, 8), np.float16)
    _write(s3_url, x, zarr_format=2)
    storage = open_storage(s3_url)
    key = "shards/shard-00000.zarr/arrays/tokens_len/0"
    assert storage.size(key) is not None  # lengths 5: not zeros, but every chunk is written anyway
    storage.delete(key)
    with pytest.raises(
        actstore.CorruptChunkError, match=rf"chunk file {s3_url}/{key} of per-sample array tokens_len is missing"
    ):
        actstore.ActStore(s3_url)[0, 1]
    rep = verify_store(s3_url)
    assert [(p.kind, p.path) for p in rep.errors] == [("missing-chunk", key)]
