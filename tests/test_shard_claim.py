"""Claiming a writer shard (docs/format.md, section 5): a create-only put of its commit
record, then its arrays; of writers racing for one shard number exactly one wins, and a
shard whose writer was killed between the claim and its arrays is created again on resume."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from factory import LAYOUTS as FACTORY_LAYOUTS

from actstore import ActStore, ShardWriter, finalize
from actstore.errors import ShardBusyError, ShardExistsError
from actstore.verify import verify_store
from actstore.write import setup

LAYOUTS = {**FACTORY_LAYOUTS, "zarr-engine": {"engine": "zarr"}}  # + zarr-python's arrays of the default layout


def _writer(root, **kw) -> ShardWriter:
    return ShardWriter(
        root, shard=0, layers=[1, 3], d_model=8, tokens=5, fields={"label": "int64"}, texts=["caption"], **kw
    )


def _acts_bltd(b: int) -> np.ndarray:
    return np.arange(b * 2 * 5 * 8, dtype=np.float16).reshape(b, 2, 5, 8) / 64


@pytest.mark.parametrize("attempt", range(5))  # a race: several tries
def test_writers_racing_for_one_shard_number_exactly_one_wins(tmp_path, attempt):
    root = tmp_path / "s.store"
    results: list[str] = []
    barrier = threading.Barrier(4)

    def claim() -> None:
        barrier.wait()
        try:
            _writer(root)._close_files()
            results.append("won")
        except (ShardExistsError, ShardBusyError) as e:
            results.append(str(e))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            results.append(repr(e))

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and results.count("won") == 1
    for r in results:
        assert (
            r == "won"
            or r.endswith(
                "already exists (0 committed examples); pass resume=True to continue it or overwrite=True to replace it"
            )
            or r
            == (
                f"shard 0 of {root} was created by another writer at the same time; give each writer its own shard number"
            )
            or r.startswith(f"shard 0 of {root} is being written by another writer: pid {os.getpid()} on host ")
        )


@pytest.mark.parametrize("when", ["before the arrays", "after the arrays, before the files"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shard_killed_between_claim_and_arrays_is_created_again_on_resume(tmp_path, monkeypatch, layout, when):
    root = tmp_path / "s.store"
    real = setup.arrays.create_shard_arrays

    def killed(group, cfg, compressor):
        if when != "before the arrays":
            real(group, cfg, compressor)
        raise KeyboardInterrupt  # the writer dies here: its commit record is claimed

    monkeypatch.setattr(setup.arrays, "create_shard_arrays", killed)
    with pytest.raises(KeyboardInterrupt):
        _writer(root, **LAYOUTS[layout])
    monkeypatch.undo()

    with pytest.raises(ShardExistsError, match=r"already exists \(0 committed examples\); pass resume=True"):
        _writer(root, **LAYOUTS[layout])
    x = _acts_bltd(6)
    with _writer(root, resume=True, **LAYOUTS[layout]) as w:
        w.append(
            x,
            sample_keys=[f"k{i}" for i in range(6)],
            fields={"label": np.arange(6)},
            texts={"caption": [f"c{i}" for i in range(6)]},
        )
    finalize(root)
    store = ActStore(root)
    assert len(store) == 6 and all(np.array_equal(store[i, 3], x[i, 1]) for i in range(6))
    assert verify_store(root, deep=True).problems == []


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_claim_killed_mid_put_leaves_nothing_once_the_shard_is_claimed_again(tmp_path, layout):
    """A writer killed inside the claim's create-only put leaves only the temporary file of
    its commit record (the shard is not claimed); the next writer of the shard, holding its
    lease, claims it and removes that file, so verify finds nothing to warn about."""
    from actstore.layout import keys

    root = tmp_path / "s.store"
    meta = root / keys.shard_prefix(0) / keys.META_DIR
    meta.mkdir(parents=True)
    dead = meta / ".commit.json.tmp-999999-0badc0de"
    dead.write_bytes(b'{"format": "actstore-commit"')  # cut mid-write
    x = _acts_bltd(3)
    with _writer(root, **LAYOUTS[layout]) as w:
        w.append(x, sample_keys=["a", "b", "c"], fields={"label": np.arange(3)}, texts={"caption": ["x", "y", "z"]})
    finalize(root)
    assert not dead.exists()
    assert verify_store(root, deep=True).problems == []
    assert np.array_equal(ActStore(root)[2, 3], x[2, 1])
