"""Salvage at the kill point that broke it (issue 40): a writer SIGKILLed after claiming its
shard and before its first commit (with nothing appended, and with a batch appended but not
committed). `verify` reports the shard as resumable (a warning: exit 0, 1 with --strict),
`finalize --allow-partial` leaves it out, and every reader and exporter reads the result:
`store[ex, layer]`, field(), texts(), TokenStream, export-saelens, export-saev, the feature
pass; `write --resume` then finishes the shard. A manifest that an older finalize wrote with
the empty shard listed reads the same way everywhere."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import faultlib
import forked
import numpy as np
import pytest
from click.testing import CliRunner

from actstore import ActStore, finalize
from actstore.cli import main
from actstore.layout import keys, records
from actstore.storage import open_storage

pytestmark = pytest.mark.torch  # every reader and exporter: TokenStream, export-saelens and the feature pass need torch

# A writer of shard 1 that claims its shard, appends `n` examples (fewer than one commit
# holds) and stops before committing: its parent kills it there.
VICTIM = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
import faultlib
faultlib.COMMIT_BYTES = 10**9  # no commit before the kill
w = faultlib.writer(sys.argv[1], 1)
faultlib.append_range(w, 1, 0, int(sys.argv[2]))
assert w.n_committed == 0
print("claimed", flush=True)
time.sleep(600)
"""


def _killed_before_first_commit(store: Path, appended: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(faultlib.REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = forked.start("-c", str(store), str(appended), str(faultlib.HERE), code=VICTIM, env=env)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    rec = json.loads((store / "shards" / "shard-00001.zarr" / "meta" / "commit.json").read_text())
    assert (rec["n_committed"], rec["complete"]) == (0, False)  # claimed, nothing committed


def _n_tokens(counts: dict[int, int]) -> int:
    return sum(sum(faultlib.lengths(s, k).values()) for s, n in counts.items() for k in range(n))


def _every_reader(store: Path, tmp: Path, counts: dict[int, int]) -> None:
    """Each reader and exporter reads exactly the examples of `counts`."""
    from actstore.features.run import run_features
    from actstore.features.topk.tables import TOP, read_table
    from actstore.loaders import TokenStream
    from actstore.saelens import export_saelens
    from actstore.saev import export_saev, verify_saev

    n = faultlib.check_store_values(store, counts)  # store[g, layer], field(), texts()
    st = ActStore(store)
    rows = sum(len(b) for b in TokenStream(st, batch_size=64, layers=[7], shuffle=False, threads=1))
    assert rows == _n_tokens(counts)
    sl = export_saelens(st, tmp / "sl", layer=7, context_size=8, progress=False)
    assert sl.n_tokens == _n_tokens(counts)
    sv = export_saev(st, tmp / "saev", **faultlib.saev_kwargs())
    assert verify_saev(sv.path).problems == []
    meta = run_features(st, 7, str(tmp / "feat"), neurons=True, top_k=2)
    examples = read_table(tmp / "feat", TOP).column("example").to_pylist()
    assert meta["store"]["sha256"] == st.manifest_sha256 and set(examples) <= set(range(n))


@pytest.mark.parametrize("appended", [0, 4], ids=["claimed", "appended"])
def test_a_writer_killed_before_its_first_commit_is_salvaged(tmp_path, appended):
    store = tmp_path / "s"
    faultlib.write_shard(store, 0, 10)
    _killed_before_first_commit(store, appended)

    res = CliRunner().invoke(main, ["verify", str(store)])
    assert res.exit_code == 0, res.output
    assert "0 errors" in res.output and "resumable" in res.output
    assert (
        "was claimed but nothing is committed yet" in res.output
        and "finalize --allow-partial` leaves it out" in res.output
    )
    assert CliRunner().invoke(main, ["verify", str(store), "--strict"]).exit_code == 1

    res = CliRunner().invoke(main, ["finalize", str(store)])
    assert res.exit_code == 1 and "shard 1 (0 examples committed) not closed" in res.output
    res = CliRunner().invoke(main, ["finalize", str(store), "--allow-partial"])
    assert res.exit_code == 0 and "10 examples in 1 shards (PARTIAL)" in res.output, res.output
    m = ActStore(store).manifest
    assert [e.shard for e in m.shards] == [0] and m.partial.incomplete_shards == (1,)
    res = CliRunner().invoke(main, ["verify", str(store), "--deep"])
    assert res.exit_code == 0 and "0 errors" in res.output, res.output
    _every_reader(store, tmp_path / "partial", {0: 10})

    assert faultlib.write_shard(store, 1, 7) == 0  # resume: from nothing committed
    finalize(store)
    _every_reader(store, tmp_path / "whole", {0: 10, 1: 7})


def test_a_manifest_listing_an_empty_claimed_shard_reads_the_same_everywhere(tmp_path):
    store = tmp_path / "s"
    faultlib.write_shard(store, 0, 10)
    _killed_before_first_commit(store, 0)
    finalize(store, allow_partial=True)
    storage = open_storage(store)
    m = records.parse_manifest(storage.get(keys.MANIFEST), "manifest.json")
    empty = replace(m.shards[0], shard=1, name=keys.shard_name(1), start=10, n_examples=0, complete=False)
    empty = replace(empty, n_blocks=0, crc32c=records.blocks_checksum([]), nbytes=0)
    storage.put(keys.MANIFEST, records.dump_manifest(replace(m, shards=(*m.shards, empty))))  # as older finalizes did
    assert [s["name"] for s in json.loads((store / "manifest.json").read_text())["shards"]] == [
        "shard-00000.zarr",
        "shard-00001.zarr",
    ]
    assert [e.shard for e in ActStore(store).manifest.shards] == [0]  # skipped by every reader alike
    res = CliRunner().invoke(main, ["verify", str(store)])
    assert res.exit_code == 0 and "0 errors" in res.output, res.output
    _every_reader(store, tmp_path / "old", {0: 10})
    assert np.asarray(ActStore(store).field("label")).tolist() == list(range(10))
