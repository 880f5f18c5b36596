"""Per-sample arrays keep every chunk on disk, zeros included (spec.EVERY_CHUNK_ATTR), so a
deleted chunk is damage that readers and verify name, never labels, lengths or keys that
silently read as zeros; stores written before the attribute existed still read as before."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from factory import LAYOUTS

import actstore
from actstore import ActStore, ShardWriter, finalize
from actstore.cli import main
from actstore.errors import CorruptChunkError
from actstore.layout import spec
from actstore.verify import verify_store

SH0 = "shards/shard-00000.zarr"


def _store(root: Path, labels: list[int], **kw) -> np.ndarray:
    x = np.arange(len(labels) * 2 * 3 * 4, dtype=np.float16).reshape(len(labels), 2, 3, 4)
    with ShardWriter(root, shard=0, layers=[1, 4], d_model=4, tokens=3, fields={"label": "int64"}, **kw) as w:
        w.append(x, fields={"label": np.array(labels)})
    finalize(root)
    return x


def _chunk(root: Path, array: str, kw: dict) -> Path:
    return root / SH0 / "arrays" / array / ("c/0" if kw.get("zarr_format") == 3 else "0")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_chunk_of_zeros_is_written_and_read_by_zarr_python_alike(tmp_path, layout):
    kw = LAYOUTS[layout]
    _store(tmp_path / "s", [0] * 6, **kw)
    path = _chunk(tmp_path / "s", "label", kw)
    arr = zarr.open_array(store=str(path.parent.parent if kw.get("zarr_format") == 3 else path.parent), mode="r")
    assert path.is_file() and path.read_bytes() == bytes(arr.chunks[0] * 8)  # zarr would omit it: all fill value
    assert arr.attrs[spec.EVERY_CHUNK_ATTR] is True
    assert np.array_equal(arr[:], np.zeros(6, np.int64)) and np.array_equal(
        ActStore(tmp_path / "s").field("label"), arr[:]
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("array", ["label", "tokens_len"])
def test_a_deleted_per_sample_chunk_is_named_by_readers_and_verify(tmp_path, layout, array):
    kw = LAYOUTS[layout]
    root = tmp_path / "s"
    x = _store(root, [0, 3, 0, 1, 0, 0], **kw)
    path = _chunk(root, array, kw)
    os.unlink(path)
    why = (
        f"chunk file {path} of per-sample array {array} is missing: it holds the values of examples 0..5 of the shard, "
        "which its writer wrote in full (zeros included), so they are lost, not zeros. Restore the file from a copy of "
        "the store or write the shard again (run `actstore verify` for every damaged file)"
    )
    st = ActStore(root)
    with pytest.raises(CorruptChunkError) as e:
        st.field("label") if array == "label" else st[2, 4]
    assert str(e.value) == why
    rel = path.relative_to(root / SH0 / "arrays" / array).as_posix()
    rep = verify_store(root)
    assert [(p.kind, p.path, p.message) for p in rep.errors] == [
        (
            "missing-chunk",
            f"{SH0}/arrays/{array}/{rel}",
            f"chunk file {rel} of per-sample array {array} (examples 0..5) is missing: its writer writes every chunk, "
            "zeros included, so it was deleted (readers would return zeros)",
        )
    ]
    r = CliRunner().invoke(main, ["verify", str(root)])
    assert (
        r.exit_code == 1 and f"chunk file {rel} of per-sample array {array} (examples 0..5) is missing" in r.output
    ), r.output
    if array == "label":  # the activations do not need the labels
        assert np.array_equal(ActStore(root)[2, 4], x[2, 1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_array_without_the_attribute_reads_an_omitted_chunk_as_zeros(tmp_path, layout):
    """A store written before the attribute existed: zarr omitted chunks of zeros, legally."""
    kw = LAYOUTS[layout]
    root = tmp_path / "s"
    _store(root, [0] * 6, **kw)
    adir = root / SH0 / "arrays/label"
    meta = adir / ("zarr.json" if kw.get("zarr_format") == 3 else ".zattrs")
    doc = json.loads(meta.read_text())
    attrs = doc["attributes"] if kw.get("zarr_format") == 3 else doc
    del attrs[spec.EVERY_CHUNK_ATTR]
    meta.write_text(json.dumps(doc))
    zmeta = root / SH0 / ".zmetadata"
    if zmeta.exists():  # format 2 consolidated metadata holds the attributes too
        z = json.loads(zmeta.read_text())
        del z["metadata"]["arrays/label/.zattrs"][spec.EVERY_CHUNK_ATTR]
        zmeta.write_text(json.dumps(z))
    os.unlink(_chunk(root, "label", kw))
    assert np.array_equal(ActStore(root).field("label"), np.zeros(6, np.int64))
    assert verify_store(root).errors == []


def test_a_resumed_shard_keeps_writing_every_chunk(tmp_path):
    root = tmp_path / "s"
    w = ShardWriter(root, shard=0, layers=[1], d_model=4, tokens=3, fields={"label": "int64"}, zarr_format=2)
    w.append(np.ones((2, 1, 3, 4), np.float16), fields={"label": np.array([0, 0])})
    w.commit()
    w._close_files()  # as a writer that died after its commit
    with ShardWriter(
        root, shard=0, layers=[1], d_model=4, tokens=3, fields={"label": "int64"}, zarr_format=2, resume=True
    ) as w:
        w.append(np.ones((3, 1, 3, 4), np.float16), fields={"label": np.array([0, 0, 0])})
    finalize(root)
    assert (root / SH0 / "arrays/label/0").read_bytes() == bytes(spec.PER_SAMPLE_CHUNK_BYTES)  # 8192 int64 rows
    assert np.array_equal(actstore.ActStore(root).field("label"), np.zeros(5, np.int64))


def test_zarr_before_3_1_6_takes_the_global_default_and_gets_it_back(tmp_path):
    """zarr 3.1.3-3.1.5 have no Array.with_config: every_chunk opens the array under the
    global write_empty_chunks default instead (checked by hand on 3.1.3 and 3.1.5)."""
    from actstore.write import zarr_arrays as arrays

    group = zarr.open_group(str(tmp_path), mode="w", zarr_format=2)
    group.create_array("a", shape=(4,), chunks=(4,), dtype="<i8", fill_value=0, compressors=None)

    class Array:  # as zarr 3.1.5 hands it out: no with_config
        def __init__(self, array):
            self.array = array

        def __setitem__(self, key, value):
            self.array[key] = value

    class Group:
        def __getitem__(self, name):
            return Array(group[name])

    before = zarr.config.get("array.write_empty_chunks")
    arrays.every_chunk(Group(), "a")[:] = 0
    assert (tmp_path / "a/0").read_bytes() == bytes(32)  # a chunk of zeros, written
    assert zarr.config.get("array.write_empty_chunks") == before is False
    group["a"][:] = 0  # opened outside: zarr's default again, the chunk of zeros is removed
    assert not (tmp_path / "a/0").exists()
