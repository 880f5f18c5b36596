"""Soak: 96 SIGKILLs of durable (fsync) writers at random moments, two writer processes a
store committing side by side; after each kill the store holds only whole blocks of the
right examples (no torn block, no rows of two batches mixed), and a resume loses and
duplicates nothing. In the soak job (`pytest -m soak`, scripts/test_soak.sh)."""

from __future__ import annotations

import shutil
import signal

import forked
import numpy as np
import pytest
from writer_proc import LAYERS, example_data, spawn

import actstore
from actstore import ActStore

pytestmark = pytest.mark.soak

RUNS, KILLS = 8, 12  # 96 kills in all
TOTAL = {0: 48, 1: 30}  # examples per shard; shard 1 holds ids 1000...
FIRST = {0: 0, 1: 1000}


def _spawn(path: str, shard: int, resume: bool) -> forked.Child:
    args = [path, str(shard), str(FIRST[shard]), str(TOTAL[shard]), "--batch", "2", "--commit-bytes", "2500"]
    args += ["--fsync", "--sleep", "0.002"] + (["--resume"] if resume else [])
    return spawn(*args)


def _kill_at(p: forked.Child, after: int) -> None:
    """SIGKILL `p` once it has appended `after` examples (or let it end first)."""
    for line in p.stdout:
        if line.startswith("appended") and int(line.split()[1]) >= after:
            p.kill()
            break
    p.wait(timeout=120)


def _check_partial(path: str) -> int:
    """Publish what is committed (allow_partial) and check every stored row; returns the
    number of examples checked."""
    m = actstore.finalize(path, allow_partial=True)
    store = ActStore(path)
    ids = list(store.texts("id"))
    keys = list(store.field("sample_key"))
    want_ids = [FIRST[s.shard] + i for s in m.shards for i in range(s.n_examples)]
    assert ids == want_ids  # each shard a prefix of its examples: nothing lost, nothing twice
    assert keys == [f"ex{i}" for i in want_ids]
    for ex, k in enumerate(ids):
        want = example_data(k)
        for lp, layer in enumerate(LAYERS):
            assert np.array_equal(store[ex, layer], want[lp]), (ex, layer, k)  # whole, unmixed
    return len(ids)


@pytest.mark.parametrize("run", range(RUNS))
def test_killed_durable_writers_leave_no_torn_or_mixed_block(tmp_path, run):
    rng = np.random.default_rng(run)
    path = str(tmp_path / "s")
    kills = stores = 0
    done = {0: False, 1: False}
    started = False
    while kills < KILLS:
        if all(done.values()):  # both shards written to the end through their kills: all of it, exact
            assert _check_partial(path) == sum(TOTAL.values())
            shutil.rmtree(path)
            done, started, stores = {0: False, 1: False}, False, stores + 1
        procs = {s: _spawn(path, s, resume=started) for s in (0, 1) if not done[s]}
        for s, p in procs.items():  # the two side by side, each killed at its own random moment
            _kill_at(p, int(rng.integers(1, TOTAL[s])))
            if p.returncode == 0:
                done[s] = True
            else:
                assert p.returncode == -signal.SIGKILL, p.stderr.read()
                kills += 1
        started = True
        if kills % 3 == 0:  # now and then publish the committed part and read every row of it
            _check_partial(path)
    assert kills == KILLS
