"""Distributed capture on existing engines (docs/distributed.md): ranks from Slurm and torchrun
variables, torchrun itself, Ray actors (in-process and on a `ray start` cluster on 127.0.0.1),
a killed actor, and `actstore write` refusing a shard another writer holds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import forked
import numpy as np
import pytest
import ray
from capture_support import PAIRS, save_llama, write_jsonl
from click.testing import CliRunner

import actstore
from actstore.capture import ranks
from actstore.cli import main
from actstore.errors import CaptureError
from actstore.layout import keys
from actstore.verify import verify_store

pytestmark = pytest.mark.slow  # writer processes and Ray

ROOT = Path(__file__).resolve().parents[1]
# Ray on loopback only (../shared/notes/scaleout-facts.md), no usage reporting, no auth, and no
# memory monitor (on a busy test machine it kills the writers for other processes' memory).
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_memory_monitor_refresh_ms": "0",
}


def cli(*args, env=None, ok: bool = True):
    res = CliRunner().invoke(main, [str(a) for a in args], env=env)
    if ok:
        assert res.exit_code == 0, res.output + repr(res.exception)
    return res


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny LLM, a data file, and the store one writer makes of them (the reference)."""
    d = tmp_path_factory.mktemp("dist")
    model = save_llama(d / "llama", layers=3)
    data = write_jsonl(d / "p.jsonl", PAIRS * 4)  # 20 examples
    common = ["--model", model, "--data", data, "--layers", "0,2", "--batch-size", "2", "--quiet"]
    cli("write", d / "one.store", *common)
    return {"dir": d, "common": common, "one": actstore.ActStore(d / "one.store")}


def assert_same_store(path, one) -> None:
    other = actstore.ActStore(path)
    assert len(other) == len(one) == 20
    assert list(other.field("sample_key")) == list(one.field("sample_key"))
    assert list(other.texts("response")) == list(one.texts("response"))
    for i in range(len(one)):
        for layer in (0, 2):
            np.testing.assert_array_equal(other[i, layer], one[i, layer])
    assert verify_store(path, deep=True).problems == []


# ---- ranks from the launcher's environment -------------------------------------------
def test_rank_precedence_and_errors():
    env = {
        "SLURM_ARRAY_TASK_ID": "5",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "SLURM_ARRAY_TASK_MIN": "2",
        "SLURM_ARRAY_TASK_STEP": "1",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    assert ranks.from_env(env) == ranks.Rank(3, 4, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
    del env["SLURM_ARRAY_TASK_ID"]
    assert ranks.from_env(env) == ranks.Rank(0, 1, "SLURM_PROCID/SLURM_NTASKS")
    del env["SLURM_PROCID"]
    assert ranks.from_env(env) == ranks.Rank(1, 2, "RANK/WORLD_SIZE")
    assert ranks.from_env({}) is None
    assert ranks.resolve(None, None, {}) == ranks.Rank(0, 1, "default (one writer)")
    assert ranks.resolve(2, 3, env) == ranks.Rank(2, 3, "--rank/--world-size")  # flags win over the environment
    with pytest.raises(
        CaptureError, match=r"rank must be in 0\.\.1 for a world size of 2 \(from RANK/WORLD_SIZE\)\. Got 2"
    ):
        ranks.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(CaptureError, match=r"SLURM_ARRAY_TASK_ID=3 is not on the array's grid \(min 0, step 2\)"):
        ranks.from_env({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_STEP": "2"})
    with pytest.raises(CaptureError, match=r"environment variable RANK='x' is not an integer"):
        ranks.from_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(CaptureError, match="give --rank and --world-size together"):
        ranks.resolve(1, None, {})


def test_slurm_array_and_torchrun_variables_give_the_ranks(job):
    path = job["dir"] / "env.store"
    res = cli("write", path, *job["common"], env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert "rank 1 of 2 (from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT)" in res.output
    assert "run `actstore finalize" in res.output and not (path / "manifest.json").exists()
    res = cli("finalize", path, ok=False)
    assert res.exit_code != 0 and "rank 0 of the 2 recorded with its shards wrote no shard" in res.output
    res = cli("write", path, *job["common"], env={"RANK": "0", "WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": None})
    assert "rank 0 of 2 (from RANK/WORLD_SIZE)" in res.output
    cli("finalize", path)
    assert actstore.ActStore(path).manifest.world_size == 2
    assert_same_store(path, job["one"])


_TORCHRUN = "import sys; from torch.distributed.run import main; sys.argv[0] = 'torchrun'; main()"


def test_torchrun_launches_two_ranks(job):
    path = job["dir"] / "torchrun.store"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    port = _free_port()
    args = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python"]
    args += [str(Path(sys.executable).parent / "actstore"), "write", str(path), *map(str, job["common"])]
    # torchrun itself forked (tests/forked.py); the two ranks it starts are processes of their own.
    res = forked.run_code(_TORCHRUN, *args, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "rank 0 of 2 (from RANK/WORLD_SIZE)" in res.stderr and "rank 1 of 2 (from RANK/WORLD_SIZE)" in res.stderr
    cli("finalize", path)
    assert_same_store(path, job["one"])


def test_write_refuses_a_shard_another_writer_holds_before_the_model_loads(job, monkeypatch):
    from actstore.capture import run as run_mod

    path = job["dir"] / "held.store"
    w = actstore.ShardWriter(path, shard=0, layers=[0, 2], d_model=16, tokens=4, world_size=2)

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "load_model", no_model)
    res = cli("write", path, *job["common"], "--rank", "0", "--world-size", "2", "--resume", ok=False)
    assert res.exit_code == 1
    assert (
        f"shard 0 of {path} is being written by another writer: pid {os.getpid()} on host {socket.gethostname()}"
        in res.output
    )
    w._close_files()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- Ray ---------------------------------------------------------------------------
def test_ray_address_that_does_not_answer_fails_fast(job):
    start = time.monotonic()
    res = cli(
        "write",
        job["dir"] / "none.store",
        *job["common"],
        "--runner",
        "ray",
        "--workers",
        "2",
        "--ray-address",
        f"127.0.0.1:{_free_port()}",
        ok=False,
    )
    assert res.exit_code == 1 and "no Ray cluster answers at 127.0.0.1:" in res.output
    assert time.monotonic() - start < 30
    assert not (job["dir"] / "none.store").exists()


# (The tests below share one Ray cluster, which must not be running for the one above.)
@pytest.fixture(scope="module")
def ray_cluster(s3_endpoint):
    """One `ray start --head` on 127.0.0.1 for the module's tests (starting one takes 5-10 s
    here), with a private temp dir, started once the S3 test server's environment is set,
    which its workers inherit; every process of it ended at teardown."""
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port = _free_port()
    env = {**os.environ, **RAY_ENV}
    ray_bin = str(Path(sys.executable).parent / "ray")
    # A session of its own: every process of the cluster (agents rename their command
    # lines) carries the session id of `ray start`.
    start = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--include-dashboard",
            "false",
            "--include-log-monitor",
            "false",
            "--object-store-memory",
            str(80 * 2**20),
            "--temp-dir",
            str(temp),
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err = start.communicate(timeout=120)
        assert start.returncode == 0, err[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        _end_processes_of(temp, start.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _end_processes_of(temp: Path, session: int) -> None:
    """SIGTERM, then SIGKILL, every process of the cluster's session or naming its temp dir
    (`ray stop` would end other runs' clusters too)."""

    def ours() -> list[int]:
        found = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    sid = int((p / "stat").read_bytes().rsplit(b")", 1)[1].split()[3])
                    if sid == session or str(temp).encode() in (p / "cmdline").read_bytes():
                        found.append(int(p.name))
                except (OSError, IndexError, ValueError):
                    pass
        return found

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while ours() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert ours() == []


@pytest.fixture(scope="module")
def ray_in_process(ray_cluster):
    """This process's Ray driver, joined to the module's cluster: `actstore write --runner ray`
    and record(runner="ray") in this process use it."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_ENV.items():
            mp.setenv(k, v)
        # Read when ray was imported (before RAY_ENV was set): keep this driver on loopback too.
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        ray.init(address=ray_cluster, logging_level="ERROR", log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def test_ray_cluster_from_ray_address_writes_to_s3_equal_to_a_local_capture(job, s3_url, ray_cluster, monkeypatch):
    """`actstore write` joins the cluster at RAY_ADDRESS (and leaves it at the end); each actor
    writes its own shard straight to the bucket (the actors reach moto through the AWS_*
    environment they inherit); leases work through conditional puts there too. First of the
    module's Ray tests: no driver has joined the cluster yet (ray_in_process)."""
    assert not ray.is_initialized()
    for k, v in {**RAY_ENV, "RAY_ADDRESS": ray_cluster}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)  # see ray_in_process
    cli("write", s3_url, *job["common"], "--runner", "ray", "--workers", "2")
    assert not ray.is_initialized()
    assert_same_store(s3_url, job["one"])
    assert actstore.ActStore(s3_url).manifest.world_size == 2
    w = actstore.ShardWriter(s3_url + "2", shard=0, layers=[0], d_model=4, tokens=2)
    with pytest.raises(
        actstore.errors.ShardBusyError,
        match=rf"shard 0 of {s3_url}2 is being written by another writer: pid {os.getpid()}",
    ):
        actstore.ShardWriter(s3_url + "2", shard=0, layers=[0], d_model=4, tokens=2, resume=True)
    w._close_files()
    with actstore.ShardWriter(s3_url + "2", shard=0, layers=[0], d_model=4, tokens=2, resume=True) as w2:
        w2.append(np.ones((1, 1, 2, 4), np.float16))
    actstore.finalize(s3_url + "2")
    assert np.array_equal(actstore.ActStore(s3_url + "2")[0, 0], np.ones((2, 4), np.float16))


def test_ray_workers_equal_a_single_writer_and_a_killed_actor_is_restarted(job, ray_in_process):
    """Writer 1's process is killed as soon as it holds its shard; Ray restarts it and it
    resumes; the store equals one writer's (the uninterrupted Ray runs below equal it too)."""
    killed = tmp = job["dir"] / "ray-kill.store"
    pids: list[int] = []

    def killer() -> None:
        lease = tmp / keys.lease_key(1, 0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not pids:
            try:
                pid = json.loads(lease.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                time.sleep(0.01)
                continue
            os.kill(pid, signal.SIGKILL)
            pids.append(pid)

    t = threading.Thread(target=killer)
    t.start()
    res = cli(
        "write",
        killed,
        *job["common"],
        "--runner",
        "ray",
        "--workers",
        "2",
        "--batch-size",
        "1",
        "--commit-mb",
        "0.001",
    )
    t.join()
    assert pids, "writer 1 was never seen holding its shard"
    assert "finalized" in res.output
    assert_same_store(killed, job["one"])
    assert actstore.ActStore(killed).manifest.world_size == 2
    assert not list(
        (killed / keys.LEASES).iterdir()
    )  # the restarted writer took the dead one's lease over and gave it back


def test_record_with_the_ray_engine_equals_one_writer(job, ray_in_process, tmp_path):
    """actstore.record(..., runner="ray"): the list of batches split among writer actors, each
    loading the model from its folder; the store equals a single record() value for value."""
    import torch
    from capture_support import SENTENCES, tiny_llama

    from actstore.capture import record

    _, tok = tiny_llama(layers=3)
    enc = [tok(SENTENCES[i % len(SENTENCES)] + " the end" * (i % 3)) for i in range(10)]
    batches = []
    for b in range(0, 10, 2):
        ids = [e["input_ids"] for e in enc[b : b + 2]]
        t = max(map(len, ids))
        batches.append(
            {
                "input_ids": torch.tensor([x + [0] * (t - len(x)) for x in ids]),
                "attention_mask": torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in ids]),
            }
        )
    model_dir = job["dir"] / "llama"
    common = {"layers": [0, 2], "segments": {"tokens": max(len(e["input_ids"]) for e in enc)}}
    record(tiny_llama(layers=3)[0], batches, tmp_path / "one", **common)
    seen = []
    results = record(
        str(model_dir), batches, tmp_path / "ray", runner="ray", workers=2, progress=lambda *a: seen.append(a), **common
    )
    assert [(r.shard, r.n_written) for r in results] == [(0, 4), (1, 6)] and sum(a[0] for a in seen) == 10
    actstore.finalize(tmp_path / "ray")
    actstore.finalize(tmp_path / "one")
    one, two = actstore.ActStore(tmp_path / "one"), actstore.ActStore(tmp_path / "ray")
    assert len(two) == len(one) == 10 and two.manifest.world_size == 2
    for i in range(10):
        assert two.token_ids(i).tolist() == enc[i]["input_ids"]
        for layer in (0, 2):
            np.testing.assert_array_equal(two[i, layer], one[i, layer])
    again = record(str(model_dir), batches, tmp_path / "ray", runner="ray", workers=2, resume=True, **common)
    assert [(r.n_before, r.n_written) for r in again] == [
        (4, 0),
        (6, 0),
    ]  # finished shards: nothing loaded, nothing written
    with pytest.raises(
        CaptureError, match=r"already holds shard 0 \(4 examples committed, complete\); pass resume=True"
    ):
        record(str(model_dir), batches, tmp_path / "ray", runner="ray", workers=2, **common)
    with pytest.raises(CaptureError, match="pass a list of batches, not a generator"):
        record(str(model_dir), (b for b in batches), tmp_path / "x", runner="ray", workers=2, **common)


def test_a_restarted_record_actor_resumes_after_the_committed_batches(tmp_path):
    """What a Ray actor restarted mid-shard runs (runner_ray._record_rank): the batches after the
    shard's committed examples, so the store equals an uninterrupted one."""
    import torch
    from capture_support import tiny_llama

    from actstore.capture import record
    from actstore.capture.options import CaptureOptions
    from actstore.capture.runner_ray import _record_rank
    from actstore.capture.writeside import ShardContents

    model, _ = tiny_llama(layers=2)
    torch.manual_seed(0)
    batches = [torch.randint(4, 60, (2, 5)) for _ in range(4)]

    _partial(tmp_path / "s", model, batches[:2])
    assert actstore.capture.committed(tmp_path / "s", 0) == (4, False)

    opts = CaptureOptions(layers=(1,))

    class Bar:
        n = 0

        def update(self, examples, tokens, nbytes):
            Bar.n += examples

    res = _record_rank(record, model, batches, str(tmp_path / "s"), 0, 1, opts, ShardContents(), None, Bar())
    assert (res.n_before, res.n_written, Bar.n) == (4, 4, 4)
    assert (
        _record_rank(record, model, batches, str(tmp_path / "s"), 0, 1, opts, ShardContents(), None, Bar()) == 8
    )  # complete: its count, no model loaded
    record(model, batches, tmp_path / "one", layers=[1])
    for p in ("s", "one"):
        actstore.finalize(tmp_path / p)
    a, b = actstore.ActStore(tmp_path / "s"), actstore.ActStore(tmp_path / "one")
    assert len(a) == len(b) == 8
    for i in range(8):
        np.testing.assert_array_equal(a[i, 1], b[i, 1])
    _partial(tmp_path / "t", model, [torch.randint(4, 60, (4, 5))])
    with pytest.raises(CaptureError, match="holds 4 committed examples, which do not end on a batch of its slice"):
        _record_rank(
            record,
            model,
            [torch.randint(4, 60, (3, 5))] * 3,
            str(tmp_path / "t"),
            0,
            1,
            opts,
            ShardContents(),
            None,
            Bar(),
        )


def _partial(path, model, batches) -> None:
    """A shard that committed `batches` and was then killed (open, not complete)."""
    from actstore.capture import committed, record

    n = sum(len(b) for b in batches)

    def then_killed():
        yield from batches
        deadline = time.monotonic() + 60
        while committed(path, 0)[0] < n and time.monotonic() < deadline:  # the writer thread commits each batch
            time.sleep(0.01)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        record(model, then_killed(), path, layers=[1], world_size=1, commit_bytes=1)


# ---- a spool written by several writers (issue 41) ----------------------------------------------
def _spooled_capture(job, path, *runner) -> None:
    """`actstore write --spool` with two writers and a simulated consumer reading as they
    write: every example read once, equal to the reference; the disk within budget + one
    block per writer."""
    from spoolsim import SimConsumer

    one = job["one"]
    eb = one.config.example_bytes()
    block, budget = 2 * eb, 6 * eb
    consumer = SimConsumer(str(path), "sae")
    thread = consumer.start()
    cli("write", path, *job["common"], *runner, "--spool", str(budget), "--commit-mb", str(block / 2**20))
    consumer.idle.clear()
    assert consumer.idle.wait(120)
    consumer.stop.set()
    thread.join(60)
    assert consumer.error is None, consumer.error
    store = actstore.ActStore(path)
    assert len(store) == 20 and consumer.max_disk <= budget + 2 * block, consumer.max_disk
    starts = {s.shard: s.start for s in store.manifest.shards}
    got = {starts[shard] + local: rows for (shard, local), rows in consumer.got.items()}
    assert sorted(got) == list(range(20))
    for i in range(20):
        for lp, layer in enumerate((0, 2)):
            np.testing.assert_array_equal(got[i][lp], one[i, layer])
    assert verify_store(path).ok and verify_store(path).n_removed_examples > 0


def test_a_spool_written_by_two_local_workers(job, monkeypatch):
    forked.writers_from_forkserver(monkeypatch)
    _spooled_capture(job, job["dir"] / "spool-local.store", "--workers", "2")


def test_a_spool_written_by_ray_workers(job, ray_in_process):
    _spooled_capture(job, job["dir"] / "spool-ray.store", "--runner", "ray", "--workers", "2")
