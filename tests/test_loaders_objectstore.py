"""DataLoader workers over a store in object storage (s3:// on moto): obstore's client runs
on a tokio runtime, which does not survive fork. The loaders pick a safe start method by
themselves, refuse 'fork' up front with the fix, and a worker forked anyway fails with a
clear error instead of hanging; a worker that dies fails the loader. Every loop runs under
DataLoader's `timeout` and a SIGALRM guard, so a regression fails instead of hanging CI."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from watchdog import within

import actstore
from actstore import ActStore, ShardWriter
from actstore.loaders.pairs import PairDataset
from actstore.loaders.tokens import TokenStream

GUARD_S = 90  # far beyond a healthy run (a few seconds); a hang fails here


@pytest.fixture(scope="module")
def s3_store(s3_endpoint):
    import s3server

    url = f"s3://{s3server.create_bucket(s3_endpoint)}/store"
    rng = np.random.default_rng(0)
    with ShardWriter(url, shard=0, layers=[0, 1], d_model=6, tokens=5, stats=True) as w:
        w.append(rng.standard_normal((12, 2, 5, 6)).astype(np.float16))
    actstore.finalize(url)
    return url


def _tokens(url, **loader_kw):
    st = ActStore(url)
    st[0, 0]  # the parent has read from the store: its client (and runtime) are live
    ts = TokenStream(st, batch_size=8, seed=1, return_index=True)
    with within(GUARD_S, "the token loader"):
        return [{k: v.clone() for k, v in b.items()} for b in ts.loader(timeout=GUARD_S, **loader_kw)]


def _pairs(url, **loader_kw):
    st = ActStore(url)
    st[0, 0]
    ds = PairDataset(st)
    with within(GUARD_S, "the pair loader"):
        return [
            {k: v.clone() for k, v in b.items()} for b in ds.loader(batch_size=3, seed=2, timeout=GUARD_S, **loader_kw)
        ]


def _same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


# The token stream's workers by the default for object storage (forkserver); the spawned
# (fresh) interpreters unpickle a store in a bucket for the pair loader below, and a token
# stream in test_matrix.py's test_loaders_with_two_workers[local-spawn]: each pickle once.
def test_token_stream_with_two_workers_reads_a_bucket(s3_store):
    want = _tokens(s3_store)
    got = _tokens(s3_store, num_workers=2)
    assert sum(len(b["acts"]) for b in want) == 12 * 2 * 5
    rows = lambda bs: sorted(
        tuple(r) for b in bs for r in torch.stack([b["example"], b["layer"], b["token"]], 1).tolist()
    )  # noqa: E731
    assert rows(got) == rows(want)


@pytest.mark.parametrize("context", [None, "spawn"])
def test_pair_dataset_with_two_workers_reads_a_bucket(s3_store, context):
    want = _pairs(s3_store)
    got = _pairs(s3_store, num_workers=2, multiprocessing_context=context)
    assert len(want) == 4 and _same(got, want)


def test_fork_is_refused_up_front_with_the_fix(s3_store):
    st = ActStore(s3_store)
    with pytest.raises(
        ValueError,
        match=r"multiprocessing_context='fork' cannot read s3://.*: obstore's client .* does not "
        r"survive fork.*'spawn' or 'forkserver'",
    ):
        TokenStream(st, batch_size=8).loader(num_workers=2, multiprocessing_context="fork")
    with pytest.raises(ValueError, match=r"multiprocessing_context='fork' cannot read s3://"):
        PairDataset(st).loader(batch_size=3, num_workers=2, multiprocessing_context="fork")


def test_a_worker_forked_anyway_fails_clearly_instead_of_hanging(s3_store):
    st = ActStore(s3_store)
    st[0, 0]
    ds = PairDataset(st)
    dl = DataLoader(
        ds,
        sampler=ds.sampler(batch_size=3),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=GUARD_S,
    )
    with within(GUARD_S, "a plain DataLoader forked after the client started"):
        with pytest.raises(
            Exception, match=r"ForkedClientError.*was forked from a process that had already used obstore"
        ):
            list(dl)


class _Dies(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor(i)


def test_a_dead_worker_fails_the_loader():
    it = iter(DataLoader(_Dies(), batch_size=None, num_workers=2, multiprocessing_context="fork"))
    try:
        with within(GUARD_S, "a loader whose worker died"):
            with pytest.raises(
                RuntimeError, match=r"DataLoader worker \(pid.*(is killed by signal|exited unexpectedly)"
            ):
                list(it)
    finally:
        # The other worker ended and the pids unregistered now: while they are registered, torch's
        # SIGCHLD handler raises this error again at any child's exit, later in this test process
        # (seen once as an xdist worker's INTERNALERROR in pytest's own code).
        it._shutdown_workers()


def test_a_store_unpickled_where_the_environment_lacks_the_endpoint_reads_the_same(s3_store, tmp_path):
    """A forkserver keeps the environment of when it started, so a DataLoader worker may not
    know the endpoint the training script set later: a pickled store in object storage
    carries the provider settings it was opened with, and reads the same there."""
    import pickle

    import forked

    st = ActStore(s3_store)
    (tmp_path / "store.pkl").write_bytes(pickle.dumps(st))
    np.save(tmp_path / "want.npy", np.asarray(st[3, 1]))
    code = (
        "import os, pickle, sys, numpy as np\n"
        "assert not [k for k in os.environ if k.startswith('AWS_')]\n"
        "st = pickle.load(open(sys.argv[1], 'rb'))\n"
        "assert np.array_equal(np.asarray(st[3, 1]), np.load(sys.argv[2])); print('same', len(st))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no endpoint, no credentials
    # a process forked from the forkserver (tests/forked.py): separate, its environment only `env`
    r = forked.run_code(code, str(tmp_path / "store.pkl"), str(tmp_path / "want.npy"), env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "same 12", r.stderr[-2000:]
