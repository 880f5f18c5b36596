"""Legacy pkl.gz import/export: mapping, checksums, the restricted unpickler, hostile files."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import pickle
import subprocess
from pathlib import Path

import faultlib as F
import numpy as np
import pytest
from click.testing import CliRunner
from legacy_stores import LAYERS, D, T, legacy_records, write_legacy

from actstore import ActStore
from actstore.cli import main
from actstore.errors import LegacyExportExistsError, LegacyFormatError, StoreMismatchError, UnsafePickleError
from actstore.legacy import export_pkl, import_pkl, parse_metadata, restricted_loads
from actstore.legacy import importer as importer_mod
from actstore.verify import verify_store


@pytest.fixture
def legacy(tmp_path) -> tuple[Path, list[dict]]:
    rng = np.random.default_rng(5)
    shards = [legacy_records(0, 5, rng), legacy_records(5, 3, rng)]
    return write_legacy(tmp_path / "legacy", shards), shards


def test_import_maps_layers_ids_texts_and_metadata(legacy, tmp_path):
    src, shards = legacy
    rep = import_pkl(src, tmp_path / "store", dtype="float32")
    assert (rep.n_shards, rep.n_imported, rep.n_skipped, rep.n_examples) == (2, 2, 0, 8)
    assert (rep.layers, rep.d_model, rep.t_max, rep.dtype, rep.warnings) == (LAYERS, D, T, "float32", [])
    assert (
        rep.summary().splitlines()[1] == "layers [15, 16], d_model 8, segment 'tokens' with T_max 6, stored as float32"
    )
    st = ActStore(tmp_path / "store", verify="deep")
    assert len(st) == 8
    recs = [r for s in shards for r in zip(*(s[f"layer_{l}"] for l in LAYERS))]
    for ex, per_layer in enumerate(recs):
        for l, r in zip(LAYERS, per_layer):
            np.testing.assert_array_equal(st[ex, l], r["activation"])  # exact: stored as float32
        s = st.sample(ex)
        assert s["sample_idx"] == 1000 + ex and s["sample_key"] == str(1000 + ex)
        assert s["text_preview"] == f"text of sample {ex}"
        assert s["metadata"] == {"token_count": 2 + ex % 5, "dataset_idx": 7 * ex, "machine_id": 0}
    legacy_attrs = st.meta["legacy_pkl"]
    assert (
        legacy_attrs["extraction_config"]["model_name"] == "Qwen/Qwen2.5-7B" and st.config.model_id == "Qwen/Qwen2.5-7B"
    )
    assert legacy_attrs["metadata_sha256"] == hashlib.sha256((src / "metadata.json").read_bytes()).hexdigest()


def test_export_then_import_round_trip(legacy, tmp_path):
    src, shards = legacy
    import_pkl(src, tmp_path / "a", dtype="float32")
    rep = export_pkl(tmp_path / "a", tmp_path / "out", examples_per_shard=3)
    assert (rep.n_examples, rep.n_shards) == (8, 3)
    md = json.loads((tmp_path / "out/metadata.json").read_text())
    assert [s["filename"] for s in md["shards"]] == ["shard_0001.pkl.gz", "shard_0002.pkl.gz", "shard_0003.pkl.gz"]
    assert md["extraction_config"]["model_name"] == "Qwen/Qwen2.5-7B" and md["statistics"]["total_samples"] == 8
    with gzip.open(tmp_path / "out/shard_0002.pkl.gz") as f:  # a plain reader of the format
        doc = pickle.load(f)
    r = doc["layer_16"][0]
    assert r["sample_idx"] == 1003 and r["shape"] == (5, D) and r["text_preview"] == "text of sample 3"
    np.testing.assert_array_equal(r["activation"], shards[0]["layer_16"][3]["activation"])
    import_pkl(tmp_path / "out", tmp_path / "b", dtype="float32")
    a, b = ActStore(tmp_path / "a"), ActStore(tmp_path / "b")
    for ex in range(8):
        for l in LAYERS:
            np.testing.assert_array_equal(a[ex, l], b[ex, l])
        assert a.sample(ex)["metadata"] == b.sample(ex)["metadata"]
    with pytest.raises(LegacyExportExistsError, match="already holds a legacy export"):
        export_pkl(tmp_path / "a", tmp_path / "out")
    assert export_pkl(tmp_path / "a", tmp_path / "out", overwrite=True, examples_per_shard=8).n_shards == 1


def test_export_of_a_native_store_and_interrupted_export(tmp_path):
    F.write_shard(tmp_path / "s", 0, 5)
    from actstore import finalize

    finalize(tmp_path / "s")
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_0001.pkl.gz").write_bytes(b"half written by a killed export")
    export_pkl(tmp_path / "s", out, examples_per_shard=2)
    with gzip.open(out / "shard_0001.pkl.gz") as f:
        doc = pickle.load(f)
    assert sorted(doc) == ["layer_2", "layer_7"]
    r = doc["layer_7"][1]
    assert r["sample_idx"] == 1 and r["text_preview"] == "text 0-1"
    assert r["metadata"] == {"sample_key": "0-1", "label": 1}
    np.testing.assert_array_equal(r["activation"], F.expected(0, 1, 7).astype(np.float32))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign/notes.txt").write_text("x")
    with pytest.raises(LegacyExportExistsError) as ei:
        export_pkl(tmp_path / "s", tmp_path / "foreign")
    assert (
        str(ei.value)
        == f"{tmp_path / 'foreign'} holds files that an export did not write (notes.txt); export to a new or empty folder"
    )


class _Evil:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_malicious_pickle_is_refused(tmp_path, protocol):
    marker = tmp_path / "pwned"
    evil = {
        f"layer_{l}": [
            {
                "sample_idx": 0,
                "activation": np.zeros((2, D), np.float32),
                "metadata": _Evil(os.system, f"touch {marker}"),
            }
        ]
        for l in LAYERS
    }
    src = write_legacy(tmp_path / "legacy", [evil], protocol=protocol)
    with pytest.raises(UnsafePickleError) as ei:
        import_pkl(src, tmp_path / "store")
    assert str(ei.value) == (
        f"{src / 'shard_0001.pkl.gz'}: the pickle asks for posix.system, which a legacy shard never needs "
        "(it holds only dicts, lists, strings, numbers and numpy arrays); refusing to load it. "
        "The file may be malicious: do not open it with pickle.load"
    )
    assert not marker.exists()
    assert not (tmp_path / "store" / "shards").exists()  # nothing was written
    r = CliRunner().invoke(main, ["import-pkl", str(src), str(tmp_path / "store2")])
    assert r.exit_code == 1 and r.output.startswith("actstore: error: ") and r.output.count("\n") == 1


@pytest.mark.parametrize(
    "fn, name", [(eval, "builtins.eval"), (subprocess.Popen, "subprocess.Popen"), (getattr, "builtins.getattr")]
)
def test_restricted_unpickler_refuses_other_callables(fn, name):
    with pytest.raises(UnsafePickleError, match=f"the pickle asks for {name}, which a legacy shard never needs"):
        restricted_loads(pickle.dumps({"x": _Evil(fn, "1")}))


def test_restricted_unpickler_admits_numpy_of_every_protocol():
    obj = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "i": np.int64(3),
        "f": np.float32(1.5),
        "t": (1, "x"),
        "b": b"\x00\xff",
    }
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        got = restricted_loads(pickle.dumps(obj, protocol=protocol))
        np.testing.assert_array_equal(got["a"], obj["a"])
        assert (got["i"], got["f"], got["t"], got["b"]) == (3, 1.5, (1, "x"), b"\x00\xff")
    with pytest.raises(UnsafePickleError, match="encoding 'rot13'; only 'latin1'"):
        restricted_loads(pickle.dumps(_Evil2(), protocol=2))


class _Evil2:
    def __reduce__(self):
        import _codecs

        return (_codecs.encode, ("abc", "rot13"))


def test_checksum_size_and_path_problems(legacy, tmp_path):
    src, _ = legacy
    shard = src / "shard_0002.pkl.gz"
    data = bytearray(shard.read_bytes())
    data[20] ^= 1
    shard.write_bytes(bytes(data))
    md = json.loads((src / "metadata.json").read_text())
    with pytest.raises(LegacyFormatError) as ei:
        import_pkl(src, tmp_path / "s1")
    got = hashlib.sha256(bytes(data)).hexdigest()
    assert str(ei.value) == (
        f"{shard} has sha256 {got}; metadata.json lists {md['shards'][1]['checksum'][7:]}: the file is damaged or was replaced, "
        "nothing of it was imported"
    )
    assert (tmp_path / "s1/shards/shard-00000.zarr").exists() and not (tmp_path / "s1/shards/shard-00001.zarr").exists()
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(
        LegacyFormatError,
        match=f"has {len(data) - 10} bytes; metadata.json says {len(data)} \\(truncated or replaced\\?\\)",
    ):
        import_pkl(src, tmp_path / "s2")
    for k, bad in enumerate(("../outside.pkl.gz", "/etc/passwd")):
        md["shards"][1]["filename"] = bad
        (src / "metadata.json").write_text(json.dumps(md))
        with pytest.raises(LegacyFormatError) as ei:
            import_pkl(src, tmp_path / f"s3-{k}")
        assert (
            str(ei.value)
            == f"{src / 'metadata.json'}: shard filename {bad!r} points outside {src}; refusing to read it"
        )


def test_bounded_decompression_and_shape_checks(tmp_path):
    rng = np.random.default_rng(0)
    doc = legacy_records(0, 2, rng)
    bomb = gzip.compress(b"\x80\x04" + b"N" * (1 << 24))  # 16 MiB of pickle from a few KiB
    src = write_legacy(tmp_path / "bomb", [doc], raw={0: bomb})
    with pytest.raises(LegacyFormatError) as ei:
        import_pkl(src, tmp_path / "s", max_shard_bytes=1 << 20)
    assert str(ei.value) == (
        f"{src / 'shard_0001.pkl.gz'} decompresses to more than 1048576 bytes, more than its metadata allows "
        "(a damaged or hostile file?); pass a larger max_shard_bytes if the shard is genuine"
    )
    doc["layer_16"][1]["activation"] = np.zeros((3, D + 1), np.float32)
    src = write_legacy(tmp_path / "wide", [doc])
    with pytest.raises(LegacyFormatError, match=r"layer_16\[1\]: activation has hidden size 9; metadata.json says 8"):
        import_pkl(src, tmp_path / "s")
    doc["layer_16"][1]["activation"] = np.zeros((T + 1, D), np.float32)
    doc["layer_16"][1]["shape"] = (T + 1, D)
    src = write_legacy(tmp_path / "long", [doc])
    with pytest.raises(LegacyFormatError, match="activation has 7 tokens, more than max_seq_length 6; pass tokens=T"):
        import_pkl(src, tmp_path / "s")
    doc = legacy_records(0, 2, rng)
    del doc["layer_16"]
    src = write_legacy(
        tmp_path / "layers", [{**doc, "layer_3": copy.deepcopy(doc["layer_15"])}]
    )  # a copy: shared records are refused
    with pytest.raises(
        LegacyFormatError, match=r"holds keys \['layer_15', 'layer_3'\]; metadata.json lists layers \[15, 16\]"
    ):
        import_pkl(src, tmp_path / "s")
    doc = legacy_records(0, 2, rng)
    doc["layer_15"][1]["activation"] = np.zeros((2, D), object)
    src = write_legacy(tmp_path / "obj", [doc])
    with pytest.raises(
        LegacyFormatError, match=r"activation must be a 2-D float array \[seq_len, hidden_size\]. Got object array"
    ):
        import_pkl(src, tmp_path / "s")


def test_interrupted_import_resumes(legacy, tmp_path, monkeypatch):
    src, _ = legacy
    real = importer_mod._write_shard
    calls = []

    def crash_on_second(root, i, examples, *a, **kw):
        calls.append(i)
        if i == 1:
            raise KeyboardInterrupt("killed")
        return real(root, i, examples, *a, **kw)

    monkeypatch.setattr(importer_mod, "_write_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        import_pkl(src, tmp_path / "store")
    monkeypatch.setattr(importer_mod, "_write_shard", real)
    rep = import_pkl(src, tmp_path / "store")
    assert (rep.n_imported, rep.n_skipped, rep.n_examples) == (1, 1, 8)
    assert verify_store(tmp_path / "store", deep=True).problems == []
    other = write_legacy(tmp_path / "other", [legacy_records(0, 1, np.random.default_rng(9))])
    with pytest.raises(StoreMismatchError, match="already holds shard 0, not imported from this metadata.json"):
        import_pkl(other, tmp_path / "store")


@pytest.mark.parametrize(
    "doc, message",
    [
        ([], "metadata.json must hold a JSON object. Got list."),
        (
            {"version": "2.0", "extraction_config": {}, "shards": [{}]},
            "metadata.json has version '2.0'; actstore imports the legacy format version 1.x",
        ),
        ({"version": "1.0", "extraction_config": {}, "shards": []}, "metadata.json: shards must be a non-empty list"),
        (
            {
                "version": "1.0",
                "extraction_config": {},
                "shards": [{"shard_id": 1, "filename": "a", "num_samples": -1, "layers": [1]}],
            },
            "metadata.json: num_samples must be a non-negative int (at most 1099511627776). Got -1.",
        ),
        (
            {
                "version": "1.0",
                "extraction_config": {},
                "shards": [{"shard_id": 1, "filename": "a", "num_samples": 1, "layers": [1], "checksum": "md5:x"}],
            },
            "metadata.json: checksum of a must be 'sha256:<64 hex digits>'. Got 'md5:x'.",
        ),
    ],
)
def test_metadata_parser_messages(doc, message):
    with pytest.raises(LegacyFormatError) as ei:
        parse_metadata(doc)
    assert str(ei.value) == message


def test_cli_import_and_export(legacy, tmp_path):
    src, _ = legacy
    r = CliRunner().invoke(main, ["import-pkl", str(src), str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == (
        f"imported {src} -> {tmp_path / 's'}: 8 examples from 2 legacy shards (2 written now, 0 already imported), "
        f"{sum((src / f).stat().st_size for f in ('shard_0001.pkl.gz', 'shard_0002.pkl.gz'))} bytes read"
    )
    r = CliRunner().invoke(
        main, ["export-pkl", str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--examples-per-shard", "4"]
    )
    assert r.exit_code == 0 and r.output.startswith(
        f"exported {tmp_path / 's'} -> {tmp_path / 'o'}: 8 examples in 2 pkl shards"
    )
