"""Per-sample arrays carry checksums like the activations (each block record's
`per_sample_crc32c`), so deep verify finds a changed byte there too; and their chunks are
sized to the data (PER_SAMPLE_CHUNK_BYTES), so a small store is not mostly zero padding
(issue 26; issue 23 item 9)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from factory import LAYOUTS

from actstore import ActStore, ShardWriter, finalize
from actstore.layout import spec
from actstore.layout.checksum import crc32c, per_sample_crc32c
from actstore.verify import verify_store

SH0 = "shards/shard-00000.zarr"


def _store(root, layout: str, commits: int = 2):
    kw = LAYOUTS[layout]
    with ShardWriter(
        root,
        layers=[0, 2],
        d_model=4,
        tokens=3,
        segments=None,
        fields={"label": "int64", "w": "float32"},
        token_labels=True,
        token_ids=True,
        **kw,
    ) as w:
        for c in range(commits):
            b = 3
            w.append(
                np.ones((b, 2, 3, 4), np.float16),
                fields={"label": np.arange(b) + 10 * c, "w": np.full(b, 0.5, np.float32)},
                sample_keys=[f"k{c}-{i}" for i in range(b)],
                token_labels=np.full((b, 3), 1, np.uint8),
                token_ids=np.arange(b * 3).reshape(b, 3),
            )
            if c < commits - 1:
                w.commit()
    finalize(root)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_block_records_the_crc32c_of_each_per_sample_arrays_rows(tmp_path, layout):
    root = tmp_path / "s"
    _store(root, layout)
    blocks = [json.loads(x) for x in (root / SH0 / "meta/blocks.jsonl").read_text().splitlines()]
    names = {"tokens_len", "tokens_token_labels", "tokens_token_ids", "sample_key", "label", "w"}
    assert [(b["start"], b["stop"], set(b["per_sample_crc32c"])) for b in blocks] == [(0, 3, names), (3, 6, names)]
    st = ActStore(root)
    assert blocks[1]["per_sample_crc32c"]["label"] == crc32c(np.array([10, 11, 12], "<i8").tobytes())
    assert blocks[0]["per_sample_crc32c"]["tokens_len"] == crc32c(np.full(3, 3, "<i4").tobytes())
    assert blocks[1]["per_sample_crc32c"]["w"] == per_sample_crc32c(st.field("w")[3:], "float32")
    assert verify_store(root, deep=True).problems == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("array", ["label", "sample_key", "tokens_len", "tokens_token_labels", "tokens_token_ids"])
def test_deep_verify_finds_a_changed_per_sample_value(tmp_path, layout, array):
    root = tmp_path / "s"
    _store(root, layout)
    a = zarr.open_array(str(root / SH0 / "arrays" / array), mode="r+")
    row = a[4]
    a[4] = (
        (b"k1-9" if a.dtype.kind == "S" else np.where(np.asarray(row) == 0, 7, 0)) if array != "label" else 7
    )  # label 11 -> 7
    assert verify_store(root).ok  # fast verify reads no values
    rep = verify_store(root, deep=True)
    assert [(p.kind, p.path, p.message) for p in rep.errors] == [
        (
            "per-sample-checksum",
            f"{SH0}/arrays/{array}",
            f"per-sample array {array}: the values of examples 3..5 do not match the crc32c their writer recorded (a value was changed on disk)",
        )
    ]
    assert rep.errors[0].example == 3


def test_blocks_without_per_sample_checksums_still_verify(tmp_path):
    """Stores of older writers: block records without the field are read and verified as before."""
    root = tmp_path / "s"
    _store(root, "v2")
    path = root / SH0 / "meta/blocks.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in b.items() if k != "per_sample_crc32c"}) + "\n" for b in lines))
    assert verify_store(root, deep=True).problems == []
    assert list(ActStore(root).field("label")) == [0, 1, 2, 10, 11, 12]


def test_a_damaged_per_sample_checksum_table_is_refused(tmp_path):
    root = tmp_path / "s"
    _store(root, "v2")
    path = root / SH0 / "meta/blocks.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[0]["per_sample_crc32c"]["label"] = -1
    path.write_text("".join(json.dumps(b) + "\n" for b in lines))
    rep = verify_store(root)
    assert [p.kind for p in rep.errors] == ["blocks"] and "per_sample_crc32c" in rep.errors[0].message


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_sample_chunks_are_sized_to_the_data(tmp_path, layout):
    root = tmp_path / "s"
    _store(root, layout, commits=1)
    arrays = root / SH0 / "arrays"
    sizes = {}
    for name in ("tokens_len", "sample_key", "label", "tokens_token_labels"):
        meta = zarr.open_array(str(arrays / name), mode="r")
        sizes[name] = (
            meta.chunks[0],
            sum(
                f.stat().st_size
                for f in (arrays / name).rglob("*")
                if f.is_file() and not f.name.startswith((".z", "zarr"))
            ),
        )
    # about PER_SAMPLE_CHUNK_BYTES a chunk (it was 4 MiB: 28 MiB of store for 15.6 MiB of activations)
    assert sizes == {
        "tokens_len": (16384, 65536),
        "sample_key": (1024, 65536),
        "label": (8192, 65536),
        "tokens_token_labels": (21845, 65535),
    }
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total < 10 * spec.PER_SAMPLE_CHUNK_BYTES, total
    assert spec.PER_SAMPLE_CHUNK_BYTES == 64 * 2**10
