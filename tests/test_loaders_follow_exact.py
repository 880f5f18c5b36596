"""A follow stream is exact or fails: across a shard rewritten under it (between two
looks, inside a read, and with a commit record identical to the old one), a store deleted
under it and a writer that died (its lease), each at an exact point (a hook in the
stream's reader thread), and its time options checked."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

import actstore
from actstore import catalog
from actstore.errors import NotFinalizedError, ShardRewrittenError, StoreNotFoundError
from actstore.layout import keys, records
from actstore.layout.leases import Lease, dump_lease
from actstore.loaders import follow
from actstore.storage import open_storage
from actstore.torch import TokenStream
from actstore.write import lease as leases

D = 8
T = 6
PER_BLOCK = 5


def block(seed: int) -> np.ndarray:
    """(PER_BLOCK, 2, T, D) float16 activations, all tokens kept (full lengths)."""
    return np.random.default_rng(seed).standard_normal((PER_BLOCK, 2, T, D)).astype(np.float16)


def writer(path, **kw):
    return actstore.ShardWriter(path, shard=0, world_size=1, layers=[1, 3], d_model=D, segments={"tokens": T}, **kw)


def rows(*blocks: np.ndarray) -> set[bytes]:
    """Every token vector of the blocks, as bytes (each block's vectors are distinct)."""
    return {r.tobytes() for b in blocks for r in b.reshape(-1, D)}


def streamed(batches: list[torch.Tensor]) -> list[bytes]:
    return [r.tobytes() for b in batches for r in b.numpy()]


def stream(path, **kw):
    opts = dict(batch_size=4, buffer_bytes=40 * D * 2, poll_s=0.01, idle_timeout_s=60, token_mask="all")
    return TokenStream.follow(path, **{**opts, **kw})


def drain(it, into: list) -> None:
    for b in it:
        into.append(b.clone())


def hook_idle(monkeypatch, action):
    """Run `action(taken)` once, in the reader thread, at the first idle look after rows
    were taken (between two polls: an exact point); returns the list of looks."""
    real = follow.check_writers
    looks: list[int] = []  # examples taken at each look at the writers
    fired = []

    def check(storage, taken):
        looks.append(sum(t.n for t in taken.values()))
        real(storage, taken)
        if looks[-1] and not fired:
            fired.append(True)
            action(taken)

    monkeypatch.setattr(follow, "check_writers", check)
    return looks


def test_a_shard_rewritten_while_followed_fails_naming_it_and_yields_none_of_the_new_rows(tmp_path):
    path = tmp_path / "s"
    a, b = block(1), block(2)
    w1 = writer(path)
    w1.append(a)
    w1.commit()
    fs = stream(path)
    it = iter(fs)
    got = [next(it).clone()]  # the pool filled with the first generation's rows
    w1.close()
    w2 = writer(path, overwrite=True)
    w2.append(b)
    w2.commit()
    with pytest.raises(
        ShardRewrittenError,
        match=r"shard 0 of .* was rewritten or deleted while it was followed .*took 5 of its examples in 1 block, ",
    ):
        drain(it, got)
    w2.close()
    yielded = streamed(got)
    assert 4 <= len(yielded) <= 60 and set(yielded) <= rows(a) and not set(yielded) & rows(b)


def test_a_shard_rewritten_inside_a_read_is_never_mixed(tmp_path, monkeypatch):
    """The rewrite lands between the two halves of the read of the second block: the
    rows read are refused (none of them yielded), and the stream fails."""
    path = tmp_path / "s"
    a, b, c = block(1), block(2), block(3)
    w1 = writer(path)
    w1.append(a)
    w1.commit()
    fired = []
    closed = threading.Event()  # w1 gave its lease back: the rewrite may take it

    class RewritingReader(follow.ShardReader):
        def read_many(self, seg, items):
            if items[0][0] >= PER_BLOCK and not fired:  # reading the second block
                fired.append(True)
                assert closed.wait(60)
                with writer(path, overwrite=True) as w2:
                    w2.append(c)
            return super().read_many(seg, items)

    monkeypatch.setattr(follow, "ShardReader", RewritingReader)
    fs = stream(path)
    it = iter(fs)
    got = [next(it).clone()]
    w1.append(b)
    w1.close()
    closed.set()
    with pytest.raises(
        ShardRewrittenError,
        match=r"shard 0 of .* was rewritten or deleted while it was followed .*took 5 of its examples in 1 block,",
    ):
        drain(it, got)
    yielded = streamed(got)
    assert fired and set(yielded) <= rows(a) and not set(yielded) & (rows(b) | rows(c))
    assert [(s, lo, hi) for s, lo, hi, _ in fs.blocks_read] == [(0, 0, 5)]  # the second block was never taken


def test_a_shard_rewritten_before_anything_was_taken_is_streamed_from_its_new_generation(tmp_path, monkeypatch):
    path = tmp_path / "s"
    a, c = block(1), block(3)
    with writer(path) as w1:
        w1.append(a)
    fired = []

    class RewritingReader(follow.ShardReader):
        def read_many(self, seg, items):
            if not fired:
                fired.append(True)
                with writer(path, overwrite=True) as w2:
                    w2.append(c)
                actstore.finalize(path)
            return super().read_many(seg, items)

    monkeypatch.setattr(follow, "ShardReader", RewritingReader)
    got: list = []
    drain(iter(stream(path)), got)
    yielded = streamed(got)
    assert fired and len(yielded) == len(rows(c)) == 60 and set(yielded) == rows(c)


def commit_bytes(path) -> bytes:
    return catalog.shard_storage(open_storage(path), 0).get(keys.COMMIT)


def test_a_rewrite_with_an_identical_commit_record_is_caught_by_the_manifest(tmp_path, monkeypatch):
    """Same counts, same second: the commit records of the two generations are byte-equal,
    and only the manifest's crc32c over the block records tells them apart."""
    monkeypatch.setattr(records, "now", lambda: "2026-01-01T00:00:00Z")
    path = tmp_path / "s"
    a, c = block(1), block(3)
    with writer(path) as w1:
        w1.append(a)
    first = commit_bytes(path)

    def rewrite(taken):
        with writer(path, overwrite=True) as w2:
            w2.append(c)
        assert commit_bytes(path) == first
        actstore.finalize(path)

    looks = hook_idle(monkeypatch, rewrite)
    got: list = []
    with pytest.raises(ShardRewrittenError, match="shard 0 .*the manifest publishes other rows of it"):
        drain(iter(stream(path)), got)
    assert looks[0] == 5 and set(streamed(got)) <= rows(a)


def test_a_store_deleted_while_followed_is_named_at_once(tmp_path, monkeypatch):
    path = tmp_path / "s"
    with writer(path) as w1:  # closed, never finalized: the stream waits for finalize
        w1.append(block(1))
    looks = hook_idle(monkeypatch, lambda taken: shutil.rmtree(path))
    with pytest.raises(
        StoreNotFoundError,
        match=r"s was deleted while it was followed \(its actstore.json is gone\) after this stream took 5 examples",
    ):
        list(stream(path, idle_timeout_s=600))
    assert looks == [5]  # named at the next poll, not after the idle timeout (600 s)


def killed_writer(path) -> None:
    """Shard 0 with one committed block, its writer gone without closing it."""
    with pytest.raises(RuntimeError):
        with writer(path) as w:
            w.append(block(1))
            w.commit()
            raise RuntimeError("killed")


def put_lease(path, **kw) -> None:
    lease = dict(shard=0, generation=0, token="t", host="elsewhere", pid=1, pid_start=None, started="x", ttl=3600.0)
    open_storage(path).put(keys.lease_key(0, 0), dump_lease(Lease(**{**lease, **kw})))


def test_a_writer_whose_lease_expires_is_reported_then_not_after_the_idle_timeout(tmp_path, monkeypatch):
    path = tmp_path / "s"
    killed_writer(path)
    put_lease(path, renewed=time.time())  # a live writer on another host
    expire = lambda taken: put_lease(path, renewed=time.time() - 7200)  # noqa: E731 - it stops renewing
    looks = hook_idle(monkeypatch, expire)
    with pytest.raises(
        NotFinalizedError,
        match=r"shard 0 of .* is not complete \(5 examples committed\) and its writer \(pid 1 on host elsewhere, writing since x\) "
        r"is dead: its lease was last renewed 7\d\d\d s ago and expires after 3600 s; resume it",
    ):
        list(stream(path, idle_timeout_s=600))
    assert looks == [5, 5]  # waited while the lease was valid, reported at the next look after it expired


def test_a_dead_writer_on_this_host_and_a_shard_no_writer_holds_are_reported_at_once(tmp_path):
    path = tmp_path / "s"
    killed_writer(path)
    with pytest.raises(
        NotFinalizedError, match="no writer holds it: its writer stopped or was killed before closing it"
    ):
        list(stream(path, idle_timeout_s=600))
    gone = subprocess.Popen(["true"])  # a process that has exited: its pid holds no writer
    gone.wait()
    put_lease(
        path, host=leases.host_name(), pid=gone.pid, pid_start=1, renewed=time.time()
    )  # (a reused pid started later)
    with pytest.raises(NotFinalizedError, match=rf"its writer \(pid {gone.pid} on host .*\) has exited; resume it"):
        list(stream(path, idle_timeout_s=600))


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"poll_s": 0}, r"poll_s must be a finite number of seconds > 0. Got 0."),
        ({"poll_s": -1.0}, r"poll_s must be a finite number of seconds > 0. Got -1.0."),
        ({"poll_s": float("nan")}, r"poll_s must be a finite number of seconds > 0. Got nan."),
        ({"poll_s": True}, r"poll_s must be a finite number of seconds > 0. Got True."),
        ({"poll_s": None}, r"poll_s must be a finite number of seconds > 0. Got None."),
        (
            {"idle_timeout_s": -0.5},
            r"idle_timeout_s must be a finite number of seconds >= 0, or None \(wait forever\). Got -0.5.",
        ),
        ({"idle_timeout_s": float("inf")}, r"idle_timeout_s must be .*Got inf."),
        ({"idle_timeout_s": "10"}, r"idle_timeout_s must be .*Got '10'."),
    ],
)
def test_the_time_options_are_checked(tmp_path, opts, message):
    with pytest.raises(ValueError, match=message):
        TokenStream.follow(tmp_path / "s", **opts)


def test_idle_timeout_zero_and_none_are_accepted(tmp_path):
    assert TokenStream.follow(tmp_path / "s", idle_timeout_s=0).idle_timeout_s == 0.0
    assert TokenStream.follow(tmp_path / "s", idle_timeout_s=None).idle_timeout_s is None
