"""Several writer processes at once; SIGKILL and resume; never-finalized stores."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from writer_proc import LAYERS, example_data
from writer_proc import spawn as _spawn

import actstore
from actstore import ActStore
from actstore.errors import NotFinalizedError

pytestmark = pytest.mark.slow  # racing writer processes

ROOT = Path(__file__).resolve().parents[1]


def _check_store(path, ids: list[int]) -> None:
    store = ActStore(path)
    assert len(store) == len(ids)
    keys = list(store.field("sample_key"))
    assert keys == [f"ex{i}" for i in ids]
    assert list(store.texts("id")) == ids
    for ex, k in enumerate(ids):
        want = example_data(k)
        for lp, layer in enumerate(LAYERS):
            assert np.array_equal(store[ex, layer], want[lp]), (ex, layer)


def test_two_writer_processes_then_finalize(tmp_path):
    path = str(tmp_path / "s")
    procs = [_spawn(path, "0", "0", "40", "--sleep", "0.005"), _spawn(path, "1", "1000", "25", "--sleep", "0.005")]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    m = actstore.finalize(path)
    assert [(s.shard, s.start, s.n_examples) for s in m.shards] == [(0, 0, 40), (1, 40, 25)]
    # Documented order: shard-major, ascending shard number, local order within a shard.
    _check_store(path, list(range(40)) + list(range(1000, 1025)))


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_then_resume_loses_and_duplicates_nothing(tmp_path, trial):
    path = str(tmp_path / "s")
    total = 60
    p = _spawn(path, "0", "0", str(total), "--batch", "2", "--commit-bytes", "2500", "--sleep", "0.01")
    committed = 0
    target = [6, 17, 31][trial]  # kill after this many appended examples: a different moment per trial
    for line in p.stdout:
        if line.startswith("appended"):
            appended = int(line.split()[1])
            committed = int(line.split()[3])
            if appended >= target:
                p.kill()
                break
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert committed < total
    # A store that was never finalized raises a clear error, never partial data.
    with pytest.raises(NotFinalizedError, match="never finalized"):
        ActStore(path)
    with pytest.raises(NotFinalizedError, match=r"shard 0 \(\d+ examples committed\) not closed"):
        actstore.finalize(path)
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "writer_proc.py"), path, "0", "0", str(total), "--resume"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    resumed_from = int(r.stdout.split()[1])
    assert resumed_from >= committed  # everything committed before the kill survived
    actstore.finalize(path)
    _check_store(path, list(range(total)))


def test_partial_finalize_publishes_only_committed_prefix(tmp_path):
    path = str(tmp_path / "s")
    p = _spawn(path, "0", "0", "50", "--batch", "2", "--commit-bytes", "2500", "--sleep", "0.01")
    for line in p.stdout:
        if line.startswith("appended") and int(line.split()[1]) >= 20:
            committed = int(line.split()[3])
            p.kill()
            break
    p.wait(timeout=30)
    m = actstore.finalize(path, allow_partial=True)
    assert m.shards[0].complete is False
    assert m.n_examples >= committed and m.n_examples < 50
    _check_store(path, list(range(m.n_examples)))
