"""Readers and tools on a spool (issue 41): a removed example raises ExampleRemovedError (never
zeros); info, verify, finalize and `actstore spool status|drop|gc` say what was removed and
who still reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from spoolsim import SimConsumer

from actstore import ActStore, ShardWriter
from actstore.cli import main
from actstore.errors import ExampleRemovedError, SpoolError
from actstore.read.info import format_info, store_info
from actstore.spoolstate import read_state
from actstore.storage import open_storage
from actstore.verify import verify_store
from actstore.write import spool as wspool
from actstore.write.finalize import finalize

KW = dict(layers=[0, 1], d_model=8, tokens=4, zarr_format=2, stats=False, texts=["doc"])
EXAMPLE = 2 * 4 * 8 * 2
BLOCK = 4 * EXAMPLE


@pytest.fixture
def spool(tmp_path):
    """A spool of 16 examples in 4 blocks; consumer `sae` read the first 2 blocks, `slow` none."""
    url = str(tmp_path / "s")
    x = np.random.default_rng(0).standard_normal((16, 2, 4, 8)).astype(np.float16)
    sae, slow = SimConsumer(url, "sae"), SimConsumer(url, "slow")
    with ShardWriter(url, spool=100 * BLOCK, commit_bytes=BLOCK, **KW) as w:
        for i in range(0, 16, 2):
            w.append(x[i : i + 2], texts={"doc": [f"t{i}", f"t{i + 1}"]})
    sae.register()
    slow.register()
    sae.look()  # reads and acks all 4
    slow.acked = {0: ((0, 8),)}  # has read the first two blocks
    slow._put()
    return url, x


def test_finalize_removes_what_every_consumer_read_and_readers_refuse_it(spool):
    url, x = spool
    m = finalize(url)
    assert m.n_examples == 16  # every committed example is published (their fields and texts stay)
    # the manifest says it is a spool (readers look up removals only then), with the spool's budget
    assert m.spool_budget == 100 * BLOCK
    assert json.loads((Path(url) / "manifest.json").read_text())["spool_budget"] == 100 * BLOCK
    state = read_state(open_storage(url))
    assert state.removed == {0: ((0, 8),)} and state.lags() == {"sae": 0, "slow": 2}
    assert set(state.removers[0]) == {"finalize"}
    store = ActStore(url)
    for ex in (0, 7):
        with pytest.raises(
            ExampleRemovedError, match=rf"^example {ex} \(local example {ex} of shard 0\) .* removed from the spool"
        ):
            store[ex, 1]
    for ex in range(8, 16):
        np.testing.assert_array_equal(store[ex, 1], x[ex, 1])
    assert list(store.texts("doc"))[3] == "t3"  # per-sample data of removed examples stays
    assert store.field("sample_key").shape == (16,)


def test_a_removal_after_the_reader_opened_is_seen_at_the_read(spool):
    url, x = spool
    finalize(url)
    store = ActStore(url)
    np.testing.assert_array_equal(store[9, 0], x[9, 0])
    slow = SimConsumer(url, "slow")
    slow.acked = {0: ((0, 16),)}
    slow._put()
    assert wspool.gc(open_storage(url))[1:] == (2, 8 * EXAMPLE)
    with pytest.raises(ExampleRemovedError, match="example 9 "):
        store[9, 0]  # the cached removed set predates the removal: the read looks again


def test_info_shows_the_spool(spool):
    url, _ = spool
    finalize(url)
    info = store_info(url)
    s = info["spool"]
    assert (s["budget_bytes"], s["blocks"], s["kept_blocks"], s["removed_blocks"]) == (100 * BLOCK, 4, 2, 2)
    assert (s["kept_bytes"], s["removed_bytes"]) == (8 * EXAMPLE, 8 * EXAMPLE)
    by = {c["name"]: c for c in s["consumers"]}
    assert (by["sae"]["acked_blocks"], by["sae"]["lag_blocks"]) == (4, 0)
    assert (by["slow"]["acked_blocks"], by["slow"]["lag_blocks"]) == (2, 2)
    text = format_info(info)
    assert "2 blocks kept (1.02 kB), 2 removed (1.02 kB) of 4 committed" in text
    assert "consumer slow: 1 of 1 ranks, 2 blocks acked, lagging 2 blocks" in text


@pytest.mark.parametrize("deep", [False, True])
def test_verify_checks_what_is_kept_and_says_what_was_removed(spool, tmp_path, deep):
    url, _ = spool
    finalize(url)
    report = verify_store(url, deep=deep)
    assert report.ok, report.table()
    assert (report.n_removed_examples, report.n_removed_bytes) == (8, 8 * EXAMPLE)
    assert "8 examples (1024 bytes of activations) removed by the spool" in report.summary()
    (tmp_path / "s" / "shards" / "shard-00000.zarr" / "arrays" / "tokens_activations" / "9.1.0.0").unlink()
    report = verify_store(url, deep=deep)
    assert not report.ok and {p.kind for p in report.errors} == {"missing-chunk"}
    assert [p.local if p.example is None else p.example for p in report.errors] == [9]


def test_the_spool_commands(spool):
    url, _ = spool
    run = CliRunner().invoke
    res = run(main, ["finalize", url])
    assert res.exit_code == 0, res.output
    assert "consumers still reading: slow (2 blocks to go)" in res.output
    res = run(main, ["spool", "--json", "status", url])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["kept_blocks"] == 2
    res = run(main, ["spool", "drop", url, "nobody"])
    assert res.exit_code == 1 and "no consumer named 'nobody' is registered" in res.output
    res = run(main, ["spool", "drop", url, "slow"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == "dropped consumer slow; removed 2 blocks (1.02 kB)"
    assert json.loads((open_storage(url).get("spool/dropped/slow.json")))["name"] == "slow"
    state = read_state(open_storage(url))
    assert state.kept_bytes == 0 and state.lags() == {"sae": 0}
    res = run(main, ["spool", "gc", url])
    assert res.exit_code == 0 and res.output.splitlines()[0] == "removed 0 blocks (0 B)"
    res = run(main, ["spool", "status", str(url) + "-none"])
    assert res.exit_code != 0


def test_gc_of_a_store_that_is_no_spool_is_refused(tmp_path):
    url = str(tmp_path / "plain")
    with ShardWriter(url, layers=[0], d_model=4, tokens=2, zarr_format=2) as w:
        w.append(np.zeros((1, 1, 2, 4), np.float16))
    assert wspool.gc(open_storage(url)) is None
    with pytest.raises(SpoolError, match="is not a spool"):
        wspool.drop(open_storage(url), "x")
    res = CliRunner().invoke(main, ["spool", "gc", url])
    assert res.exit_code == 1 and "is not a spool (it was not written with --spool)" in res.output
