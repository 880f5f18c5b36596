"""Special files where a store has a file or a folder: every read, verify and info gives the
original values or the project's error, never a hang (a FIFO), a traceback (a folder) or
a write through a link."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import faultlib as F
import numpy as np
import pytest
from hostile import everything, outcome, run_cli, same

import actstore
from actstore.errors import CorruptStoreError, StoreNotFoundError, UnsafePathError
from actstore.verify import verify_store

SH0 = "shards/shard-00000.zarr"


def _stats_file(store: Path) -> str:
    return json.loads((store / "manifest.json").read_text())["stats"]


# Every kind of file a reader, verify or info opens: chunk files of activations and of
# per-sample arrays, texts, records, statistics, array and group metadata.
FILES = [
    f"{SH0}/arrays/prompt_activations/0.0.0.0",
    f"{SH0}/arrays/label/0",
    f"{SH0}/arrays/prompt_len/0",
    f"{SH0}/arrays/sample_key/0",
    f"{SH0}/text/prompt.jsonl",
    "manifest.json",
    "actstore.json",
    "STATS",
    f"{SH0}/meta/commit.json",
    f"{SH0}/meta/blocks.jsonl",
    f"{SH0}/meta/example_layer_crc32c.u32",
    f"{SH0}/meta/STATS",
    f"{SH0}/arrays/prompt_activations/.zarray",
    f"{SH0}/arrays/label/.zarray",
    f"{SH0}/arrays/label/.zattrs",
    f"{SH0}/.zmetadata",
    f"{SH0}/.zattrs",
]


def _resolve(store: Path, rel: str) -> Path:
    if rel == "STATS":
        return store / _stats_file(store)
    if rel.endswith("meta/STATS"):
        commit = json.loads((store / SH0 / "meta/commit.json").read_text())
        return store / SH0 / commit["stats_file"]
    return store / rel


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
        (path / "x").write_bytes(b"")
    else:  # an empty folder
        path.mkdir()


def _check_all(store: Path, original: dict) -> tuple[str, list]:
    """Read everything, verify both ways and run info; returns the read's outcome and the
    deep report's errors (each call must give the values or the project's error in time)."""
    kind, got = outcome(everything, store, what="read")
    if kind == "ok":
        assert same(got, original), "a read returned different values without an error"
    errors = []
    for deep in (False, True):
        k, rep = outcome(verify_store, store, deep=deep, what=f"verify deep={deep}")
        if k == "ok":
            errors = rep.errors
    run_cli("info", str(store))
    run_cli("verify", str(store))
    return kind, errors


@pytest.mark.parametrize("kind", ["fifo", "dir", "emptydir"])
@pytest.mark.parametrize("rel", FILES)
def test_special_file_where_a_file_belongs(fault_store, fault_original, rel, kind):
    built = fault_original
    path = _resolve(fault_store, rel)
    _replace(path, kind)
    read, errors = _check_all(fault_store, built[1])
    assert errors, f"verify found nothing wrong with {kind} at {rel}"
    if rel not in (
        "actstore.json",
        f"{SH0}/meta/STATS",
        f"{SH0}/meta/blocks.jsonl",
        f"{SH0}/meta/example_layer_crc32c.u32",
        f"{SH0}/.zattrs",
        f"{SH0}/arrays/prompt_activations/.zarray",
        f"{SH0}/.zmetadata",
    ):
        assert read == "error"  # readers need these files (the others: readers never open them)


def test_fifo_chunk_read_names_the_file(fault_store):
    store = fault_store
    chunk = store / SH0 / "arrays/prompt_activations/0.1.0.0"
    _replace(chunk, "fifo")
    kind, e = outcome(lambda: actstore.ActStore(fault_store)[0, 7])
    assert kind == "error" and isinstance(e, CorruptStoreError)
    assert (
        str(e) == f"{chunk} is a FIFO (named pipe) where a file belongs; the store is damaged (run `actstore verify`)"
    )


def test_folder_at_a_chunk_key_is_named_by_verify(fault_store):
    store = fault_store
    chunk = store / SH0 / "arrays/prompt_activations/2.1.0.0"
    _replace(chunk, "dir")
    rep = verify_store(fault_store)
    msgs = [(p.kind, p.message) for p in rep.errors]
    assert msgs == [
        (
            "not-a-file",
            f"{SH0}/arrays/prompt_activations/2.1.0.0 is a folder where the array has a chunk file (readers refuse it)",
        )
    ]
    assert rep.damaged() == [(2, 7, f"{SH0}/arrays/prompt_activations/2.1.0.0")]
    kind, e = outcome(lambda: actstore.ActStore(fault_store)[2, 7])
    assert (
        kind == "error"
        and str(e) == f"{chunk} is a folder where a file belongs; the store is damaged (run `actstore verify`)"
    )


def test_folder_at_a_per_sample_chunk_is_not_read_as_zeros(fault_store):
    """zarr reads a folder at a chunk key as a missing chunk (the fill value): labels 0..5
    would silently read as zeros."""
    store = fault_store
    _replace(store / SH0 / "arrays/label/0", "dir")
    kind, e = outcome(lambda: actstore.ActStore(fault_store).field("label"))
    assert kind == "error"
    assert str(e).startswith(f"{store / SH0 / 'arrays/label/0'} is a folder where a file belongs")
    rep = verify_store(fault_store)
    assert [(p.kind, p.path) for p in rep.errors] == [("not-a-file", f"{SH0}/arrays/label/0")]


def test_store_path_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for fn in (actstore.ActStore, actstore.open, verify_store):
        kind, e = outcome(fn, f)
        assert kind == "error" and isinstance(e, StoreNotFoundError)
        assert str(e) == f"{f} is a file, not an actstore store (a store is a folder holding manifest.json)"
    code, out = run_cli("info", str(f))
    assert code == 2 and f"Directory '{f}' is a file." in out  # click's check of the argument


def test_a_file_where_the_store_has_a_folder(fault_store):
    store = fault_store
    shutil.rmtree(store / SH0 / "text")
    (store / SH0 / "text").write_text("x")
    kind, e = outcome(lambda: actstore.ActStore(fault_store).sample(0))
    assert kind == "error"
    assert str(e) == (
        f"{store / SH0 / 'text'} is a file where a folder belongs (it holds {store / SH0 / 'text/prompt.jsonl'}); "
        "the store is damaged (run `actstore verify`)"
    )


def test_writes_never_follow_a_link_inside_the_store(fault_store, tmp_path):
    """A writer resuming a shard whose meta/ folder was replaced by a link would write its
    commit record, block records and checksums wherever the link leads."""
    store = fault_store
    F.write_shard(fault_store, 1, 2)
    sh1 = store / "shards/shard-00001.zarr"
    commit = json.loads((sh1 / "meta/commit.json").read_text())
    commit["complete"] = False
    (sh1 / "meta/commit.json").write_text(json.dumps(commit))
    outside = tmp_path / "outside"
    shutil.move(sh1 / "meta", outside)
    (sh1 / "meta").symlink_to(outside)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    with pytest.raises(UnsafePathError) as ei:
        w = F.writer(fault_store, 1, resume=True)
        F.append_range(w, 1, 2, 4)
        w.close()
    assert str(ei.value) == (
        f"{sh1 / 'meta'} is a symbolic link inside the store {store}; actstore never writes through links "
        "(it could write outside the store): replace it with a real folder"
    )
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


def test_chunk_written_in_place_never_follows_a_link(tmp_path):
    from actstore.storage import LocalStorage

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    s = LocalStorage(tmp_path / "s")
    s.put("a/b", b"x")
    (tmp_path / "s/a/c").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="c is a symbolic link; actstore never writes through links"):
        s.put("a/c", b"overwritten", atomic=False)
    with pytest.raises(UnsafePathError):
        s.append("a/c", b"more")
    assert victim.read_bytes() == b"precious"
    assert np.frombuffer(s.get("a/b"), np.uint8).tolist() == [ord("x")]


@pytest.mark.parametrize("name", ["d.jsonl", "d.txt", "d.parquet", "glob"])
def test_capture_data_that_is_a_fifo_is_refused(tmp_path, name):
    """`actstore write --data` on a FIFO blocked before the model even loaded."""
    from actstore.errors import DataError
    from actstore.inputs.data import load_source

    target = tmp_path / ("g/a.txt" if name == "glob" else name)
    target.parent.mkdir(exist_ok=True)
    os.mkfifo(target)
    spec = str(tmp_path / "g/*.txt") if name == "glob" else str(target)
    kind, e = outcome(load_source, spec)
    assert kind == "error" and isinstance(e, DataError)
    assert str(e) == f"--data {spec}: {target} is a FIFO (named pipe), not a file or folder of data"


def test_capture_jsonl_nested_too_deeply_is_a_data_error(tmp_path):
    from actstore.inputs.data import load_source

    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    kind, e = outcome(load_source, str(p))
    assert kind == "error" and str(e).startswith(f"{p}:2: not valid JSON (maximum recursion depth exceeded")
