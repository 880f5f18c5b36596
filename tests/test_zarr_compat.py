"""Byte compatibility with zarr-python, both ways, for every storage layout."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr
from factory import random_acts
from zarr.codecs import ZstdCodec

import actstore
from actstore import ActStore, ShardWriter
from actstore.layout.chunks import geometry_from_metadata

LAYERS = [3, 7]


def _write(path, rng, n=7, **kw):
    data = random_acts(rng, (n, 2, 10, 12), kw.get("dtype", "float16"))
    with ShardWriter(path, shard=0, layers=LAYERS, d_model=12, tokens=10, commit_bytes=3000, **kw) as w:
        w.append(data[:3])
        w.append(data[3:])
    actstore.finalize(path)
    return data


@pytest.mark.parametrize(
    "kw,chunk_files",
    [
        ({"zarr_format": 2}, "flat"),
        ({"zarr_format": 2, "t_chunk": 4}, "flat"),
        ({"zarr_format": 3, "shard_examples": None}, "nested"),
        ({"zarr_format": 3, "shard_examples": 4}, "sharded"),
        ({"zarr_format": 2, "dtype": "float32"}, "flat"),
        ({"zarr_format": 2, "dtype": "bfloat16"}, "flat"),
        ({}, "sharded"),  # the default layout
    ],
)
def test_zarr_python_reads_what_actstore_wrote(tmp_path, rng, kw, chunk_files):
    path = tmp_path / "s"
    data = _write(path, rng, **kw)
    shard = path / "shards" / "shard-00000.zarr"
    g = zarr.open_group(str(shard), mode="r")
    arr = g["arrays/tokens_activations"]
    t_chunk = kw.get("t_chunk", 10)
    assert arr.shape == (7, 2, 10, 12)
    assert arr.chunks == (1, 1, t_chunk, 12)
    assert arr.compressors == ()
    assert arr.filters == ()
    assert arr.fill_value == 0
    got = arr[:]
    if kw.get("dtype") == "bfloat16":
        assert arr.attrs["actstore_dtype"] == "bfloat16"
        got = (got.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, data)
    # The consolidated metadata opens too.
    zc = zarr.open_consolidated(str(shard), mode="r", zarr_format=kw.get("zarr_format", 3))
    assert zc["arrays/tokens_activations"].shape == (7, 2, 10, 12)
    assert list(zc["arrays/tokens_len"][:]) == [10] * 7
    files = sorted(
        str(p.relative_to(shard / "arrays/tokens_activations"))
        for p in (shard / "arrays/tokens_activations").rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.name != "zarr.json"
    )
    if chunk_files == "flat":
        assert "0.0.0.0" in files and f"6.1.{(10 - 1) // t_chunk}.0" in files
        size = os.path.getsize(shard / "arrays/tokens_activations/0.0.0.0")
        assert size == t_chunk * 12 * np.dtype(kw.get("dtype", "float16").replace("bfloat16", "uint16")).itemsize
    elif chunk_files == "nested":
        assert "c/0/0/0/0" in files and "c/6/1/0/0" in files
    else:  # Zarr shard files: of 4 examples, or (the default) one of about 256 MiB
        assert files == (["c/0/0/0/0", "c/1/0/0/0"] if kw else ["c/0/0/0/0"])


def _zarr_written_store(tmp_path, rng, fmt: int, sharded: bool):
    """A store whose activation chunks were written by zarr-python itself."""
    path = tmp_path / "s"
    kw = {"zarr_format": fmt}
    if sharded:
        kw["shard_examples"] = 3
    data = random_acts(rng, (7, 2, 10, 12), "float16")
    with ShardWriter(path, shard=0, layers=LAYERS, d_model=12, tokens=10, engine="zarr", **kw) as w:
        w.append(data)
    actstore.finalize(path)
    arr = zarr.open_array(str(path / "shards/shard-00000.zarr/arrays/tokens_activations"), mode="r+")
    fresh = random_acts(rng, (7, 2, 10, 12), "float16")
    fresh[2, 1] = 0  # an all-zero chunk: zarr-python does not write it (missing = fill value)
    arr[:] = fresh
    # The writer's per-example checksums are of the values replaced: without them (as in a
    # shard of an older writer) an absent chunk reads as the fill value unchecked.
    (path / "shards/shard-00000.zarr/meta/example_layer_crc32c.u32").unlink()
    return path, fresh


@pytest.mark.parametrize("fmt,sharded", [(2, False), (3, False), (3, True)])
def test_actstore_reads_what_zarr_python_wrote(tmp_path, rng, fmt, sharded):
    path, fresh = _zarr_written_store(tmp_path, rng, fmt, sharded)
    store = ActStore(path)
    sh = store._shard(0)
    assert sh.io["tokens"] is not None  # the direct path, not the zarr fallback
    if not sharded:
        key = "2.1.0.0" if fmt == 2 else "c/2/1/0/0"
        assert not (path / "shards/shard-00000.zarr/arrays/tokens_activations" / key).exists()
    for ex in range(7):
        for lp, layer in enumerate(LAYERS):
            np.testing.assert_array_equal(store[ex, layer], fresh[ex, lp])


def test_compressed_store_falls_back_to_zarr_python(tmp_path, rng):
    path = tmp_path / "s"
    data = random_acts(rng, (5, 2, 10, 12), "float16")
    with ShardWriter(
        path,
        shard=0,
        layers=LAYERS,
        d_model=12,
        tokens=10,
        zarr_format=3,
        shard_examples=None,
        compressor=ZstdCodec(level=3),
    ) as w:
        w.append(data)
    actstore.finalize(path)
    meta = json.loads((path / "shards/shard-00000.zarr/arrays/tokens_activations/zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]
    store = ActStore(path)
    assert store._shard(0).io["tokens"] is None
    for ex in range(5):
        np.testing.assert_array_equal(store[ex, 7], data[ex, 1])


def test_layout_detection_refuses_non_raw_metadata(tmp_path):
    base = {
        "zarr_format": 2,
        "shape": [4, 2, 10, 12],
        "chunks": [1, 1, 10, 12],
        "dtype": "<f2",
        "compressor": None,
        "filters": None,
        "order": "C",
        "dimension_separator": ".",
    }
    assert geometry_from_metadata("a", base, 2, 12) is not None
    for change in (
        {"compressor": {"id": "zstd"}},
        {"filters": [{"id": "delta"}]},
        {"order": "F"},
        {"dtype": ">f2"},
        {"chunks": [2, 1, 10, 12]},
        {"chunks": [1, 2, 10, 12]},
    ):
        assert geometry_from_metadata("a", {**base, **change}, 2, 12) is None, change


def test_missing_chunk_reads_as_fill_value_only_where_zeros_were_written(tmp_path, rng):
    """An absent chunk is the fill value where the writer wrote zeros (zarr omits such
    chunks); where it wrote data, the chunk file was deleted: the writer's crc32c says so."""
    from actstore.errors import CorruptChunkError

    path = tmp_path / "s"
    data = random_acts(rng, (4, 2, 10, 12), "float16")
    data[2, 1] = 0
    with ShardWriter(path, zarr_format=2, shard=0, layers=LAYERS, d_model=12, tokens=10) as w:
        w.append(data)
    actstore.finalize(path)
    adir = path / "shards/shard-00000.zarr/arrays/tokens_activations"
    os.unlink(adir / "2.1.0.0")
    os.unlink(adir / "3.1.0.0")
    store = ActStore(path)
    assert not store[2, 7].any()
    assert store[2, 3].any()
    with pytest.raises(CorruptChunkError, match=r"is missing and reads as zeros, but the writer recorded crc32c"):
        store[3, 7]


@pytest.mark.parametrize(
    "kw", [{"zarr_format": 2}, {"zarr_format": 2, "t_chunk": 3}, {"zarr_format": 3, "shard_examples": None}]
)
def test_a_read_touches_only_the_asked_chunks(tmp_path, rng, kw):
    """Every other chunk file is replaced by a damaged one: reads that touched them would raise."""
    from actstore.errors import CorruptChunkError

    path = tmp_path / "s"
    data = _write(path, rng, **kw)
    adir = path / "shards/shard-00000.zarr/arrays/tokens_activations"
    store = ActStore(path)
    lay = store._shard(0).io["tokens"]
    keep = {lay.chunk_path(4, 1, tc) for tc in range(lay.n_tchunks)}
    damaged = 0
    for f in adir.rglob("*"):
        if f.is_file() and not f.name.startswith(".") and f.name != "zarr.json" and str(f) not in keep:
            f.write_bytes(b"x")
            damaged += 1
    assert damaged == 7 * 2 * lay.n_tchunks - lay.n_tchunks
    np.testing.assert_array_equal(store[4, 7], data[4, 1])
    with pytest.raises(CorruptChunkError, match="has 1 bytes, expected"):
        store[4, 3]
