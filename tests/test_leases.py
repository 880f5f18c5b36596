"""One writer per shard (docs/format.md, section 5.1): racers, live and dead holders, holders on
other hosts, takeovers, renewal; and the world size finalize checks (section 6)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from writer_proc import LAYERS, D, T, example_data
from writer_proc import spawn as _spawn

import actstore
from actstore import ActStore, ShardWriter
from actstore.cli import main
from actstore.errors import LeaseLostError, NotFinalizedError, ShardBusyError, ShardExistsError
from actstore.layout import keys
from actstore.layout.leases import Lease, dump_lease


def _writer(path, shard: int = 0, **kw) -> ShardWriter:
    return ShardWriter(path, shard=shard, layers=LAYERS, d_model=D, tokens=T, texts=["id"], **kw)


def _append(w: ShardWriter, ids: list[int]) -> None:
    w.append(np.stack([example_data(i) for i in ids]), sample_keys=[f"ex{i}" for i in ids], texts={"id": ids})


def _lease_files(path) -> list[str]:
    d = Path(path) / keys.LEASES
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def _check_store(path, ids: list[int]) -> None:
    store = ActStore(path)
    assert list(store.field("sample_key")) == [f"ex{i}" for i in ids]
    for ex, k in enumerate(ids):
        for lp, layer in enumerate(LAYERS):
            assert np.array_equal(store[ex, layer], example_data(k)[lp]), (ex, layer)


@pytest.mark.slow
def test_eight_processes_racing_for_one_shard_one_writes_seven_get_the_clear_error(tmp_path):
    path, go = str(tmp_path / "s"), tmp_path / "go"
    procs = [_spawn(path, "0", "0", "12", "--batch", "3", "--sleep", "0.4", "--start-after", str(go)) for _ in range(8)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready.*"))) < 8:  # every racer imported and waits at the start line
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    winners = [p for p in procs if p.returncode == 0]
    assert len(winners) == 1, [err[-300:] for _, err in outs]
    for p, (_, err) in zip(procs, outs):
        if p is not winners[0]:
            assert p.returncode != 0
            assert (
                f"ShardBusyError: shard 0 of {path} is being written by another writer: pid {winners[0].pid} on host "
                f"{socket.gethostname()}, writing since " in err
            ), err[-600:]
    actstore.finalize(path)
    _check_store(path, list(range(12)))
    assert _lease_files(path) == []  # the winner gave its lease back


def test_a_live_writer_refuses_a_resumer_and_a_killed_ones_shard_is_taken_over(tmp_path):
    path = str(tmp_path / "s")
    p = _spawn(path, "0", "0", "60", "--batch", "2", "--commit-bytes", "2000", "--sleep", "0.05")
    for line in p.stdout:
        if line.startswith("appended") and int(line.split()[3]) >= 6:
            break
    with pytest.raises(
        ShardBusyError, match=rf"being written by another writer: pid {p.pid} on host {socket.gethostname()}"
    ):
        _writer(path, resume=True)
    assert _lease_files(path) == ["shard-00000.0.json"]
    p.kill()
    p.wait()
    with pytest.raises(ShardExistsError, match="pass resume=True"):  # dead holder: the usual rule applies
        _writer(path)
    assert _lease_files(path) == []  # that writer took the dead holder's lease over (generation 1), then gave it back
    with _writer(path, resume=True) as w:
        held = json.loads((Path(path) / keys.LEASES / "shard-00000.0.json").read_text())
        assert (held["pid"], held["host"], held["generation"]) == (os.getpid(), socket.gethostname(), 0)
        n = w.n_committed
        assert n >= 6
        _append(w, list(range(n, 60)))
    assert _lease_files(path) == []
    actstore.finalize(path)
    _check_store(path, list(range(60)))


def test_two_open_writers_of_one_shard_in_one_process(tmp_path):
    path = tmp_path / "s"
    w = _writer(path)
    _append(w, [0, 1])
    w.commit()
    with pytest.raises(ShardBusyError, match=rf"pid {os.getpid()} on host"):
        _writer(path, resume=True)
    w._close_files()  # gone without completing the shard, as after an error
    with _writer(path, resume=True) as w2:  # its lease is free
        _append(w2, [2])
    actstore.finalize(path)
    _check_store(path, [0, 1, 2])


def _foreign_lease(path, renewed: float, ttl: float = 5.0, generation: int = 0) -> None:
    lease = Lease(
        shard=0,
        generation=generation,
        token="f" * 32,
        host="gpu-node-7.cluster",
        pid=4242,
        pid_start=None,
        started="2026-11-24T01:02:03Z",
        renewed=renewed,
        ttl=ttl,
    )
    (Path(path) / keys.LEASES).mkdir(parents=True, exist_ok=True)
    (Path(path) / keys.lease_key(0, generation)).write_bytes(dump_lease(lease))


def test_a_lease_from_another_host_holds_until_its_ttl_runs_out(tmp_path):
    path = tmp_path / "s"
    _foreign_lease(path, renewed=time.time())
    with pytest.raises(ShardBusyError) as e:
        _writer(path)
    assert str(e.value).startswith(
        f"shard 0 of {path} is being written by another writer: pid 4242 on host gpu-node-7.cluster, writing since "
        "2026-11-24T01:02:03Z (lease leases/shard-00000.0.json)"
    )
    assert "5 s after its last renewal" in str(e.value)
    _foreign_lease(path, renewed=time.time() - 6)  # not renewed for longer than its TTL: dead
    with _writer(path) as w:
        assert _lease_files(path) == ["shard-00000.1.json"]
        _append(w, [0, 1, 2])
    actstore.finalize(path)
    _check_store(path, [0, 1, 2])


def test_a_writer_whose_lease_was_taken_over_commits_nothing_more(tmp_path):
    path = tmp_path / "s"
    w = _writer(path)
    _append(w, [0, 1])
    w.commit()
    _foreign_lease(path, renewed=time.time(), generation=1)  # a taker on another host
    _append(w, [2, 3])
    with pytest.raises(
        LeaseLostError, match="lease on shard 0 of .* was taken over by pid 4242 on host gpu-node-7.cluster"
    ):
        w.commit()
    commit = json.loads((Path(path) / "shards/shard-00000.zarr/meta/commit.json").read_text())
    assert commit["n_committed"] == 2  # nothing more committed
    w._close_files()
    assert _lease_files(path) == ["shard-00000.1.json"]  # the taker's lease is left alone


def test_a_held_lease_is_renewed(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_LEASE_TTL", "1")
    path = tmp_path / "s"
    with _writer(path):
        f = Path(path) / keys.lease_key(0, 0)
        first = json.loads(f.read_text())
        assert first["ttl"] == 1.0
        deadline = time.monotonic() + 0.9  # renewed well before the TTL runs out: seen as soon as it is
        while (later := json.loads(f.read_text()))["renewed"] == first["renewed"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert later["renewed"] > first["renewed"] and later["token"] == first["token"]


def test_finalize_names_missing_ranks_and_allow_partial_records_them(tmp_path):
    path = tmp_path / "s"
    for rank in (0, 2, 5):
        with _writer(path, shard=rank, world_size=8) as w:
            _append(w, [10 * rank, 10 * rank + 1])
    with pytest.raises(NotFinalizedError, match=r"ranks 1, 3-4, 6-7 of the 8 recorded with its shards wrote no shard"):
        actstore.finalize(path)
    assert not (Path(path) / "manifest.json").exists()
    res = CliRunner().invoke(main, ["finalize", str(path)])
    assert res.exit_code != 0 and "ranks 1, 3-4, 6-7" in res.output
    m = actstore.finalize(path, allow_partial=True)
    assert m.world_size == 8 and m.partial.missing_ranks == (1, 3, 4, 6, 7) and m.partial.incomplete_shards == ()
    _check_store(path, [0, 1, 20, 21, 50, 51])
    info = CliRunner().invoke(main, ["info", str(path)])
    assert "ranks        8 (world size of the run)" in info.output
    assert "PARTIAL      finalized with --allow-partial: missing ranks [1, 3, 4, 6, 7]" in info.output
    assert CliRunner().invoke(main, ["verify", str(path)]).exit_code == 0
    strict = CliRunner().invoke(main, ["verify", "--strict", str(path)])
    assert strict.exit_code == 1 and "finalized as partial" in strict.output


def test_finalize_refuses_mixed_world_sizes_and_shards_beyond_the_world(tmp_path):
    path = tmp_path / "s"
    with _writer(path, shard=0, world_size=2) as w:
        _append(w, [0])
    with _writer(path, shard=1, world_size=3) as w:
        _append(w, [1])
    with pytest.raises(
        actstore.errors.CorruptStoreError, match=r"different world sizes \(2 ranks: shards 0; 3 ranks: shards 1\)"
    ):
        actstore.finalize(path)
    with pytest.raises(ValueError, match=r"world_size must be an int in 4\.\.100000"):
        _writer(tmp_path / "t", shard=3, world_size=3)
    with _writer(path, shard=1, world_size=2, overwrite=True) as w:
        _append(w, [1])
    m = actstore.finalize(path)
    assert m.world_size == 2 and m.partial is None and len(m.shards) == 2


def test_a_resume_keeps_the_world_size(tmp_path):
    path = tmp_path / "s"
    w = _writer(path, shard=1, world_size=2)
    _append(w, [5])
    w.commit()
    w._close_files()
    with pytest.raises(
        actstore.errors.StoreMismatchError, match="rank 1 of 2 ranks; resume it with world size 2, not 4"
    ):
        _writer(path, shard=1, world_size=4, resume=True)
    with _writer(path, shard=1, resume=True) as w2:
        assert w2.world_size == 2
    with pytest.raises(NotFinalizedError, match=r"rank 0 of the 2 recorded"):
        actstore.finalize(path)
