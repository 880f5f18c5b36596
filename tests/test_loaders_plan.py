"""EpochPlan index math (no I/O): windows tile each rank's tokens exactly once, ranks and
workers are disjoint and complete, and resume positions match the DataLoader's order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.loaders.plan import EpochPlan, consumed_per_worker, round_robin_order

plans = st.fixed_dictionaries(
    {
        "counts": st.lists(st.integers(0, 40), min_size=0, max_size=60),
        "batch_size": st.integers(1, 17),
        "window_batches": st.integers(1, 5),
        "seed": st.integers(0, 2**32),
        "epoch": st.integers(0, 5),
        "world_size": st.integers(1, 4),
        "n_workers": st.integers(1, 4),
        "shuffle": st.booleans(),
        "drop_last": st.booleans(),
        "run": st.integers(1, 7),
    }
)


def _tokens_of_rank(p, rank, n_workers):
    """(unit, token) pairs of every batch a rank yields, per worker, in yield order."""
    plan = EpochPlan(
        np.array(p["counts"], dtype=np.int64),
        batch_size=p["batch_size"],
        window_batches=p["window_batches"],
        seed=p["seed"],
        epoch=p["epoch"],
        rank=rank,
        world_size=p["world_size"],
        shuffle=p["shuffle"],
        drop_last=p["drop_last"],
        run=p["run"],
    )
    per_worker = []
    for w in range(n_workers):
        batches = []
        for j in plan.worker_windows(w, n_workers):
            win = plan.window(j)
            owner = np.repeat(win.units, win.hi - win.lo)
            tok = (
                np.concatenate([np.arange(lo, hi) for lo, hi in zip(win.lo, win.hi)])
                if len(win.units)
                else np.zeros(0, int)
            )
            assert (win.dest == np.concatenate([[0], np.cumsum(win.hi - win.lo)[:-1]])).all()
            perm = plan.window_permutation(win)
            assert sorted(perm.tolist()) == list(range(win.n_tokens))
            for b in range(win.n_batches):
                rows = perm[b * plan.batch_size : (b + 1) * plan.batch_size]
                batches.append(list(zip(owner[rows].tolist(), tok[rows].tolist())))
        per_worker.append(batches)
    assert [len(b) for b in per_worker] == plan.worker_batches(n_workers).tolist()
    return plan, per_worker


@settings(deadline=None)
@given(plans)
def test_ranks_and_workers_cover_every_token_once(p):
    everything = []
    n_batches = []
    for rank in range(p["world_size"]):
        plan, per_worker = _tokens_of_rank(p, rank, p["n_workers"])
        n_batches.append(plan.n_batches)
        for batches in per_worker:
            for b in batches:
                assert len(b) <= p["batch_size"]
                everything.extend(b)
    expected = [(u, t) for u, c in enumerate(p["counts"]) for t in range(c)]
    assert len(everything) == len(set(everything))  # disjoint
    if p["drop_last"]:
        assert len(set(n_batches)) == 1  # every rank the same number of full batches
        assert len(everything) == n_batches[0] * p["world_size"] * p["batch_size"]
        assert len(expected) - len(everything) < p["batch_size"] * (p["world_size"] + 1)
        assert set(everything) <= set(expected)
    else:
        assert sorted(everything) == expected  # complete
        assert max(n_batches) - min(n_batches) <= 1


@settings(deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.data())
def test_consumed_per_worker_matches_round_robin(worker_batches, data):
    order = round_robin_order(worker_batches)
    g = data.draw(st.integers(0, len(order)))
    want = np.zeros(len(worker_batches), dtype=int)
    for w, _ in order[:g]:
        want[w] += 1
    done, nxt = consumed_per_worker(np.array(worker_batches), g)
    assert done.tolist() == want.tolist()
    if g < len(order):
        # Rotating the cycle by `nxt` gives exactly the rest of the order.
        n = len(worker_batches)
        rest = [((w + nxt) % n, b) for w, b in round_robin_order(np.roll(np.array(worker_batches) - want, -nxt))]
        assert [(w, b + want[w]) for w, b in rest] == order[g:]


def test_same_seed_same_order_other_seed_or_epoch_another():
    counts = np.arange(50) % 7

    def order(seed, epoch):
        plan = EpochPlan(counts, batch_size=8, window_batches=2, seed=seed, epoch=epoch)
        return [
            plan.window_permutation(plan.window(j)).tolist() + plan.window(j).units.tolist()
            for j in range(plan.n_windows)
        ]

    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(4, 0)
    assert order(3, 0) != order(3, 1)


def test_runs_keep_consecutive_units_together():
    counts = np.ones(23, dtype=np.int64)
    counts[5] = 0
    plan = EpochPlan(counts, batch_size=4, window_batches=1, seed=1, epoch=0, run=4)
    order = plan.order.tolist()
    assert sorted(order) == [u for u in range(23) if u != 5] and order != sorted(order)
    runs = [tuple(u for u in order if u // 4 == g) for g in range(6)]
    for r in runs:  # each run appears contiguously, in store order
        i = order.index(r[0])
        assert tuple(order[i : i + len(r)]) == r and list(r) == sorted(r)


def test_no_shuffle_is_store_order():
    plan = EpochPlan(np.array([2, 0, 3, 1]), batch_size=4, window_batches=1, seed=0, epoch=0, shuffle=False)
    assert plan.order.tolist() == [0, 2, 3]
    w = plan.window(1)
    assert (w.units.tolist(), w.lo.tolist(), w.hi.tolist()) == ([2, 3], [2, 0], [3, 1])
    assert plan.window_permutation(w).tolist() == [0, 1]


def test_consumed_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"consumed must be in 0\.\.5 \(batches this epoch\)\. Got 6\."):
        consumed_per_worker(np.array([3, 2]), 6)
