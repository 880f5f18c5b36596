"""Hostile metadata: paths leaving the store, absurd counts, unknown versions; exact messages."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import faultlib as F
import numpy as np
import pytest
from click.testing import CliRunner

from actstore import ActStore
from actstore.cli import main
from actstore.errors import CorruptStoreError, FormatVersionError, UnsafePathError
from actstore.layout import spec
from actstore.layout.records import MAX_EXAMPLES
from actstore.verify import ERROR, verify_store
from actstore.write.finalize import finalize, load_manifest

SH0 = "shards/shard-00000.zarr"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "store"
    F.write_shard(root, 0, 6)
    finalize(root)
    return root


@pytest.fixture
def store(built, tmp_path) -> Path:
    return F.copy_store(built, tmp_path / "store")


def edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def manifest(store: Path) -> Path:
    return store / spec.MANIFEST_FILE


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("name", "../../etc", CorruptStoreError, "shard name '../../etc' is not of the form shard-NNNNN.zarr"),
        (
            "name",
            "/etc/shard-00000.zarr",
            CorruptStoreError,
            "shard name '/etc/shard-00000.zarr' is not of the form shard-NNNNN.zarr",
        ),
    ],
)
def test_manifest_shard_names_outside_the_store(store, field, value, error, message):
    edit_json(manifest(store), lambda d: d["shards"][0].__setitem__(field, value))
    with pytest.raises(error) as ei:
        ActStore(store)
    assert str(ei.value) == f"{manifest(store)}: {message}"


@pytest.mark.parametrize("stats", ["../outside.npz", "/etc/passwd"])
def test_manifest_stats_path_outside_the_store(store, stats):
    edit_json(manifest(store), lambda d: d.__setitem__("stats", stats))
    with pytest.raises(UnsafePathError) as ei:
        ActStore(store)
    assert str(ei.value) == (
        f"path {stats!r} in the store's metadata points outside the store {str(store)!r}; refusing to follow it"
    )
    rep = verify_store(store)
    assert [(p.severity, p.kind) for p in rep.problems][0] == (ERROR, "manifest")


def test_symlinked_shard_leaving_the_store(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (store / SH0).rename(elsewhere)
    (store / SH0).symlink_to(elsewhere)
    with pytest.raises(UnsafePathError) as ei:
        ActStore(store)
    assert str(ei.value) == (
        f"path 'shards/shard-00000.zarr' resolves to {str(elsewhere)!r}, outside the store {str(store.resolve())!r} "
        "(a symlink leaving the store?); refusing to follow it"
    )


def test_symlinked_text_file_leaving_the_store(store, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"i": 0, "prompt": "stolen"}\n' * 6)
    text = store / SH0 / "text/prompt.jsonl"
    text.unlink()
    text.symlink_to(secret)
    st = ActStore(store)
    with pytest.raises(
        UnsafePathError, match=r"text/prompt.jsonl is a symbolic link; actstore never writes links inside a store"
    ):
        st.sample(0)
    with pytest.raises(UnsafePathError):
        list(st.texts("prompt"))
    rep = verify_store(store)
    assert [(p.kind, p.path) for p in rep.errors] == [("symlink", f"{SH0}/text/prompt.jsonl")]


def test_resume_refuses_commit_record_paths_outside_the_shard(store, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    sdir = store / "shards/shard-00001.zarr"
    F.write_shard(store, 1, 2)
    edit_json(sdir / spec.COMMIT_FILE, lambda d: d.update(complete=False, text_bytes={"../../../victim": 0}))
    with pytest.raises(CorruptStoreError) as ei:
        F.writer(store, 1, resume=True)
    assert (
        str(ei.value) == f"{sdir / spec.COMMIT_FILE} names text '../../../victim'; the store declares texts ['prompt']"
    )
    edit_json(sdir / spec.COMMIT_FILE, lambda d: d.update(text_bytes={"prompt": 0}, stats_file="../../../victim.txt"))
    with pytest.raises(
        UnsafePathError, match=r"path '\.\./\.\./\.\./victim\.txt' in the store's metadata points outside"
    ):
        F.writer(store, 1, resume=True)
    assert victim.read_text() == "precious"


def test_manifest_claiming_1e15_examples_allocates_nothing(store):
    edit_json(
        manifest(store),
        lambda d: (d.__setitem__("n_examples", 10**15), d["shards"][0].__setitem__("n_examples", 10**15)),
    )
    tracemalloc.start()
    with pytest.raises(CorruptStoreError) as ei:
        ActStore(store)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(ei.value) == f"{manifest(store)}: n_examples must be an int in 0..{MAX_EXAMPLES}, got 1000000000000000"
    assert peak < 2**20


def test_consistent_lie_of_1e12_examples_is_caught_before_allocating(store):
    n = 10**12
    cfg_bytes = load_manifest(store).config.example_bytes()

    def lie(d):
        d["n_examples"] = n
        d["shards"][0].update(n_examples=n, nbytes=n * cfg_bytes)

    edit_json(manifest(store), lie)
    for name in ("prompt_activations", "response_activations", "sample_key", "label", "prompt_len", "response_len"):
        edit_json(store / SH0 / "arrays" / name / ".zarray", lambda d: d["shape"].__setitem__(0, n))
    (store / SH0 / ".zmetadata").unlink()
    tracemalloc.start()
    st = ActStore(store)  # the manifest alone is consistent
    assert len(st) == n
    with pytest.raises(CorruptStoreError) as ei:
        st[5, 2]
    rep = verify_store(store, deep=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(ei.value) == (
        f"shard {store / SH0} has committed 6 examples but the manifest says {n}; "
        "the manifest does not belong to these shards (run `actstore verify`)"
    )
    assert peak < 16 * 2**20
    assert [p.kind for p in rep.errors][:3] == ["commit", "commit", "blocks"]
    assert f"the shard publishes {n} examples ({n * 2 * 3} chunk files) but only 36 chunk files exist" in [
        p.message for p in rep.errors
    ]


def test_manifest_bytes_must_match_examples(store):
    edit_json(manifest(store), lambda d: d["shards"][0].__setitem__("nbytes", 5))
    with pytest.raises(CorruptStoreError) as ei:
        ActStore(store)
    per = load_manifest  # noqa: F841 - the config is unreadable through the damaged manifest
    assert str(ei.value).endswith("claims 6 examples in 2 blocks and 5 bytes; 6 examples of this store take 6528 bytes")


def test_newer_and_unknown_format_versions(store):
    edit_json(manifest(store), lambda d: d.__setitem__("format_version", 2))
    msg = (
        f"{manifest(store)} uses actstore format version 2, newer than this actstore reads (version 1); "
        "upgrade actstore (pip install -U actstore)"
    )
    with pytest.raises(FormatVersionError) as ei:
        ActStore(store)
    assert str(ei.value) == msg
    with pytest.raises(FormatVersionError):
        verify_store(store)
    r = CliRunner().invoke(main, ["verify", str(store)])
    assert (r.exit_code, r.output) == (1, f"actstore: error: {msg}\n")
    edit_json(manifest(store), lambda d: d.__setitem__("format_version", "1.0"))
    with pytest.raises(FormatVersionError) as ei:
        ActStore(store)
    assert str(ei.value) == f"{manifest(store)} has unknown format_version '1.0'; this actstore reads version 1"


def test_damaged_array_metadata(store):
    (store / SH0 / ".zmetadata").unlink()
    edit_json(store / SH0 / "arrays/prompt_activations/.zarray", lambda d: d.__setitem__("chunks", [1, 1, 6, 16]))
    with pytest.raises(CorruptStoreError) as ei:
        ActStore(store)[0, 2]
    assert str(ei.value) == (
        f"array {store / SH0 / 'arrays/prompt_activations'} has chunks of 6 tokens of float16; the store config says 4 tokens of <f2; "
        "its metadata was altered (run `actstore verify`)"
    )
    (store / SH0 / "arrays/prompt_activations/.zarray").write_text("{not json")
    with pytest.raises(
        CorruptStoreError, match=r"array metadata of .*prompt_activations is damaged \(Expecting property name"
    ):
        ActStore(store)[0, 2]


def test_damaged_block_records_and_commit_types(store):
    F.write_shard(store, 1, 2)
    blocks = store / "shards/shard-00001.zarr" / spec.BLOCKS_FILE
    blocks.write_text('{"start": 0, "stop": "2", "crc32c": {}, "nbytes": 1}\n')
    with pytest.raises(CorruptStoreError) as ei:
        finalize(store)
    assert str(ei.value) == (
        f'{blocks}: block record 0 must be {{"start": int, "stop": int > start, "crc32c": {{segment: uint32}}, "nbytes": int[, "per_sample_crc32c": {{array: uint32}}]}}, '
        "got {'start': 0, 'stop': '2', 'crc32c': {}, 'nbytes': 1}"
    )
    commit = store / "shards/shard-00001.zarr" / spec.COMMIT_FILE
    edit_json(commit, lambda d: d.__setitem__("nonfinite", ["x"]))
    with pytest.raises(CorruptStoreError) as ei:
        finalize(store)
    assert str(ei.value) == f"{commit}: nonfinite must map names to non-negative ints, got ['x']"


def test_identity_file_with_bad_config(store):
    edit_json(store / spec.IDENTITY_FILE, lambda d: d["config"].__setitem__("fields", [1, 2]))
    with pytest.raises(
        CorruptStoreError, match=r"actstore.json: bad config \(.*\); the store's identity file is damaged$"
    ):
        finalize(store)
    assert np.array_equal(ActStore(store)[0, 2], F.expected(0, 0, 2))  # readers use the manifest only
