"""A flaky network between actstore and its object store: a proxy on 127.0.0.1 in front of
moto resets 10% of new connections at accept (every answer closes its connection, so each
request meets that rate), cuts 3% of answers midway and 5% of chunk objects' answers: every
job a user runs over a URL still finishes exact (TokenStream epochs, PairDataset batches,
`verify --deep`, `cp` both ways, `export-saev` from a URL, a capture to a URL), and says how
many network failures it rode through. The default suite runs each job once; the `soak`
marker (`pytest -m soak`, run by CI) runs each at least 3 times and on until every kind of
fault fired 3 times in it (at most 10 runs).

Every run is bounded: requests give up after RETRY_SECONDS (then the test fails with the
project's error), the proxy's upstream calls after 60 s, and a watchdog ends the process
with every thread's traceback if one run takes over RUN_LIMIT_S (a hang, not a slow run).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_support import make_images, save_dinov2
from click.testing import CliRunner
from factory import pairs_store as qa_store
from faultproxy import FaultProxy, quick_obstore_backoff

import actstore
from actstore.cli import main
from actstore.copy import copy_store
from actstore.storage import open_storage, retry
from actstore.torch import PairDataset, TokenStream

RATES = dict(fail=0.0, drop_request=0.0, drop_response=0.0, reset=0.10, cut=0.03, cut_chunks=0.05, keepalive=False)
RETRY_SECONDS = 30.0  # a request's deadline in these tests (the default is 120 s)
RUN_LIMIT_S = 300  # the watchdog: one run of one job
SOAK_RUNS = 10  # the most runs of one job in the soak
SOAK_MIN_RUNS = 3  # the fewest
SOAK_FAULTS = 3  # each kind of fault fires at least this often in a job's soak
FAULT_KINDS = ("reset", "cut_answer", "cut_chunk_answer")  # FaultProxy's counts
VIT = dict(
    zarr_format=3,
    shard_examples=4,
    model_id="facebook/dinov2-small",
    attrs={"cls_token": True, "dataset": "/data/imgs"},
)


@contextlib.contextmanager
def flaky(s3_endpoint: str, seed: int):
    """The proxy with RATES in front of moto, as every client's endpoint (its clients wait
    little between obstore's own tries: quick_obstore_backoff); a watchdog."""
    old = os.environ.get("AWS_ENDPOINT_URL")
    retry.set_policy(retry.RetryPolicy(deadline_s=RETRY_SECONDS))
    faulthandler.dump_traceback_later(RUN_LIMIT_S, exit=True, file=sys.__stderr__)
    try:
        with FaultProxy(s3_endpoint, seed=seed, **RATES) as proxy, quick_obstore_backoff():
            os.environ["AWS_ENDPOINT_URL"] = proxy.url
            yield proxy
    finally:
        faulthandler.cancel_dump_traceback_later()
        retry.set_policy(None)
        if old is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = old


def cli(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.stdout


def _clone(batches) -> list[dict]:
    return [{k: v.clone() for k, v in b.items()} for b in batches]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) > 0 and all(
        sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _once(made: dict, make):
    """The job's inputs and local results, made on its first run and kept in `made` for the
    next runs (a soak reads the same inputs through different failures)."""
    if not made:
        made.update(make())
    return made


# ---- the jobs: each writes its inputs straight to moto, runs through the proxy, checks ----
# `url` is a fresh location for what the job writes; a job that only reads reads the inputs
# its first run wrote (`made`).
def job_token_stream(s3_endpoint, url, tmp, seed, made):
    kw = dict(batch_size=6, seed=5, buffer_bytes=6 * 8 * 2 * 4, threads=3, return_index=True, token_mask="content")

    def make():
        qa_store(tmp / "local", n=9, zarr_format=3, shard_examples=4)
        qa_store(url, n=9, zarr_format=3, shard_examples=4)
        local = TokenStream(actstore.ActStore(tmp / "local"), **kw)
        return {"url": url, "want": [_clone(local), _clone(local)]}  # two epochs

    m = _once(made, make)
    url, want = m["url"], m["want"]
    with flaky(s3_endpoint, seed) as proxy:
        remote = TokenStream(actstore.ActStore(url), **kw)
        got = [_clone(remote), _clone(remote)]
        remote.release()  # the next epoch's read-ahead ends here, not against a closed proxy
    assert _same(got[0], want[0]) and _same(got[1], want[1]) and not _same(got[0], got[1])
    return proxy


def job_pair_dataset(s3_endpoint, url, tmp, seed, made):
    def make():
        qa_store(tmp / "local", n=9)  # chunk files (zarr_format 2)
        qa_store(url, n=9)
        return {"url": url, "local": PairDataset(actstore.ActStore(tmp / "local"), threads=4, return_mask=True)}

    m = _once(made, make)
    url, local = m["url"], m["local"]
    with flaky(s3_endpoint, seed) as proxy:
        remote = PairDataset(actstore.ActStore(url), threads=4, return_mask=True)
        n = 0
        for idx in remote.sampler(batch_size=5, k=2, seed=3):
            a, b = remote[idx], local[idx]
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
            n += 1
    assert n >= 3
    return proxy


def job_verify_deep(s3_endpoint, url, tmp, seed, made):
    url = _once(made, lambda: {"url": url, "store": qa_store(url, n=9, zarr_format=3, shard_examples=4)})["url"]
    with flaky(s3_endpoint, seed) as proxy:
        before = retry.counts()
        report = json.loads(cli("verify", "--deep", "--json", url))
    after = retry.counts()
    assert report["ok"] is True and report["problems"] == [] and report["n_examples"] == 18
    assert report["network"] == after  # the process's totals when it finished, every kind named
    met = {k: after[k] - before[k] for k in after}  # what this verify rode through
    assert met["retried"] == sum(met[k] for k in retry.LABELS) and met["recovered"] <= met["retried"]
    return proxy


def job_cp(s3_endpoint, url, tmp, seed, made):
    src = tmp.parent / "src.store"  # the source, one for every run

    def make():
        qa_store(src, n=9)
        return {"want": _files(src)}

    want = _once(made, make)["want"]
    with flaky(s3_endpoint, seed) as proxy:
        up = json.loads(cli("cp", "--json", src, url))
        copy_store(url, tmp / "back.store", workers=3)
    assert up["n_copied"] > 20
    assert _files(tmp / "back.store") == want  # every byte, down and up
    assert {e.key for e in open_storage(url).list() if not e.key.startswith(".")} == set(want)
    return proxy


def job_export_saev(s3_endpoint, url, tmp, seed, made):
    def make():
        x = np.random.default_rng(seed).standard_normal((10, 2, 5, 8)).astype(np.float16)
        for where in (tmp / "local", url):
            with actstore.ShardWriter(where, layers=[1, 3], d_model=8, tokens=5, **VIT) as w:
                w.append(x)
            actstore.finalize(where)
        cli("export-saev", tmp / "local", tmp / "a" / "saev" / "shards", "--quiet")
        return {"url": url, "want": _files(tmp / "a" / "saev" / "shards")}

    m = _once(made, make)
    url, a = m["url"], m["want"]
    with flaky(s3_endpoint, seed) as proxy:
        res = json.loads(cli("export-saev", url, tmp / "b" / "saev" / "shards", "--json"))
    assert res["examples"] == 10 and _files(tmp / "b" / "saev" / "shards") == a and any(k.endswith(".bin") for k in a)
    return proxy


def job_capture(s3_endpoint, url, tmp, seed, made):
    def make():
        make_images(tmp / "images", n=6)
        args = ("--model", save_dinov2(tmp / "dino"), "--data", tmp / "images", "--layers", "0,2", "--batch-size", "2")
        cli("write", tmp / "local", *args, "--quiet")
        return {"args": args, "local": actstore.ActStore(tmp / "local")}

    m = _once(made, make)
    args, local = m["args"], m["local"]
    with flaky(s3_endpoint, seed) as proxy:
        s = json.loads(cli("write", url, *args, "--quiet", "--json"))
    assert s["written"] == 6 and set(s["network"]) == {"retried", "recovered", *retry.LABELS}
    remote = actstore.ActStore(url)
    assert len(remote) == 6
    for ex in range(6):
        for layer in (0, 2):
            np.testing.assert_array_equal(remote[ex, layer], local[ex, layer])
    assert cli("verify", "--deep", "--quiet", url) == ""
    return proxy


JOBS = {
    "token_stream": job_token_stream,
    "pair_dataset": job_pair_dataset,
    "verify_deep": job_verify_deep,
    "cp": job_cp,
    "export_saev": job_export_saev,
    "capture": job_capture,
}


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_job_over_a_flaky_network_is_exact(job, s3_endpoint, s3_url, tmp_path):
    retry.reset_counts()
    (tmp_path / "run").mkdir()
    proxy = JOBS[job](s3_endpoint, s3_url, tmp_path / "run", seed=11, made={})
    c = retry.counts()
    assert proxy.counts["reset"] >= 1 and proxy.counts["connections"] > 20, proxy.counts
    # what the client met (resets at accept, cut answers) it rode through; every retry is counted
    assert c["retried"] == sum(c[k] for k in retry.LABELS) and c["refused"] == c["unresolved"] == 0


@pytest.mark.soak
@pytest.mark.parametrize("job", sorted(JOBS))
def test_soak_a_job_over_a_flaky_network(job, s3_endpoint, tmp_path, capsys):
    """Each job run again and again, each seed its own failures, all exact: at least
    SOAK_MIN_RUNS runs and on until every kind of fault fired SOAK_FAULTS times (resets at
    accept, answers cut at the rate of every answer and at the chunk objects' own rate),
    at most SOAK_RUNS runs. The inputs are made once (the first run) and each run writes to
    a fresh prefix of one bucket."""
    import s3server

    bucket = s3server.create_bucket(s3_endpoint)
    made: dict = {}
    seen = {"connections": 0, "reset": 0, "cut_answer": 0, "cut_chunk_answer": 0}
    retry.reset_counts()
    run = 0
    while run < SOAK_MIN_RUNS or (run < SOAK_RUNS and min(seen[k] for k in FAULT_KINDS) < SOAK_FAULTS):
        run_dir = tmp_path / f"run{run}"
        run_dir.mkdir()
        proxy = JOBS[job](s3_endpoint, f"s3://{bucket}/run{run}/store", run_dir, seed=100 + run, made=made)
        for k in seen:
            seen[k] += proxy.counts[k]
        run += 1
    with capsys.disabled():
        print(f"\n[soak] {job}: {run} runs exact; proxy {seen}; client {retry.counts()}", flush=True)
    assert min(seen[k] for k in FAULT_KINDS) >= SOAK_FAULTS, seen


def test_a_coroutine_is_made_again_after_a_connection_reset():
    """retry.acall, the zarr store's async reads' retry (which the jobs above meet only by
    chance): a reset is counted, a fresh coroutine tried, its result returned."""
    import asyncio

    tries = []

    async def read() -> bytes:
        tries.append(len(tries))
        if len(tries) == 1:
            raise ConnectionResetError("connection reset by peer")
        return b"bytes"

    retry.reset_counts()
    retry.set_policy(retry.RetryPolicy(deadline_s=RETRY_SECONDS, first_wait_s=0.01))
    try:
        got = asyncio.run(retry.acall(read, what="read", where="s3://acall/k", root="s3://acall"))
    finally:
        retry.set_policy(None)
    c = retry.counts()
    assert got == b"bytes" and tries == [0, 1] and (c["reset"], c["retried"], c["recovered"]) == (1, 1, 1), c
