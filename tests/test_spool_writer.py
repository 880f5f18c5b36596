"""The writer side of a spool (issue 41): ShardWriter(spool=) opens or joins a spool, waits
while the kept bytes would exceed the budget, removes consumed blocks (records first), and
the bytes on disk stay within budget + one block per writer while a simulated consumer
(tests/spoolsim.py) reads every example once, exactly as appended."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from spoolsim import SimConsumer, activation_bytes

from actstore import ShardWriter
from actstore.errors import SpoolError
from actstore.layout import spool as sp
from actstore.spoolstate import read_state
from actstore.storage import open_storage
from actstore.write import spool as wspool

L, T, D = 2, 4, 8
KW = dict(layers=[0, 1], d_model=D, tokens=T, zarr_format=2, stats=False)
EXAMPLE = L * T * D * 2  # float16
BLOCK = 4 * EXAMPLE  # commit every 4 examples
WAIT = 60  # seconds an event may take before the test fails (never slept)


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch):
    monkeypatch.setattr(wspool, "POLL_SECONDS", 0.005)


def _batches(seed: int, n: int, b: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, L, T, D)).astype(np.float16) for _ in range(n)]


def _write(url, shard, batches, budget, **kw):
    with ShardWriter(url, shard=shard, spool=budget, commit_bytes=BLOCK, **{**KW, **kw}) as w:
        for x in batches:
            w.append(x)
    return w


def _drain(consumer: SimConsumer, thread: threading.Thread) -> None:
    """Let the consumer read what is left (a look that finds nothing), then stop it."""
    consumer.idle.clear()
    assert consumer.idle.wait(WAIT)
    consumer.stop.set()
    thread.join(WAIT)


# ---- opening -------------------------------------------------------------------------


def test_the_first_writer_creates_the_spool_record(tmp_path):
    url = str(tmp_path / "s")
    with ShardWriter(url, spool="1MiB", commit_bytes=BLOCK, **KW) as w:
        assert w.spool is not None and w.spool.budget == 2**20
    rec = json.loads((tmp_path / "s" / "spool" / "spool.json").read_text())
    assert rec["budget_bytes"] == 2**20 and rec["format_version"] == 1
    # a later writer without spool= joins the spool with its budget
    with ShardWriter(url, shard=1, commit_bytes=BLOCK, **KW) as w:
        assert w.spool is not None and w.spool.budget == 2**20


def test_a_writer_with_another_budget_is_refused_naming_both(tmp_path):
    url = str(tmp_path / "s")
    _write(url, 0, [], "1MiB")
    with pytest.raises(SpoolError, match=r"budget of 1048576 bytes .* asked for 2000000 bytes"):
        ShardWriter(url, shard=1, spool="2MB", commit_bytes=BLOCK, **KW)
    assert not (tmp_path / "s" / "shards" / "shard-00001.zarr").exists()  # refused before the shard was claimed


def test_a_block_larger_than_the_budget_is_refused(tmp_path):
    with pytest.raises(SpoolError, match=r"does not fit the spool's budget of 1.00 kB"):
        ShardWriter(tmp_path / "s", spool=1000, commit_bytes=2000, **KW)


def test_zarr_shard_files_of_several_examples_are_refused(tmp_path):
    kw = {**KW, "zarr_format": 3, "shard_examples": 8}
    with pytest.raises(SpoolError, match=r"8 examples per Zarr shard file; .* zarr_format=2 \(--zarr-format 2\)"):
        ShardWriter(tmp_path / "s", spool="1MB", **kw)


def test_a_bad_budget_names_the_spellings(tmp_path):
    with pytest.raises(SpoolError, match=r"SI \(kB, MB, GB, TB, PB.*Got '5 parsecs'"):
        ShardWriter(tmp_path / "s", spool="5 parsecs", **KW)


# ---- back-pressure and removal -----------------------------------------------------------


def _appended(seeds_by_shard, n, b=2):
    return {
        (shard, i * b + j): x[j]
        for shard, seed in seeds_by_shard.items()
        for i, x in enumerate(_batches(seed, n, b))
        for j in range(b)
    }


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=[pytest.mark.slow, pytest.mark.dev])])  # s3: moto
def test_two_ranked_writers_and_a_consumer_stay_within_budget(tmp_path, where, request):
    url = request.getfixturevalue("s3_url") if where == "s3" else str(tmp_path / "s")
    budget = 4 * BLOCK
    n = 20 if where == "local" else 12  # 40 (24) examples per writer: 5x (3x) the budget in all
    consumer = SimConsumer(url, "sae")
    consumer.paused.set()  # paused first: both writers must wait for it
    thread = consumer.start()
    writers = [ShardWriter(url, shard=s, spool=budget, commit_bytes=BLOCK, world_size=2, **KW) for s in (0, 1)]
    errors: list[BaseException] = []

    def run(w):
        try:
            with w:
                for x in _batches(w.shard, n):
                    w.append(x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(w,)) for w in writers]
    for t in ts:
        t.start()
    for w in writers:
        assert w.spool.waiting.wait(WAIT)  # both wait while the consumer is paused ...
    assert activation_bytes(open_storage(url)) <= budget + 2 * BLOCK
    assert sum(len(w) for w in writers) < 2 * n * 2
    consumer.paused.clear()  # ... and go on when it reads again
    for t in ts:
        t.join(WAIT)
    _drain(consumer, thread)
    assert not errors and consumer.error is None, (errors, consumer.error)
    assert consumer.max_disk <= budget + 2 * BLOCK, consumer.max_disk
    want = _appended({0: 0, 1: 1}, n)
    assert sorted(consumer.got) == sorted(want)
    for k, x in want.items():
        np.testing.assert_array_equal(consumer.got[k], x)
    state = read_state(open_storage(url))
    assert state.removed_bytes > 0 and state.kept_bytes <= budget + 2 * BLOCK
    assert 2 * n * 2 * EXAMPLE == sum(b.nbytes for b in state.blocks)


def test_a_writer_waits_while_the_consumer_is_paused_and_goes_on(tmp_path):
    url = str(tmp_path / "s")
    budget = 3 * BLOCK
    consumer = SimConsumer(url, "sae")
    consumer.paused.set()
    thread = consumer.start()
    w = ShardWriter(url, spool=budget, commit_bytes=BLOCK, **KW)
    done = threading.Event()
    batches = _batches(5, 30)

    def run():
        with w:
            for x in batches:
                w.append(x)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    assert w.spool.waiting.wait(WAIT)  # paused consumer: the writer waits ...
    n_at_wait = len(w)
    assert n_at_wait * EXAMPLE <= budget + BLOCK and not done.is_set()
    assert activation_bytes(open_storage(url)) <= budget
    line = wspool.waiting_line(read_state(open_storage(url)), 2 * EXAMPLE)
    assert line.startswith("spool full: ") and "of 1.54 kB kept" in line
    assert line.endswith("waiting for consumer(s) sae (lagging 3 blocks)"), line
    consumer.paused.clear()  # ... and goes on once it reads again
    assert done.wait(WAIT)
    t.join(WAIT)
    _drain(consumer, thread)
    assert consumer.error is None
    assert len(consumer.got) == 60 and consumer.max_disk <= budget + BLOCK


def test_a_writer_with_no_consumer_waits_for_one_and_says_so(tmp_path, capsys):
    url = str(tmp_path / "s")
    w = ShardWriter(url, spool=2 * BLOCK, commit_bytes=BLOCK, **KW)
    done = threading.Event()

    def run():
        with w:
            for x in _batches(1, 12):
                w.append(x)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    assert w.spool.waiting.wait(WAIT)
    state = read_state(open_storage(url))
    assert "no consumer registered yet" in wspool.waiting_line(state, EXAMPLE * 2)
    consumer = SimConsumer(url, "late")
    ct = consumer.start()
    assert done.wait(WAIT)
    t.join(WAIT)
    _drain(consumer, ct)
    assert len(consumer.got) == 24


def test_removal_writes_its_record_before_deleting(tmp_path, monkeypatch):
    url = str(tmp_path / "s")
    _write(url, 0, _batches(2, 4), 10 * BLOCK)  # 8 examples, 2 blocks
    consumer = SimConsumer(url, "sae")
    consumer.register()
    consumer.look()
    storage = open_storage(url)
    state = read_state(storage)
    seen = []

    def deleting(st, ks):
        rec = json.loads((tmp_path / "s" / "spool" / "removed" / "shard-00000.zarr" / "cli-0a0b0c0d.json").read_text())
        seen.append((rec["removed"], len(ks)))
        for k in ks:
            st.delete(k)

    monkeypatch.setattr(wspool, "delete_keys", deleting)
    blocks, nbytes = wspool.remove_consumed(storage, state.record and _cfg(storage), state, "cli-0a0b0c0d")
    assert (blocks, nbytes) == (2, 8 * EXAMPLE)
    assert seen == [([[0, 8]], 8 * L)]  # the record named both blocks before a file went; one chunk per (ex, layer)
    assert activation_bytes(storage) == 0
    after = read_state(storage)
    assert after.kept_bytes == 0 and after.removed_bytes == 8 * EXAMPLE and after.removed == {0: ((0, 8),)}
    assert (tmp_path / "s" / "shards" / "shard-00000.zarr" / "arrays" / "tokens_len").exists()  # per-sample kept


def _cfg(storage):
    from actstore import catalog

    return catalog.read_identity(storage)


def test_a_resumed_spooled_writer_continues_after_removals(tmp_path):
    url = str(tmp_path / "s")
    budget = 3 * BLOCK
    consumer = SimConsumer(url, "sae")
    thread = consumer.start()
    first, second = _batches(7, 10), _batches(8, 10)
    with pytest.raises(RuntimeError, match="stop"):
        with ShardWriter(url, spool=budget, commit_bytes=BLOCK, **KW) as w:
            for x in first:
                w.append(x)
            raise RuntimeError("stop")  # the writer leaves with its appends committed, shard incomplete
    with ShardWriter(url, spool=budget, commit_bytes=BLOCK, resume=True, **KW) as w:
        assert len(w) == 20
        for x in second:
            w.append(x)
    _drain(consumer, thread)
    assert consumer.error is None
    want = {(0, i): x for i, x in enumerate(np.concatenate(first + second))}
    assert sorted(consumer.got) == sorted(want)
    for k, x in want.items():
        np.testing.assert_array_equal(consumer.got[k], x)
    assert read_state(open_storage(url)).removed.get(0)  # blocks were removed before the resume completed


def test_block_owner_splits_blocks_between_consumer_ranks(tmp_path):
    url = str(tmp_path / "s")
    _write(url, 0, _batches(3, 8), 10 * BLOCK)  # 16 examples, 4 blocks
    r0, r1 = SimConsumer(url, "ddp", 0, 2), SimConsumer(url, "ddp", 1, 2)
    r0.register()
    r1.register()
    assert r0.look() == 2 and r1.look() == 2
    assert set(r0.got).isdisjoint(r1.got) and len(r0.got) + len(r1.got) == 16
    state = read_state(open_storage(url))
    assert len(state.consumable()) == 4 and state.lags() == {"ddp": 0}
    assert sp.consumed(state.blocks[0], state.consumers, ())


def test_shardwriter_defaults_to_one_file_per_example_with_a_spool(tmp_path):
    with ShardWriter(tmp_path / "s", spool="1MB", commit_bytes=2**16, layers=[0], d_model=4, tokens=2) as w:
        assert w.cfg.zarr_format == 3 and w.cfg.shard_examples is None


def test_the_capture_options_refuse_a_spool_of_zarr_shard_files():
    from actstore.capture.options import CaptureOptions
    from actstore.errors import CaptureError

    with pytest.raises(CaptureError, match="--spool removes the activation files .* --shard-examples"):
        CaptureOptions(spool="1GB", shard_examples=8).check("cli")
    with pytest.raises(CaptureError, match=r"--spool: a spool budget must be .*Got '1 GQ'"):
        CaptureOptions(spool="1 GQ").check("cli")
    o = CaptureOptions(spool="1GB")
    assert o.writer_options(None).spool == 10**9 and o.store_shard_examples() is None


@pytest.mark.slow
def test_a_killed_spooled_writer_resumes_and_the_consumer_gets_everything_once(tmp_path):
    import signal

    from writer_proc import LAYERS as WL
    from writer_proc import D as WD
    from writer_proc import T as WT
    from writer_proc import example_data, spawn

    url = str(tmp_path / "s")
    example = len(WL) * WT * WD * 2
    budget, commit = 6 * example, 3 * example
    consumer = SimConsumer(url, "sae")
    thread = consumer.start()
    p = spawn(url, "0", "0", "60", "--spool", str(budget), "--commit-bytes", str(commit))
    for line in p.stdout:  # killed once it has committed a few blocks and removal has begun
        if line.startswith("appended") and int(line.split()[-1]) >= 15:
            break
    p.send_signal(signal.SIGKILL)
    p.wait(WAIT)
    q = spawn(url, "0", "0", "60", "--spool", str(budget), "--commit-bytes", str(commit), "--resume")
    out, err = q.communicate(timeout=WAIT)
    assert q.returncode == 0 and out.splitlines()[-1] == "closed", err
    _drain(consumer, thread)
    assert consumer.error is None
    assert sorted(k for _, k in consumer.got) == list(range(60))
    for (_, k), rows in consumer.got.items():
        np.testing.assert_array_equal(rows, example_data(k))
    assert consumer.max_disk <= budget + commit + 3 * example  # (a block may end a batch past commit_bytes)


def test_a_stop_while_waiting_leaves_the_shard_resumable(tmp_path):
    url = str(tmp_path / "s")
    batches = _batches(4, 12)
    w = ShardWriter(url, spool=2 * BLOCK, commit_bytes=BLOCK, **KW)

    def interrupted():
        raise KeyboardInterrupt  # what Ctrl-C does to a waiting writer

    w.spool.keepalive = interrupted
    with pytest.raises(KeyboardInterrupt):
        with w:
            for x in batches:
                w.append(x)
    assert w.n_committed == 8  # two blocks committed (no consumer: nothing removed), then it waited
    with ShardWriter(url, spool=2 * BLOCK, commit_bytes=BLOCK, resume=True, **KW) as again:
        assert len(again) == 8
        consumer = SimConsumer(url, "sae")
        thread = consumer.start()
        for x in batches[4:]:
            again.append(x)
    _drain(consumer, thread)
    want = np.concatenate(batches)
    assert sorted(k for _, k in consumer.got) == list(range(24))
    for (_, k), rows in consumer.got.items():
        np.testing.assert_array_equal(rows, want[k])


def test_the_block_cache_reads_only_what_a_shard_added(tmp_path, monkeypatch):
    from actstore.spoolstate import BlockCache

    url = str(tmp_path / "s")
    storage = open_storage(url)
    x = _batches(9, 8)
    w = ShardWriter(url, spool=100 * BLOCK, commit_bytes=BLOCK, **KW)
    for b in x[:4]:
        w.append(b)  # two blocks
    cache = BlockCache()
    assert [(b.index, b.start, b.stop) for b in cache.blocks(storage)] == [(0, 0, 4), (1, 4, 8)]
    reads = []
    real = type(storage.child("x")).get_range
    monkeypatch.setattr(type(storage), "get_range", lambda s, k, start, n: reads.append(start) or real(s, k, start, n))
    for b in x[4:]:
        w.append(b)
    w.close()
    reads.clear()  # (the writer's own looks read them too)
    assert [(b.index, b.start, b.stop, b.nbytes) for b in cache.blocks(storage)][2:] == [
        (2, 8, 12, BLOCK),
        (3, 12, 16, BLOCK),
    ]
    assert len(reads) == 1 and reads[0] > 0  # the new records only, from where the cached ones end
    with ShardWriter(url, spool=100 * BLOCK, commit_bytes=BLOCK, overwrite=True, **KW) as w2:
        w2.append(x[0])
    assert [(b.index, b.start, b.stop) for b in cache.blocks(storage)] == [(0, 0, 2)]


def test_a_full_disk_while_removing_stops_the_writer_resumably(tmp_path, monkeypatch):
    import errno

    from actstore.errors import DiskFullError

    url = str(tmp_path / "s")
    batches = _batches(6, 8)
    w = ShardWriter(url, spool=2 * BLOCK, commit_bytes=BLOCK, **KW)
    consumer = SimConsumer(url, "sae")
    consumer.register()
    storage_type = type(w.storage)
    real_put = storage_type.put

    def put(self, key, *parts, **kw):
        if key.startswith("spool/removed/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, key, *parts, **kw)

    monkeypatch.setattr(storage_type, "put", put)
    with pytest.raises(DiskFullError, match="this batch of 2 examples was not added; the shard keeps its last commit"):
        with w:
            for i, x in enumerate(batches):
                if i == 4:
                    consumer.look()  # two blocks to remove: the removal record cannot be written
                w.append(x)
    monkeypatch.undo()
    assert w.n_committed == 8 and read_state(open_storage(url)).removed == {}  # nothing deleted without its record
    with ShardWriter(url, spool=2 * BLOCK, commit_bytes=BLOCK, resume=True, **KW) as again:
        assert len(again) == 8
