"""Legacy pkl.gz imports are bounded: shared references, objects built, special files,
nested JSON and out-of-range values give LegacyFormatError naming the limit, never a
MemoryError, a hang or another exception."""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest
from hostile import outcome, run_cli
from legacy_stores import LAYERS, legacy_records, write_legacy

from actstore.errors import LegacyFormatError
from actstore.legacy import import_pkl
from actstore.legacy.safe_pickle import MAX_OBJECTS


def _shared_array_shard(n: int) -> dict:
    """n records per layer, every one referring to the same 1 MiB array (pickle writes it once)."""
    a = np.zeros((4, 65_536), np.float32)
    return {f"layer_{l}": [{"sample_idx": i, "activation": a} for i in range(n)] for l in LAYERS}


def test_records_sharing_one_array_are_refused_before_expanding(tmp_path):
    doc = _shared_array_shard(4000)  # 4000 x 2 layers x 1 MiB = 8 GiB once expanded
    src = write_legacy(tmp_path / "bomb", [doc], extraction_config={"layers_extracted": LAYERS, "max_seq_length": 4})
    assert sum(p.stat().st_size for p in src.iterdir()) < 200_000
    tracemalloc.start()
    kind, e = outcome(import_pkl, src, tmp_path / "s", limit=30)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert kind == "error" and isinstance(e, LegacyFormatError)
    assert str(e) == (
        f"{src / 'shard_0001.pkl.gz'}: the pickle refers to an array more than once (a shared reference; at most 1 more "
        "times for larger objects, never for arrays): its records would be copied once per reference (a damaged or "
        "hostile file?); refusing it"
    )
    assert peak < 64 * 2**20
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_records_sharing_one_record_dict_are_refused(tmp_path):
    rec = {"sample_idx": 0, "activation": np.zeros((2, 8), np.float32)}
    doc = {f"layer_{l}": [rec] * 3 for l in LAYERS}
    src = write_legacy(tmp_path / "d", [doc])
    kind, e = outcome(import_pkl, src, tmp_path / "s")
    assert kind == "error" and "the pickle refers to a dict holding an array more than once" in str(e)


def test_text_shared_between_the_layers_of_one_example_is_allowed(tmp_path):
    """A legacy writer may give each example's records in the layer lists one text and one
    metadata dict (what export-pkl writes): referenced once per extra layer, that is fine."""
    rng = np.random.default_rng(0)
    doc = legacy_records(0, 3, rng)
    for i in range(3):
        text, meta = f"{i}" + "x" * 500, {"k": list(range(100))}
        for l in LAYERS:
            doc[f"layer_{l}"][i]["text_preview"] = text
            doc[f"layer_{l}"][i]["metadata"] = meta
    src = write_legacy(tmp_path / "ok", [doc])
    report = import_pkl(src, tmp_path / "s")
    assert report.n_examples == 3
    for l in LAYERS:  # a third reference (beyond one per layer) is refused
        doc[f"layer_{l}"][1]["text_preview"] = doc[f"layer_{l}"][0]["text_preview"]
    src = write_legacy(tmp_path / "three", [doc])
    kind, e = outcome(import_pkl, src, tmp_path / "s2")
    assert kind == "error" and "the pickle refers to a str more than once" in str(e)


def test_pickle_building_too_many_objects_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    doc = legacy_records(0, 2, rng)
    doc[f"layer_{LAYERS[0]}"][0]["metadata"] = {"tokens": list(range(5000))}
    src = write_legacy(tmp_path / "many", [doc])
    kind, e = outcome(import_pkl, src, tmp_path / "s", max_objects=2000)
    assert kind == "error"
    assert str(e) == (
        f"{src / 'shard_0001.pkl.gz'}: the pickle builds more than 2000 objects (max_objects), more than its metadata's "
        "records need (a damaged or hostile file?); pass a larger max_objects if the shard is genuine"
    )
    assert import_pkl(src, tmp_path / "s2").n_examples == 2  # the default MAX_OBJECTS admits it
    assert MAX_OBJECTS == 10_000_000
    code, out = run_cli("import-pkl", str(src), str(tmp_path / "s3"), "--max-objects", "2000", "--quiet")
    assert code == 1 and "the pickle builds more than 2000 objects (max_objects)" in out


@pytest.mark.parametrize("target", ["metadata.json", "shard_0001.pkl.gz"])
@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_special_files_in_a_legacy_directory(tmp_path, target, kind):
    src = write_legacy(tmp_path / "src", [legacy_records(0, 2, np.random.default_rng(0))])
    (src / target).unlink()
    os.mkfifo(src / target) if kind == "fifo" else (src / target).mkdir()
    what = "a FIFO (named pipe)" if kind == "fifo" else "a folder"
    k, e = outcome(import_pkl, src, tmp_path / "s")
    assert k == "error" and isinstance(e, LegacyFormatError)
    assert (
        str(e)
        == f"{src / target} is {what} where a file belongs; a legacy directory holds only metadata.json and its shard files"
    )


def test_nested_metadata_json_and_pickled_metadata(tmp_path):
    src = write_legacy(tmp_path / "src", [legacy_records(0, 2, np.random.default_rng(0))])
    (src / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)
    k, e = outcome(import_pkl, src, tmp_path / "s")
    assert (
        k == "error" and str(e) == f"{src / 'metadata.json'} is not valid JSON (nested deeper than JSON parsing allows)"
    )
    doc = legacy_records(0, 2, np.random.default_rng(0))
    doc[f"layer_{LAYERS[0]}"][0]["metadata"] = json.loads("[" * 200 + "]" * 200)  # deeper than MAX_JSON_DEPTH
    k, e = outcome(import_pkl, write_legacy(tmp_path / "deep", [doc]), tmp_path / "s2")
    assert (
        k == "error"
        and "metadata is not standard JSON (kept as a text of the store) (ValueError: nested deeper than 64 levels)"
        in str(e)
    )
    doc[f"layer_{LAYERS[0]}"][0]["metadata"] = {"score": float("nan")}
    k, e = outcome(import_pkl, write_legacy(tmp_path / "nan", [doc]), tmp_path / "s3")
    assert k == "error" and "metadata is not standard JSON" in str(e)


def test_sample_idx_beyond_int64(tmp_path):
    doc = legacy_records(0, 2, np.random.default_rng(0))
    for l in LAYERS:
        doc[f"layer_{l}"][0]["sample_idx"] = 2**64
    k, e = outcome(import_pkl, write_legacy(tmp_path / "big", [doc]), tmp_path / "s")
    assert k == "error" and "sample_idx must be a non-negative int64. Got 18446744073709551616." in str(e)
