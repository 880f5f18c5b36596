"""verify-saev: every export verifies; each damage to a copy is named with its exact message."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from factory import vit_store

from actstore.saev import export_saev, verify_saev

SHAPE = "examples_per_shard 3 x 2 layers x 5 tokens x 8 d_model x 4 bytes"  # 960 bytes per shard


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    store = vit_store(tmp / "s", n=13)
    return {
        proto: export_saev(store, tmp / "x" / "saev" / "shards", protocol=proto, patches_per_shard=30, progress=False)
        for proto in ("2.0", "2.1")
    }


def _copy(exports, proto, tmp_path):
    src = exports[proto].path
    dst = tmp_path / "saev" / "shards" / src.name
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        os.chmod(p, 0o644)
    return dst


def _edit_metadata(d, proto, **changes):
    md = json.loads((d / "metadata.json").read_text())
    md.update(changes)
    (d / "metadata.json").write_text(json.dumps(md, indent=2))
    return md


def _truncate(d, proto):
    os.truncate(d / "acts000001.bin", 500)
    return [f"acts000001.bin: 500 bytes, expected 960 ({SHAPE}; the last shard too is full size, zero-padded)"]


def _rename(d, proto):
    d.rename(d.with_name("deadbeef"))
    rule = (
        "full sha256 of the sorted-keys compact JSON of metadata"
        if proto == "2.0"
        else "first 8 hex digits of sha256 of the field-ordered compact JSON of metadata"
    )
    return [
        f"directory name 'deadbeef' is not the metadata hash {d.name!r} ({rule}): metadata.json was edited or the directory renamed"
    ]


def _edit_ckpt(d, proto):
    from actstore.layout.saevspec import metadata_hash

    md = _edit_metadata(d, proto, ckpt="someone/else")
    rule = (
        "full sha256 of the sorted-keys compact JSON of metadata"
        if proto == "2.0"
        else "first 8 hex digits of sha256 of the field-ordered compact JSON of metadata"
    )
    return [
        f"directory name {d.name!r} is not the metadata hash {metadata_hash(md, proto)!r} ({rule}): "
        "metadata.json was edited or the directory renamed"
    ]


def _edit_invalid(d, proto):
    n_key = "n_ex" if proto == "2.0" else "n_examples"
    _edit_metadata(d, proto, family="llama", dtype="float16", **{n_key: -1})
    fams = (
        "['clip', 'siglip', 'dinov2']"
        if proto == "2.0"
        else ("['bird-mae', 'clip', 'dinov2', 'dinov3', 'fake-clip', 'pe-core', 'pe-spatial', 'siglip']")
    )
    return [
        f"metadata.json: family must be one of {fams}. Got 'llama'.",
        f"metadata.json: {n_key} must be a non-negative int. Got -1.",
        "metadata.json: dtype must be 'float32'. Got 'float16'.",
    ]


def _short_labels(d, proto):
    os.truncate(d / "labels.bin", 13 * 4 - 1)
    return ["labels.bin: 51 bytes, expected 52 (n_examples 13 x 4 content tokens, uint8)"]


def _stray(d, proto):
    (d / "notes.txt").write_text("hi")
    (d / "acts000009.bin").write_bytes(b"")
    return [
        "stray file 'acts000009.bin': not listed in shards.json",
        "stray file 'notes.txt': a saev shard directory holds only metadata.json, shards.json, acts*.bin and labels.bin",
    ]


def _padding(d, proto):
    with open(d / "acts000004.bin", "r+b") as f:  # 13 = 4 x 3 + 1: the last shard holds 1 example
        f.seek(900)
        f.write(b"\x01")
    return [
        "acts000004.bin: padding after its 1 examples holds non-zero bytes (the last shard's padding must be zeros)"
    ]


def _shards_json(d, proto):
    key = "n_ex" if proto == "2.0" else "n_examples"
    entries = json.loads((d / "shards.json").read_text())
    entries[1][key] = 2
    entries[2] = {"name": "acts000002.bin", "count": 3}
    del entries[4]
    (d / "shards.json").write_text(json.dumps(entries))
    return [
        f"shards.json: entry 2 must have exactly the keys ['name', '{key}'] (protocol {proto}); got ['count', 'name']",
        "shards.json: lists 4 shards; 13 examples at 3 per shard make 5",
        "shards.json: acts000001.bin holds 2 examples, expected 3 (examples_per_shard 3; the last shard holds the remainder)",
        "stray file 'acts000002.bin': not listed in shards.json",
        "stray file 'acts000004.bin': not listed in shards.json",
    ]


def _missing_and_fields(d, proto):
    (d / "acts000003.bin").unlink()
    md = json.loads((d / "metadata.json").read_text())
    md.pop("ckpt")
    md["extra"] = 1
    (d / "metadata.json").write_text(json.dumps(md))
    from actstore.layout.saevspec import FIELDS

    return [
        f"metadata.json: missing fields ['ckpt'] (protocol {proto} has exactly: {', '.join(FIELDS[proto])})",
        f"metadata.json: unknown fields ['extra'] (protocol {proto} has exactly: {', '.join(FIELDS[proto])})",
        "acts000003.bin: missing (listed in shards.json)",
    ]


DAMAGES = {
    "truncated shard": _truncate,
    "wrong hash name": _rename,
    "edited metadata": _edit_ckpt,
    "invalid metadata": _edit_invalid,
    "short labels": _short_labels,
    "stray file": _stray,
    "dirty padding": _padding,
    "bad shards.json": _shards_json,
    "missing file and fields": _missing_and_fields,
}


@pytest.mark.parametrize("proto", ["2.0", "2.1"])
def test_exports_verify(exports, proto):
    rep = verify_saev(exports[proto].path, values=True)
    assert (rep.ok, rep.problems, rep.protocol, rep.geometry.n_shards) == (True, [], proto, 5)


@pytest.mark.parametrize("proto", ["2.0", "2.1"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_damage_is_named(exports, tmp_path, proto, damage):
    d = _copy(exports, proto, tmp_path)
    assert verify_saev(d).problems == []
    want = DAMAGES[damage](d, proto)
    path = d.with_name("deadbeef") if damage == "wrong hash name" else d
    assert verify_saev(path).problems == want


@pytest.mark.parametrize("proto", ["2.0", "2.1"])
def test_several_damages_are_all_listed(exports, tmp_path, proto):
    d = _copy(exports, proto, tmp_path)
    want = _short_labels(d, proto)
    want = _truncate(d, proto) + want
    want = _stray(d, proto) + want
    assert sorted(verify_saev(d).problems) == sorted(want)


def test_values_finds_non_finite(exports, tmp_path):
    d = _copy(exports, "2.0", tmp_path)
    with open(d / "acts000002.bin", "r+b") as f:  # example 7 = shard 2, local 1; layer position 1; token 3
        f.seek(((1 * 2 * 5) + 1 * 5 + 3) * 8 * 4 + 4)
        f.write(np.array([np.nan, np.inf], dtype="<f4").tobytes())
    assert verify_saev(d).problems == []
    probs = verify_saev(d, values=True).problems
    assert probs[0] == "acts000002.bin: 2 non-finite values (first at example 7, layer 5, token 3)"
    assert len(probs) == 2 and probs[1].startswith(
        "acts000002.bin: crc32c "
    )  # the export's checksum sidecar sees it too


def test_protocol_2_1_outside_saev_shards_and_other_protocols(exports, tmp_path):
    src = exports["2.1"].path
    d = tmp_path / "elsewhere" / src.name
    shutil.copytree(src, d)
    assert verify_saev(d).problems == [
        f"location: protocol 2.1 directories must sit at .../saev/shards/<hash> (saev's loaders check); this one is {d}"
    ]
    os.chmod(d / "metadata.json", 0o644)
    md = json.loads((d / "metadata.json").read_text())
    (d / "metadata.json").write_text(json.dumps(dict(reversed(list(md.items())))))
    assert (
        "metadata.json: fields are out of order; protocol 2.1 requires the order family, ckpt, layers, "
        in verify_saev(d).problems[0]
    )
    (d / "metadata.json").write_text(json.dumps(md | {"protocol": "1.1"}))
    assert verify_saev(d).problems == ["metadata.json: protocol must be one of ['2.0', '2.1']. Got '1.1'."]
    (d / "metadata.json").write_text("{not json")
    assert verify_saev(d).problems[0].startswith("metadata.json: not valid UTF-8 JSON (")
