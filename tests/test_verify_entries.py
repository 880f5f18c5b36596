"""verify: odd directory entries (FIFOs, folders where files belong, stray files inside
per-sample arrays), every array metadata field that decides which values are read (also
for compressed arrays), and the layout helpers verification reads the format through."""

from __future__ import annotations

import json
import os
from pathlib import Path

import faultlib as F
import numpy as np
import pytest

import actstore
from actstore.layout import chunks, keys, records, texts
from actstore.layout.records import Block
from actstore.verify import ERROR, WARNING, verify_store

SH0 = "shards/shard-00000.zarr"
PROMPT = "arrays/prompt_activations"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("entries") / "store"
    F.write_shard(root, 0, 6)
    actstore.finalize(root)
    return root


@pytest.fixture
def store(built, tmp_path) -> Path:
    return F.copy_store(built, tmp_path / "store")


def kinds(report) -> list[tuple[str, str]]:
    return [(p.severity, p.kind) for p in report.problems]


def test_fifo_chunk_and_fifo_at_the_root_are_errors_and_never_read(store):
    chunk = store / SH0 / PROMPT / "2.1.0.0"
    chunk.unlink()
    os.mkfifo(chunk)
    os.mkfifo(store / "pipe")
    for deep in (False, True):  # deep mode must not open (and block on) the FIFO
        rep = verify_store(store, deep=deep)
        assert kinds(rep) == [(ERROR, "not-a-file"), (ERROR, "not-a-file")]
        assert rep.problems[0].message == (
            "pipe is a FIFO, socket or device; a store holds only regular files and folders (readers refuse it)"
        )
        assert rep.damaged() == [(2, 7, f"{SH0}/{PROMPT}/2.1.0.0")]  # layers [2, 7]: position 1


def test_folder_where_a_file_belongs(store):
    text = store / SH0 / "text/prompt.jsonl"
    text.unlink()
    text.mkdir()
    (text / "x").write_text("")
    rep = verify_store(store, deep=True)
    assert kinds(rep) == [(ERROR, "not-a-file")]
    assert rep.problems[0].message == (
        f"{SH0}/text/prompt.jsonl is a folder where the store has the file prompt.jsonl (readers refuse it)"
    )


def test_stray_file_and_link_inside_a_per_sample_array(store, tmp_path):
    arr = store / SH0 / "arrays/label"
    (arr / "notes.txt").write_text("x")
    (arr / ".0.tmp-1-0badf00d").write_bytes(b"")  # an interrupted write: not reported
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"")
    (arr / "1").symlink_to(outside)
    rep = verify_store(store)
    assert sorted(kinds(rep)) == [(ERROR, "symlink"), (WARNING, "stray-file")]
    stray = next(p for p in rep.problems if p.kind == "stray-file")
    assert stray.message == "notes.txt in array label is not a chunk of this array"


def _edit_meta(store: Path, fn) -> None:
    (store / SH0 / ".zmetadata").unlink(missing_ok=True)  # readers would use the consolidated copy
    path = store / SH0 / PROMPT / ".zarray"
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: m.__setitem__("chunks", [1, 1, 4, 8]),
            "chunks of shape [1, 1, 4, 8] of float16; the store config says 4 tokens of <f2",
        ),
        (
            lambda m: m.__setitem__("dtype", "<f4"),
            "dtype <f4; the store config says <f2 (the byte order and width decide every value read)",
        ),
        (lambda m: m.__setitem__("fill_value", 1.5), "fill value 1.5; the format's is 0 (missing chunks read as it)"),
        (lambda m: m.__setitem__("zarr_format", 3), None),
    ],
)
def test_array_metadata_fields_that_decide_the_values(store, edit, message):
    _edit_meta(store, edit)
    rep = verify_store(store)
    assert [p.kind for p in rep.errors][:1] == ["array-meta"]
    if message is not None:
        assert rep.errors[0].message == message


def test_compressed_array_metadata_is_checked_too(tmp_path):
    import numcodecs

    root = tmp_path / "zstd"
    with actstore.ShardWriter(
        root, zarr_format=2, shard=0, layers=[0], d_model=8, tokens=6, compressor=numcodecs.Zstd()
    ) as w:
        w.append(np.ones((3, 1, 6, 8), np.float16))
    actstore.finalize(root)
    assert verify_store(root, deep=True).problems == []
    (root / SH0 / ".zmetadata").unlink(missing_ok=True)
    path = root / SH0 / "arrays/tokens_activations/.zarray"
    meta = json.loads(path.read_text())
    meta["chunks"] = [1, 1, 3, 8]
    path.write_text(json.dumps(meta))
    rep = verify_store(root)
    assert kinds(rep) == [(ERROR, "array-meta")]
    assert rep.problems[0].message == "chunks of 3 tokens of float16; the store config says 6 tokens of <f2"


def test_layout_helpers():
    assert chunks.parse_chunk_key("3.1.0.0", 2, ".") == (3, 1, 0, 0)
    assert chunks.parse_chunk_key("c/3/1/0/0", 3, "/") == (3, 1, 0, 0)
    assert chunks.parse_chunk_key("7", 2, ".", ndim=1) == (7,)
    assert chunks.parse_chunk_key("3/1.0.0", 2, ".") is None
    with pytest.raises(ValueError, match=r"shape must be a list of non-negative ints. Got \[2, True\]."):
        chunks.array_shape({"shape": [2, True]})
    assert keys.is_interrupted_write(".commit.json.tmp-1-0badf00d") and not keys.is_interrupted_write(".zarray")
    assert keys.is_store_stats_file(keys.store_stats_file(0xBADF00D))
    assert keys.is_shard_stats_file(keys.basename(keys.shard_stats_file(8)))
    blocks = [Block(start=0, stop=2, crc32c={"s": 1}, nbytes=4), Block(start=3, stop=4, crc32c={"s": 1}, nbytes=2)]
    assert records.block_problems(blocks, 4) == [("block record 1 starts at example 3, expected 2", True)]
    assert records.block_problems(blocks[:1], 4) == [("the block records cover 2 examples, not 4", True)]


def test_text_lines_are_written_as_the_layout_parses_them(store):
    line = (store / SH0 / "text/prompt.jsonl").read_bytes().splitlines(keepends=True)[1]
    assert line == texts.dump_line(1, "0-1", "prompt", "text 0-1")
    assert texts.parse_line(line, "where", "prompt") == (1, "text 0-1")
    with pytest.raises(actstore.errors.CorruptStoreError, match="a line is not of the form"):
        texts.parse_line(b'{"i": 1}\n', "where", "prompt")
