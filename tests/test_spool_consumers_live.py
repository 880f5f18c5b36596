"""Consumers of a spool while it is written (issue 41's acceptance): a capture of more
than 10x the budget with two live consumers gets every token to each once while the kept
activation bytes (sampled at every commit and in between) never pass the budget plus one
block per writer; a writer waits while one consumer is paused and goes on when it reads
again (events, no sleeps); the same with one writer and one consumer on s3://."""

from __future__ import annotations

import multiprocessing
import os
import threading

import numpy as np
import pytest
import spoolhelp as sh
from spoolsim import activation_bytes

import actstore
from actstore.errors import ConsumerDroppedError, NotFinalizedError
from actstore.loaders.consumerrecord import read_record
from actstore.loaders.consumerstate import triples_of
from actstore.spoolstate import read_state
from actstore.storage import open_storage
from actstore.torch import TokenStream
from actstore.write import spool as writer_spool

BLOCK = sh.PER_BLOCK * len(sh.LAYERS) * sh.T * sh.D * 2  # activation bytes of one block (padding included)
WAIT = 120
OPTS = dict(batch_size=8, buffer_bytes=2 * BLOCK // 2, token_mask="all", poll_s=0.005, idle_timeout_s=WAIT)


@pytest.fixture(autouse=True)
def quick_writers(monkeypatch):
    monkeypatch.setattr(writer_spool, "POLL_SECONDS", 0.005)  # a waiting writer looks again this often


class Disk:
    """The store's activation bytes, sampled after every commit and by a thread between them."""

    def __init__(self, url, monkeypatch):
        self.storage, self.high, self.stop = open_storage(url), 0, threading.Event()
        real = writer_spool.SpoolGate.committed

        def committed(gate, *args):
            real(gate, *args)
            self.sample()

        monkeypatch.setattr(writer_spool.SpoolGate, "committed", committed)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sample(self):
        self.high = max(self.high, activation_bytes(self.storage))

    def run(self):
        while not self.stop.wait(0.002):  # a sampling cadence, not a synchronisation
            self.sample()

    def close(self):
        self.stop.set()
        self.thread.join()
        return self.high


def train(url, name, layers, got, errors, paused=None, pause_after=0, **kw):
    """A consumer's loop in a thread: its batches into got[name]; waits on `paused` (an
    Event it clears to go on) after `pause_after` batches."""

    def loop():
        try:
            for i, b in enumerate(
                TokenStream.follow(url, consumer=name, layers=layers, ack="yielded", **{**OPTS, **kw})
            ):
                got[name].append(b.clone())
                if paused is not None and i + 1 == pause_after:
                    paused["at"].set()
                    assert paused["go"].wait(WAIT)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    return t


def spooled_writer(url, shard, world_size, budget):
    return sh.writer(url, shard, world_size, spool=budget, commit_bytes=BLOCK, zarr_format=2)


def test_a_capture_of_12x_the_budget_with_two_consumers(tmp_path, monkeypatch):
    url = str(tmp_path / "s")
    budget, n_blocks = 6 * BLOCK, 36  # 2 writers x 36 blocks = 12x the budget
    got, errors = {"l1": [], "l3": []}, []
    readers = [train(url, "l1", [1], got, errors), train(url, "l3", [3], got, errors)]
    writers = [spooled_writer(url, s, 2, budget) for s in (0, 1)]  # the store and its spool exist
    disk = Disk(url, monkeypatch)

    def write(shard):
        with writers[shard] as w:
            sh.write_blocks(url, shard, range(n_blocks), w=w)

    ts = [threading.Thread(target=write, args=(s,)) for s in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT)
    actstore.finalize(url)
    for t in readers:
        t.join(WAIT)
    high = disk.close()
    assert not errors, errors
    assert sh.rows(got["l1"]) == sh.expected({0: n_blocks, 1: n_blocks}, [1])
    assert sh.rows(got["l3"]) == sh.expected({0: n_blocks, 1: n_blocks}, [3])
    assert 0 < high <= budget + 2 * BLOCK, (high, budget)
    state = read_state(open_storage(url))
    assert sum(b.nbytes for b in state.blocks) == 2 * n_blocks * BLOCK >= 12 * budget
    assert state.removed_bytes >= 2 * n_blocks * BLOCK - budget - 2 * BLOCK  # all but what the last waits kept
    assert sum(w.spool.waited_seconds > 0 for w in writers) >= 1  # the budget held the writers back


def test_the_writer_waits_while_a_consumer_is_paused_and_goes_on(tmp_path, monkeypatch):
    url = str(tmp_path / "s")
    budget, n_blocks = 5 * BLOCK, 30
    got, errors = {"fast": [], "slow": []}, []
    paused = {"at": threading.Event(), "go": threading.Event()}
    w = spooled_writer(url, 0, 1, budget)
    readers = [
        train(url, "fast", [1], got, errors),
        train(url, "slow", [3], got, errors, paused=paused, pause_after=2),
    ]
    done = threading.Event()

    def write():
        with w:
            sh.write_blocks(url, 0, range(n_blocks), w=w)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert paused["at"].wait(WAIT)  # the slow consumer holds its blocks ...
    assert w.spool.waiting.wait(WAIT)  # ... so the writer waits for it
    at_wait = w.n_committed
    assert not done.is_set() and at_wait < n_blocks * sh.PER_BLOCK
    assert activation_bytes(open_storage(url)) <= budget + BLOCK
    paused["go"].set()  # it reads again: the writer goes on
    assert done.wait(WAIT)
    writer.join(WAIT)
    actstore.finalize(url)
    for t in readers:
        t.join(WAIT)
    assert not errors, errors
    assert w.n_committed == n_blocks * sh.PER_BLOCK > at_wait
    assert sh.rows(got["fast"]) == sh.expected({0: n_blocks}, [1])
    assert sh.rows(got["slow"]) == sh.expected({0: n_blocks}, [3])


@pytest.mark.slow  # moto: about 5 s
def test_one_writer_and_one_consumer_of_a_spool_on_s3(s3_url):
    budget, n_blocks = 4 * BLOCK, 16
    got, errors = {"sae": []}, []
    reader = train(s3_url, "sae", [1], got, errors, poll_s=0.02)
    with spooled_writer(s3_url, 0, 1, budget) as w:
        sh.write_blocks(s3_url, 0, range(n_blocks), w=w)
    actstore.finalize(s3_url)
    reader.join(WAIT)
    assert not errors, errors
    assert sh.rows(got["sae"]) == sh.expected({0: n_blocks}, [1])
    state = read_state(open_storage(s3_url))
    assert state.removed_bytes > 0 and w.spool.waited_seconds > 0
    assert state.kept_bytes <= budget + BLOCK


def test_a_consumer_that_never_checkpoints_is_told_why_and_a_drop_lets_the_writer_go_on(tmp_path):
    """ack="checkpoint" without state_dict() calls acknowledges nothing: the writer waits, the
    consumer's idle timeout names the pending acknowledgements; `spool drop` (its record)
    lets the writer finish, and the dropped consumer is refused from then on."""
    url = str(tmp_path / "s")
    w = spooled_writer(url, 0, 1, 3 * BLOCK)
    s = TokenStream.follow(url, consumer="lazy", **{**OPTS, "layers": [1], "idle_timeout_s": 0.5})
    done = threading.Event()

    def write():
        with w:
            sh.write_blocks(url, 0, range(10), w=w)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    got = []
    with pytest.raises(
        NotFinalizedError,
        match=r"consumer 'lazy' has \d+ examples yielded but not acknowledged, which a spool's writers wait for: call state_dict\(\)",
    ):
        got.extend(b.clone() for b in s)
    assert w.spool.waiting.is_set() and not done.is_set() and got
    writer_spool.drop(open_storage(url), "lazy", by="the test")  # `actstore spool drop STORE lazy`
    assert done.wait(WAIT)  # nothing holds the blocks back now
    writer.join(WAIT)
    with pytest.raises(ConsumerDroppedError, match="consumer 'lazy' of .* was dropped"):
        s.state_dict()  # (its acknowledgement is refused)
        s.state_dict()
    with pytest.raises(ConsumerDroppedError, match="register under a new name"):
        TokenStream.follow(url, consumer="lazy", **OPTS)


def test_manual_acknowledgement_writes_exactly_the_state_given(tmp_path):
    url = str(tmp_path / "s")
    sh.write_blocks(url, 0, range(8))
    actstore.finalize(url)
    s = TokenStream.follow(url, consumer="m", ack="manual", **{**OPTS, "layers": [1]})
    it = iter(s)
    for _ in range(8):
        next(it)
    first = s.state_dict()
    next(it)
    s.state_dict()
    assert dict(read_record(open_storage(url), "m", 0).acked) == {}  # nothing until acknowledge()
    s.acknowledge(first)
    assert triples_of(read_record(open_storage(url), "m", 0).acked) == first["completed"] != []


def test_two_ranks_of_one_consumer_share_a_live_spool(tmp_path):
    """Ranks 0 and 1 of one name (threads standing in for DDP processes) each read the blocks
    block_owner gives them; together they consume the spool, disjointly and completely."""
    url = str(tmp_path / "s")
    budget, n_blocks = 4 * BLOCK, 20
    got, errors = {"r0": [], "r1": []}, []
    w = spooled_writer(url, 0, 1, budget)

    def rank(r):
        try:
            for b in TokenStream.follow(
                url, consumer="ddp", rank=r, world_size=2, ack="yielded", **{**OPTS, "layers": [1]}
            ):
                got[f"r{r}"].append(b.clone())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ranks = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ranks:
        t.start()
    with w:
        sh.write_blocks(url, 0, range(n_blocks), w=w)
    actstore.finalize(url)
    for t in ranks:
        t.join(WAIT)
    assert not errors, errors
    r0, r1 = sh.rows(got["r0"]), sh.rows(got["r1"])
    assert r0 + r1 == sh.expected({0: n_blocks}, [1]) and not (r0 & r1)
    assert r0 == sum((sh.block_rows(0, i) for i in range(0, n_blocks, 2)), sh.Counter())  # (0 + i) % 2 == 0
    assert w.spool.waited_seconds > 0 and read_state(open_storage(url)).removed_bytes > 0


def _consume_to_file(url: str, name: str, layer: int, out: str) -> None:
    """A consumer process: every batch's vectors appended to `out`."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for b in TokenStream.follow(url, consumer=name, layers=[layer], ack="yielded", **OPTS):
        os.write(fd, b.numpy().tobytes())
    os._exit(0)


def test_consumers_in_other_processes_read_a_live_spool(tmp_path):
    """Two consumer processes (forked before the writer starts: no thread is forked) and a
    writer in this one: each process gets every token of its layer once."""
    url = str(tmp_path / "s")
    budget, n_blocks = 4 * BLOCK, 40  # 10x the budget
    fork = multiprocessing.get_context("fork")
    procs = [
        fork.Process(target=_consume_to_file, args=(url, f"p{layer}", layer, str(tmp_path / f"p{layer}")))
        for layer in sh.LAYERS
    ]
    for p in procs:
        p.start()
    with spooled_writer(url, 0, 1, budget) as w:
        sh.write_blocks(url, 0, range(n_blocks), w=w)
    actstore.finalize(url)
    for p in procs:
        p.join(WAIT)
    assert [p.exitcode for p in procs] == [0, 0]
    for layer in sh.LAYERS:
        data = np.frombuffer((tmp_path / f"p{layer}").read_bytes(), np.uint8).reshape(-1, sh.D * 2)
        assert sh.Counter(r.tobytes() for r in data) == sh.expected({0: n_blocks}, [layer])
    assert w.spool.waited_seconds > 0 and read_state(open_storage(url)).removed_bytes > 0
