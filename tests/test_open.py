"""actstore.open: the right reader for an actstore store or a saev directory, verify= for both;
ActStore(path) reads actstore stores only."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from factory import vit_store

import actstore
from actstore import ActStore
from actstore.errors import StoreNotFoundError, VerificationError
from actstore.saev import SaevOptionError, SaevStore, export_saev


@pytest.fixture
def pair(tmp_path):
    store = vit_store(tmp_path / "store", n=6, dtype="float16", zarr_format=2)  # a test names its chunk files
    res = export_saev(store, tmp_path / "dump", protocol="2.0", patches_per_shard=20, progress=False)
    return tmp_path / "store", res.path


def test_open_returns_the_reader_of_each_kind(pair):
    store_path, saev_dir = pair
    store, saev = actstore.open(store_path), actstore.open(saev_dir)
    assert type(store) is ActStore and type(saev) is SaevStore
    assert actstore.open(os.fspath(store_path), verify=False).path == store_path
    for ex in range(6):
        np.testing.assert_array_equal(saev[ex, 5], store[ex, 5].astype(np.float32))
    np.testing.assert_array_equal(saev[1:4, 2], np.stack([saev[ex, 2] for ex in (1, 2, 3)]))


def test_actstore_refuses_a_saev_directory_and_points_to_open(pair):
    _, saev_dir = pair
    want = (
        f"{saev_dir} is a saev shard directory, not an actstore store; open it with actstore.open('{saev_dir}'), "
        "which returns a SaevStore with the same reading API"
    )
    with pytest.raises(StoreNotFoundError, match=re.escape(want)):
        ActStore(saev_dir)
    with pytest.raises(StoreNotFoundError, match="actstore.open"):
        ActStore(saev_dir, verify="deep")
    with pytest.raises(SaevOptionError, match="a saev directory cannot be exported again"):
        export_saev(saev_dir, saev_dir.parent / "again", progress=False)


def test_verify_modes_on_an_actstore_store(pair):
    store_path, _ = pair
    assert len(actstore.open(store_path, verify="deep")) == 6
    chunk = store_path / "shards" / "shard-00000.zarr" / "arrays" / "tokens_activations" / "3.1.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 0xFF
    chunk.write_bytes(bytes(raw))  # same size: only the deep check sees it
    assert len(actstore.open(store_path, verify="fast")) == 6
    with pytest.raises(VerificationError, match=r"failed verification \(deep\)"):
        actstore.open(store_path, verify="deep")
    with pytest.raises(ValueError, match=r"verify must be one of \[None, 'fast', 'deep', 'reads'\]. Got 'full'."):
        actstore.open(store_path, verify="full")


def test_verify_modes_on_a_saev_directory(pair):
    _, saev_dir = pair
    assert len(actstore.open(saev_dir, verify="deep")) == 6
    acts = saev_dir / "acts000000.bin"
    os.chmod(acts, 0o644)
    with open(acts, "r+b") as f:  # a NaN in place of the first float32: sizes still right
        f.write(np.array([np.nan], "<f4").tobytes())
    assert len(actstore.open(saev_dir, verify="fast")) == 6
    with pytest.raises(
        VerificationError,
        match=r"failed verification \(deep\): 2 problems, the first: acts000000.bin: 1 non-finite "
        r"values .*Run `actstore verify-saev .* --values` for the full list",
    ) as e:
        actstore.open(saev_dir, verify="deep")
    # the SaevReport travels with the error: the NaN, and the changed bytes against the export's checksum sidecar
    assert len(e.value.report.problems) == 2 and "crc32c" in str(e.value.report.problems[1])
    (saev_dir / "notes.txt").write_text("x")
    with pytest.raises(
        VerificationError, match=r"failed verification \(fast\): 1 problem, the first: stray file 'notes.txt'"
    ):
        actstore.open(saev_dir, verify="fast")
    assert len(actstore.open(saev_dir)) == 6  # without verify only what opening checks


def test_open_of_nothing_says_so(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no store at"):
        actstore.open(tmp_path / "absent")
