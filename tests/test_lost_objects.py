"""Storage that loses objects a writer committed (an S3 server restarted with its bucket
kept, a folder cleaned by hand): the writer never completes a shard with a hole, nothing
committed is read back as zeros, and finalize refuses per-sample values that no longer match
their recorded crc32c (issue 35). Every case on a local folder and on S3 (moto), in Zarr
format 3 with Zarr shards and format 2 chunk files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import actstore
from actstore.errors import CorruptStoreError, NotFinalizedError
from actstore.storage import open_storage
from actstore.verify import verify_store

LAYOUTS = {"v3-sharded": {"zarr_format": 3, "shard_examples": 2}, "v2": {"zarr_format": 2}}
SHARD = "shards/shard-00000.zarr"
N_A, N_B = 5, 4  # examples of the first commit, then of the closing one


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.dev)])  # s3: moto
def url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_url")


def _batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.standard_normal((n, 2, 6, 4)).astype(np.float16),
        "lengths": {"tokens": rng.integers(1, 7, n)},
        "fields": {"label": rng.integers(-9, 9, n)},
        "sample_keys": [f"k{seed}-{i}" for i in range(n)],
    }


def _writer(url: str, layout: str, **kw) -> actstore.ShardWriter:
    return actstore.ShardWriter(
        url, layers=[0, 1], d_model=4, segments={"tokens": 6}, fields={"label": "int64"}, **LAYOUTS[layout], **kw
    )


def _shard(url: str):
    return open_storage(url).child(SHARD)


def _lose(url: str, pattern: str) -> list[str]:
    """Delete the shard's objects whose key matches `pattern`; returns their keys."""
    sh = _shard(url)
    gone = [e.key for e in sh.list("") if re.search(pattern, e.key)]
    assert gone, f"nothing of {SHARD} matches {pattern}"
    for k in gone:
        sh.delete(k)
    return gone


PER_SAMPLE_CHUNKS = r"^arrays/(tokens_len|label|sample_key)/(c/)?\d"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_sample_chunks_lost_after_a_commit_are_written_again_from_the_writer_memory(url, layout):
    a, b = _batch(N_A, 1), _batch(N_B, 2)
    with _writer(url, layout) as w:
        w.append(**a)
        w.commit()
        _lose(url, PER_SAMPLE_CHUNKS)  # examples 0..4's lengths, labels and keys: read back as zeros before
        w.append(**b)
    actstore.finalize(url)
    st = actstore.ActStore(url)
    lens = np.concatenate([a["lengths"]["tokens"], b["lengths"]["tokens"]])
    np.testing.assert_array_equal(st.field("tokens_len"), lens)
    np.testing.assert_array_equal(st.field("label"), np.concatenate([a["fields"]["label"], b["fields"]["label"]]))
    assert list(st.field("sample_key")) == a["sample_keys"] + b["sample_keys"]
    assert verify_store(url, deep=True).problems == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_shard_whose_objects_vanish_mid_write_never_completes(url, layout):
    with pytest.raises(CorruptStoreError, match=r"lost \d+ object\(s\) its writer committed"):
        with _writer(url, layout) as w:
            w.append(**_batch(N_A, 1))
            w.commit()
            _lose(url, r".")  # the server restarted and kept the bucket, not the shard
            w.append(**_batch(N_B, 2))
    with pytest.raises((NotFinalizedError, CorruptStoreError)):
        actstore.finalize(url)
    assert open_storage(url).size("manifest.json") is None  # nothing was published


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_lost_activation_object_of_an_earlier_commit_is_named(url, layout):
    first = r"^arrays/tokens_activations/(c/0/0/0/0|0\.0\.0\.0)$"  # example 0's: never written again
    with pytest.raises(
        CorruptStoreError, match=r"lost 1 object\(s\) its writer committed \(arrays/tokens_activations/"
    ):
        with _writer(url, layout) as w:
            w.append(**_batch(N_A, 1))
            w.commit()
            _lose(url, first)
            w.append(**_batch(N_B, 2))
    commit = json.loads(_shard(url).get("meta/commit.json"))
    assert commit["complete"] is False and commit["n_committed"] == N_A  # the first commit stands, incomplete


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_resumed_writer_refuses_a_lost_per_sample_chunk_it_would_take_for_zeros(url, layout):
    with pytest.raises(RuntimeError, match="killed"):
        with _writer(url, layout) as w:
            w.append(**_batch(N_A, 1))
            w.commit()
            raise RuntimeError("killed")  # leaves the shard committed, incomplete
    (gone,) = _lose(url, r"^arrays/tokens_len/(c/)?0$")
    with pytest.raises(CorruptStoreError, match=rf"{re.escape(gone)} is missing: it holds per-sample values"):
        with _writer(url, layout, resume=True) as w:
            w.append(**_batch(N_B, 2))
    assert json.loads(_shard(url).get("meta/commit.json"))["n_committed"] == N_A


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_finalize_refuses_per_sample_values_that_no_longer_match_their_checksum(url, layout):
    with _writer(url, layout) as w:
        w.append(**_batch(N_A, 1))
    actstore.finalize(url)
    old = open_storage(url).get("manifest.json")
    with _writer(url, layout, shard=1) as w:
        w.append(**_batch(N_B, 2))
    sh1 = open_storage(url).child("shards/shard-00001.zarr")
    key = next(e.key for e in sh1.list("") if re.search(r"^arrays/tokens_len/(c/)?0$", e.key))
    sh1.put(key, bytes(len(sh1.get(key))))  # a chunk of zeros where the lengths were: fast verify passes it
    assert verify_store(url).ok
    with pytest.raises(CorruptStoreError, match=r"shard 1 of .*per-sample array tokens_len no longer holds"):
        actstore.finalize(url)
    assert open_storage(url).get("manifest.json") == old  # the published store is unchanged
    assert len(actstore.ActStore(url)) == N_A
