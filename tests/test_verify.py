"""`actstore verify` and ActStore(path, verify=...): a corruption factory with exact messages."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import faultlib as F
import numpy as np
import pytest
from click.testing import CliRunner

import actstore
from actstore import ActStore
from actstore.chunkio import crc32c
from actstore.cli import main
from actstore.errors import CorruptChunkError, StoreNotFoundError, UnsafePathError, VerificationError
from actstore.layout import spec
from actstore.layout.spec import EL_CRC_FILE
from actstore.verify import ERROR, WARNING, verify_store

SH0 = "shards/shard-00000.zarr"
SH1 = "shards/shard-00001.zarr"
PROMPT = "arrays/prompt_activations"
N0, N1 = 10, 6


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify") / "store"
    F.write_shard(root, 0, N0)
    F.write_shard(root, 1, N1)
    actstore.finalize(root)
    return root


@pytest.fixture
def store(built, tmp_path) -> Path:
    return F.copy_store(built, tmp_path / "store")


def kinds(report) -> list[tuple[str, str]]:
    return [(p.severity, p.kind) for p in report.problems]


def test_clean_store_verifies_in_both_modes(store):
    fast = verify_store(store)
    assert fast.problems == [] and fast.ok
    assert (fast.n_shards, fast.n_examples, fast.n_chunk_files, fast.n_bytes_read) == (2, 16, 128, 0)
    deep = verify_store(store, deep=True)
    assert deep.problems == []
    # every published chunk read: 16 examples x 2 layers x (3 x 4 + 5 tokens) x 16 x 2 bytes
    assert deep.n_bytes_read == 16 * 2 * 17 * 16 * 2
    assert (
        deep.summary()
        == f"verify (deep) {store}: 16 examples in 2 shards, 128 chunk files checked, 17408 bytes read: OK"
    )
    F.check_store_values(store, {0: N0, 1: N1})


def _el_crc(store: Path, shard_dir: str, local: int, seg: int, lp: int) -> int:
    el = np.fromfile(store / shard_dir / EL_CRC_FILE, "<u4").reshape(-1, 2, 2)
    return int(el[local, seg, lp])


def _crc_of(store: Path, names: list[str]) -> int:
    crc = 0
    for n in names:
        crc = crc32c((store / SH1 / PROMPT / n).read_bytes(), crc)
    return crc


@pytest.mark.parametrize("damage", ["zero-filled", "bit-flipped"])
def test_same_size_damage_is_found_by_deep_only(store, damage):
    # example 3 of shard 1 = global example 13; layer position 1 = model layer 7
    target = store / SH1 / PROMPT / "3.1.1.0"
    F.zero_fill(target) if damage == "zero-filled" else F.flip_bit(target, 17, 3)
    assert verify_store(store).problems == []  # sizes are right: fast mode cannot see it
    rep = verify_store(store, deep=True)
    names = ["3.1.0.0", "3.1.1.0", "3.1.2.0"]
    got, want = _crc_of(store, names), _el_crc(store, SH1, 3, 0, 1)
    assert kinds(rep) == [(ERROR, "checksum")]
    p = rep.problems[0]
    assert (p.shard, p.example, p.local, p.layer, p.segment) == (1, 13, 3, 7, "prompt")
    assert p.message == (
        f"crc32c of (example 13, layer 7) is {got:#010x}, the writer recorded {want:#010x}: "
        "the bytes of one of its chunk files 3.1.0.0, 3.1.1.0, 3.1.2.0 were altered"
    )
    assert rep.damaged() == [(13, 7, f"{SH1}/{PROMPT}/3.1.0.0")]


def test_truncated_chunk(store):
    F.truncate(store / SH0 / PROMPT / "4.0.2.0", 100)
    for deep in (False, True):
        rep = verify_store(store, deep=deep)
        assert kinds(rep) == [(ERROR, "chunk-size")]
        assert rep.problems[0].message == "chunk file 4.0.2.0 has 100 bytes, expected 128 (truncated)"
        assert rep.damaged() == [(4, 2, f"{SH0}/{PROMPT}/4.0.2.0")]
    with pytest.raises(CorruptChunkError, match=r"4\.0\.2\.0 has 100 bytes, expected 128: the file is damaged"):
        ActStore(store).segment("prompt").padded(4, 2)  # store[4, 2] reads only the chunks of its 6 real tokens


def test_oversized_and_missing_chunks(store):
    p = store / SH0 / "arrays/response_activations/1.1.0.0"
    p.write_bytes(p.read_bytes() + b"x")
    os.unlink(store / SH0 / PROMPT / "9.0.0.0")
    rep = verify_store(store)
    assert kinds(rep) == [(ERROR, "missing-chunk"), (ERROR, "chunk-size")]  # segment order: prompt, response
    assert rep.problems[0].message == (
        f"chunk file {SH0}/{PROMPT}/9.0.0.0 of (example 9, layer 2) is missing: the direct writer writes every chunk, "
        "so it was deleted (readers would return zeros)"
    )
    assert rep.problems[1].message == "chunk file 1.1.0.0 has 161 bytes, expected 160 (too long)"
    assert [(p.example, p.layer, p.segment) for p in rep.problems] == [(9, 2, "prompt"), (1, 7, "response")]
    # deep mode: the missing chunk's checksum fails too, still one problem per damaged chunk
    assert kinds(verify_store(store, deep=True)) == [(ERROR, "missing-chunk"), (ERROR, "chunk-size")]


def test_missing_shard_and_verify_on_open(store):
    shutil.rmtree(store / SH1)
    rep = verify_store(store)
    assert kinds(rep) == [(ERROR, "missing-shard")]
    msg = "shard shard-00001.zarr listed in the manifest (examples 10..15) is missing; shards present: ['shard-00000.zarr']"
    assert rep.problems[0].message == msg
    with pytest.raises(VerificationError) as ei:
        ActStore(store, verify="fast")
    assert str(ei.value) == (
        f"{store} failed verification (fast): 1 error, the first: {msg}. Run `actstore verify {store}` for the full table"
    )
    assert ei.value.report.errors[0].kind == "missing-shard"


def test_verify_on_open_deep_and_bad_mode(store):
    assert len(ActStore(store, verify="deep")) == 16
    F.flip_bit(store / SH0 / PROMPT / "0.0.0.0", 0)
    assert len(ActStore(store, verify="fast")) == 16  # same size: fast cannot see it
    with pytest.raises(
        VerificationError, match=r"failed verification \(deep\): 1 error, the first: crc32c of \(example 0, layer 2\)"
    ):
        ActStore(store, verify="deep")
    with pytest.raises(ValueError, match=r"^verify must be one of \[None, 'fast', 'deep', 'reads'\]. Got 'full'.$"):
        ActStore(store, verify="full")


def test_unpublished_shard_stray_and_temp_files_are_warnings(store):
    F.write_shard(store, 2, 3)
    (store / "notes.txt").write_text("hello")
    (store / ".manifest.json.tmp-123-abcd1234").write_text("{")
    (store / "shards" / ".shard-00005.zarr.tmp-9-0badf00d").mkdir()
    (store / SH0 / "meta" / "junk.bin").write_bytes(b"1")
    rep = verify_store(store)
    assert rep.ok and not rep.errors
    assert kinds(rep) == [
        (WARNING, "temp-file"),
        (WARNING, "stray-file"),
        (WARNING, "temp-file"),
        (WARNING, "stray-file"),
        (WARNING, "unpublished-shard"),
    ]
    msgs = [p.message for p in rep.problems]
    assert (
        msgs[0]
        == ".manifest.json.tmp-123-abcd1234 is the temporary file of an interrupted write (finalize killed?); safe to delete"
    )
    assert (
        msgs[2]
        == ".shard-00005.zarr.tmp-9-0badf00d is the folder of a writer killed while creating its shard; safe to delete when no writer runs"
    )
    assert msgs[3] == "junk.bin is not part of a writer shard"
    assert msgs[4] == (
        "shard shard-00002.zarr is not in the manifest (written after the last finalize, or by a writer still running); "
        "readers do not see it until `actstore finalize` publishes it"
    )
    r = CliRunner().invoke(main, ["verify", str(store)])
    assert r.exit_code == 0 and "5 warnings" in r.output
    assert CliRunner().invoke(main, ["verify", str(store), "--strict"]).exit_code == 1


def test_manifest_and_block_checksums(store):
    m = json.loads((store / spec.MANIFEST_FILE).read_text())
    m["shards"][1]["crc32c"] ^= 1
    (store / spec.MANIFEST_FILE).write_text(json.dumps(m))
    rep = verify_store(store)
    assert kinds(rep) == [(ERROR, "checksum-manifest")]
    true = m["shards"][1]["crc32c"] ^ 1
    assert rep.problems[0].message == (
        f"the block records' checksums add up to crc32c {true:#010x}, the manifest says {true ^ 1:#010x}: "
        "blocks.jsonl or the manifest was altered"
    )


def test_altered_block_record_is_found(store):
    path = store / SH0 / spec.BLOCKS_FILE
    lines = path.read_text().splitlines()
    b = json.loads(lines[1])
    b["crc32c"]["response"] ^= 4
    lines[1] = json.dumps(b)
    path.write_text("\n".join(lines) + "\n")
    assert kinds(verify_store(store)) == [(ERROR, "checksum-manifest")]
    rep = verify_store(store, deep=True)
    assert kinds(rep) == [(ERROR, "checksum-manifest"), (ERROR, "block-checksum")]
    want = b["crc32c"]["response"]
    assert rep.problems[1].message == (
        f"block 1 (examples 4..7 of the shard) has crc32c {want ^ 4:#010x}, the writer recorded {want:#010x}: "
        "the block record or the per-example checksums were altered"
    )


def test_shard_without_per_example_checksums_is_checked_per_block(store):
    os.unlink(store / SH0 / EL_CRC_FILE)
    assert verify_store(store, deep=True).problems == []
    F.flip_bit(store / SH0 / PROMPT / "5.1.0.0", 9)
    rep = verify_store(store, deep=True)
    assert kinds(rep) == [(ERROR, "block-checksum")]
    assert rep.problems[0].message.startswith("block 1 (examples 4..7 of the shard) has crc32c ")
    assert rep.problems[0].message.endswith(
        "one of its chunk files was altered (this shard records no per-example checksums to say which)"
    )


def test_commit_record_text_and_stats(store):
    rec = json.loads((store / SH1 / spec.COMMIT_FILE).read_text())
    rec["n_committed"] = 4
    rec["n_blocks"] = 1
    (store / SH1 / spec.COMMIT_FILE).write_text(json.dumps(rec))
    text = store / SH0 / "text/prompt.jsonl"
    lines = text.read_bytes().splitlines(keepends=True)
    lines[2] = b"{" + b"x" * (len(lines[2]) - 2) + b"\n"  # same size: only deep mode reads it
    text.write_bytes(b"".join(lines))
    m = json.loads((store / spec.MANIFEST_FILE).read_text())
    os.unlink(store / m["stats"])
    rep = verify_store(store, deep=True)
    assert kinds(rep) == [(ERROR, "stats"), (ERROR, "text"), (ERROR, "commit"), (ERROR, "commit"), (ERROR, "commit")]
    msgs = [p.message for p in rep.problems]
    assert msgs[0] == f"statistics file {m['stats']} named by the manifest is missing"
    assert msgs[1] == 'line 3 of prompt.jsonl is damaged (expected {"i": 2, ..., "prompt": ...})'
    assert msgs[2] == "the commit record holds 4 examples; the manifest publishes 6"
    assert (
        msgs[3]
        == "the manifest says the shard is complete with 6 examples; its commit record says complete=True with 4"
    )
    assert msgs[4] == "the commit record holds 1 blocks; the manifest publishes 2"


def test_unfinalized_store_is_verified_from_commit_records(tmp_path):
    root = tmp_path / "s"
    F.write_shard(root, 0, 5)
    rep = verify_store(root, deep=True)
    assert not rep.finalized and rep.ok
    assert kinds(rep) == [(WARNING, "not-finalized")]
    F.flip_bit(root / SH0 / PROMPT / "2.0.0.0", 1)
    rep = verify_store(root, deep=True)
    assert kinds(rep) == [(WARNING, "not-finalized"), (ERROR, "checksum")]
    assert rep.problems[1].message.startswith("crc32c of (example local 2 of shard 0, layer 2) is ")
    assert rep.damaged() == [(None, 2, f"{SH0}/{PROMPT}/2.0.0.0")]


def test_symlinked_chunk_is_refused(store, tmp_path):
    outside = tmp_path / "elsewhere.bin"
    target = store / SH0 / PROMPT / "1.0.0.0"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    rep = verify_store(store)
    assert kinds(rep) == [(ERROR, "symlink"), (ERROR, "missing-chunk")]
    assert (
        rep.problems[0].message
        == f"{SH0}/{PROMPT}/1.0.0.0 is a symbolic link to {outside}, outside the store; readers refuse it"
    )
    with pytest.raises(UnsafePathError) as ei:
        ActStore(store)[1, 2]
    assert str(ei.value) == (
        f"{target} is a symbolic link; actstore never writes links inside a store, so the store was altered: "
        "refusing to follow it (run `actstore verify`)"
    )


def test_zarr_engine_missing_zero_chunk_is_cleared_by_deep(tmp_path):
    root = tmp_path / "z"
    with actstore.ShardWriter(root, zarr_format=2, shard=0, layers=[0], d_model=4, tokens=3, engine="zarr") as w:
        w.append(np.stack([np.ones((1, 3, 4)), np.zeros((1, 3, 4)), np.ones((1, 3, 4))]).astype(np.float16))
    actstore.finalize(root)
    assert not (root / SH0 / "arrays/tokens_activations/1.0.0.0").exists()  # zarr skipped the zero chunk
    assert kinds(verify_store(root)) == [(ERROR, "missing-chunk")]
    rep = verify_store(root, deep=True)
    assert kinds(rep) == [(WARNING, "missing-chunk")] and rep.ok
    assert rep.problems[0].message == (
        f"chunk file {SH0}/arrays/tokens_activations/1.0.0.0 is missing, but the checksum shows zeros were written there "
        "(zarr omits chunks equal to the fill value: the shard was written with engine='zarr')"
    )


def test_compressed_and_zarr_sharded_stores(tmp_path):
    import numcodecs

    for name, kw in (
        ("zstd", dict(zarr_format=2, compressor=numcodecs.Zstd())),
        ("sharded", dict(zarr_format=3, shard_examples=4)),
    ):
        root = tmp_path / name
        with actstore.ShardWriter(root, shard=0, layers=[0, 1], d_model=8, tokens=6, commit_bytes=500, **kw) as w:
            w.append(np.random.default_rng(0).standard_normal((10, 2, 6, 8)).astype(np.float16))
        actstore.finalize(root)
        assert verify_store(root, deep=True).problems == []
        adir = root / SH0 / "arrays/tokens_activations"
        if name == "zstd":
            F.flip_bit(adir / "3.1.0.0", 12)  # zstd frame content: decodes to other bytes or fails
            rep = verify_store(root, deep=True)
            assert [(p.kind, p.example) for p in rep.problems] in ([("checksum", 3)], [("chunk-decode", 3)])
        else:
            F.truncate(adir / "c/1/0/0/0", 100)
            rep = verify_store(root)
            assert kinds(rep) == [(ERROR, "chunk-size")]
            assert rep.problems[0].message.endswith("has 100 bytes, less than its 132-byte index")


def test_cli_verify_table_json_and_errors(store, tmp_path):
    F.truncate(store / SH0 / PROMPT / "4.0.2.0", 0)
    r = CliRunner().invoke(main, ["verify", str(store), "--quiet"])
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert (
        lines[0]
        == f"verify (fast) {store}: 16 examples in 2 shards, 128 chunk files checked, 0 bytes read: 1 error, 0 warnings"
    )
    assert lines[1].split() == ["SEVERITY", "PROBLEM", "SHARD", "EXAMPLE", "LAYER", "SEGMENT", "FILE"]
    assert lines[2].split() == ["error", "chunk-size", "0", "4", "2", "prompt", f"{SH0}/{PROMPT}/4.0.2.0"]
    assert lines[3] == "    chunk file 4.0.2.0 has 0 bytes, expected 128 (truncated)"
    r = CliRunner().invoke(main, ["verify", str(store), "--json"])
    doc = json.loads(r.output)
    assert r.exit_code == 1 and doc["ok"] is False and doc["problems"][0]["kind"] == "chunk-size"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(main, ["verify", str(empty)])
    assert r.exit_code == 1
    assert r.output == f"actstore: error: {empty} is not an actstore store (no actstore.json or manifest.json)\n"
    with pytest.raises(StoreNotFoundError):
        verify_store(empty)


def test_consolidated_metadata_must_agree_with_the_arrays(store):
    zarray = store / SH0 / PROMPT / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["chunks"] = [1, 1, 6, 16]
    zarray.write_text(json.dumps(meta))
    rep = verify_store(store)
    assert kinds(rep) == [(ERROR, "array-meta")]
    assert rep.problems[0].message == (
        "the shard's consolidated metadata disagrees with the array's own metadata (readers use the consolidated copy)"
    )
    np.testing.assert_array_equal(ActStore(store)[0, 2], F.expected(0, 0, 2))  # readers are unaffected


def test_resume_of_a_shard_without_per_example_checksums(tmp_path):
    root = tmp_path / "s"
    w = F.writer(root, 0)
    F.append_range(w, 0, 0, 8)
    w.commit()
    w._close_files()  # a writer that stopped without closing (or an older actstore)
    os.unlink(root / SH0 / EL_CRC_FILE)
    F.write_shard(root, 0, 12)
    actstore.finalize(root)
    assert not (root / SH0 / EL_CRC_FILE).exists()
    assert verify_store(root, deep=True).problems == []
    F.check_store_values(root, {0: 12})


def test_unreadable_statistics_file(store):
    m = json.loads((store / spec.MANIFEST_FILE).read_text())
    (store / m["stats"]).write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(
        actstore.CorruptStoreError,
        match=r"statistics file .* is unreadable \(not a readable statistics file \(BadZipFile: File is not a zip file\)\)",
    ):
        ActStore(store).stats()
    rep = verify_store(store, deep=True)
    assert kinds(rep) == [(ERROR, "stats")]
