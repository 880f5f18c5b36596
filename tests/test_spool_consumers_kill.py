"""The consumer's guarantee under kill -9 (docs/loaders.md, "Consumers"): a trainer killed
at a random point and restarted from its last checkpoint trains on every kept token
exactly once over its whole run, except the tokens it trained on after that checkpoint,
which it gets again. Each run is a forked process (no fresh interpreter) that logs every
vector it trains on with an unbuffered write (what a kill cannot take back) and saves
checkpoints atomically; it kills itself with SIGKILL at a random batch, at a random
phase of its checkpoint sequence; before each restart the spool removes every block the
store's record acknowledged. And a writer killed with -9 whose shard is resumed
while a consumer goes on."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import spoolhelp as sh

import actstore
from actstore.layout import spool
from actstore.loaders import consumer as consumer_module
from actstore.loaders import follow
from actstore.loaders.consumerstate import not_covered, ranges_of
from actstore.storage import open_storage
from actstore.torch import TokenStream
from actstore.write import spool as writer_spool

OPTS = dict(layers=[1], batch_size=8, buffer_bytes=24 * sh.D * 2, token_mask="all", poll_s=0.01, idle_timeout_s=60)
ROW = sh.D * 2  # bytes of one float16 token vector in the log
EVERY = 3  # batches between checkpoints
PHASES = ("after a batch", "after state_dict, before the save", "after the save")

FORK = multiprocessing.get_context("fork")


def train(path: str, work: str, kill_at: int | None, phase: str, seed: int) -> None:
    """A trainer: resume from work/ckpt.json if there is one, log each batch's vectors to
    work/log, checkpoint every EVERY batches; SIGKILL itself at batch kill_at in `phase`."""
    ckpt, log = Path(work, "ckpt.json"), Path(work, "log")
    s = TokenStream.follow(path, consumer="sae", seed=seed, **OPTS)
    if ckpt.exists():
        s.load_state_dict(json.loads(ckpt.read_text())["stream"])
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for i, b in enumerate(s, 1):
        os.write(fd, np.ascontiguousarray(b.numpy()).tobytes())  # trained on: in the page cache, a kill keeps it
        if i % EVERY == 0:
            state = s.state_dict()
            if i == kill_at and phase == PHASES[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            tmp = Path(work, "ckpt.tmp")
            tmp.write_text(json.dumps({"stream": state, "trained": os.fstat(fd).st_size // ROW}))
            os.replace(tmp, ckpt)
        if i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


def run(*args) -> int:
    p = FORK.Process(target=train, args=args)
    p.start()
    p.join(120)
    return p.exitcode


def logged(work: Path, lo: int = 0, hi: int | None = None) -> sh.Counter:
    data = (work / "log").read_bytes()
    rows = np.frombuffer(data, np.uint8).reshape(-1, ROW)[lo:hi]
    return sh.Counter(r.tobytes() for r in rows)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A finalized spool (its budget never reached), copied for each trial."""
    path = tmp_path_factory.mktemp("kill") / "s"
    for s in (0, 1):
        sh.write_blocks(path, s, range(12), world_size=2, spool=1 << 20, zarr_format=2, commit_bytes=1 << 16)
    actstore.finalize(path)
    return path


def remove_consumed(path) -> int:
    """`actstore spool gc`: remove every block that every consumer acknowledged; the bytes."""
    _, _, nbytes = writer_spool.gc(open_storage(path))
    return nbytes


def test_a_consumer_killed_at_random_points_gets_every_token_once_but_the_replayed(store, tmp_path):
    want = sh.expected({0: 12, 1: 12}, [1])
    total_batches = -(-sum(want.values()) // OPTS["batch_size"])
    rng = random.Random(41)
    replays, removed = [], []
    for trial in range(21):
        work = tmp_path / f"t{trial}"
        path = shutil.copytree(store, work / "s")
        phase = PHASES[trial % 3]
        kill_at = rng.randrange(2 * EVERY, total_batches - 1)
        if phase != PHASES[0]:
            kill_at = kill_at // EVERY * EVERY  # a checkpoint's batch
        assert run(str(path), str(work), kill_at, phase, trial) == -signal.SIGKILL
        at_kill = len((work / "log").read_bytes()) // ROW
        saved = json.loads((work / "ckpt.json").read_text())
        rec = spool.parse_consumer(open_storage(path).get(spool.consumer_key("sae", 0)), "record")
        assert not not_covered(rec.acked, ranges_of(saved["stream"]["completed"]))  # never ahead of the checkpoint
        removed.append(remove_consumed(path))  # the acknowledged blocks are gone before the restart
        assert run(str(path), str(work), None, PHASES[0], trial) == 0
        replayed = logged(work, saved["trained"], at_kill)
        replays.append(at_kill - saved["trained"])
        assert logged(work) == want + replayed, (trial, kill_at, phase)
    assert (
        sum(r > 0 for r in replays) >= 7 and sum(n > 0 for n in removed) >= 10
    )  # runs that trained past their checkpoint got those tokens again


def test_a_writer_killed_with_9_resumes_while_the_consumer_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "s"

    def capture_then_die():
        w = sh.writer(path)
        sh.write_blocks(path, 0, range(5), w=w)
        os.kill(os.getpid(), signal.SIGKILL)

    p = FORK.Process(target=capture_then_die)
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    monkeypatch.setattr(follow, "LEASE_CHECK_S", 0.0)  # look at the writers at each idle poll
    warned = threading.Event()
    lines = []
    monkeypatch.setattr(consumer_module, "warn", lambda m: (lines.append(m), warned.set()))
    got, errors = [], []

    def consume():
        try:
            got.extend(b.clone() for b in TokenStream.follow(path, consumer="sae", ack="yielded", **OPTS))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    reader = threading.Thread(target=consume)
    reader.start()
    assert warned.wait(60)  # it saw the dead writer, and waits
    with sh.writer(path, resume=True) as w:
        sh.write_blocks(path, 0, range(5, 9), w=w)
    actstore.finalize(path)
    reader.join(60)
    assert not errors and sh.rows(got) == sh.expected({0: 9}, [1])
    assert lines[0].startswith("consumer 'sae' waits for a writer to resume: shard 0 of ") and len(lines) == 1
