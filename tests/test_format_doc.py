"""docs/format.md is normative: its field tables must match what the code writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

import actstore
from actstore import ShardWriter
from actstore.layout import spec

DOC = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()


def _table_fields(heading_fragment: str, first_header: str = "field") -> list[str]:
    """Field names of the first table after a line containing `heading_fragment`."""
    lines = DOC.splitlines()
    start = next(i for i, line in enumerate(lines) if heading_fragment in line)
    rows, in_table = [], False
    for line in lines[start + 1 :]:
        if line.startswith(f"| {first_header} |"):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            cell = line.split("|")[1].strip()
            if set(cell) <= {"-"}:
                continue
            rows.append(cell.strip("`"))
    return rows


def test_tables_list_exactly_the_code_fields():
    assert _table_fields("### 1.1 actstore.json") == list(spec.IDENTITY_FIELDS)
    assert _table_fields("### 1.2 The configuration object") == [*spec.CONFIG_FIELDS, *spec.CONFIG_OPTIONAL_FIELDS]
    assert _table_fields("Each entry of `segments`") == ["name", *spec.SEGMENT_FIELDS]
    assert _table_fields("commit.json:") == [*spec.COMMIT_FIELDS, *spec.COMMIT_OPTIONAL_FIELDS]
    manifest = _table_fields("## 6. The manifest")
    assert [f for f in manifest if f not in spec.MANIFEST_OPTIONAL_FIELDS] == list(spec.MANIFEST_FIELDS)
    assert sorted(set(manifest) - set(spec.MANIFEST_FIELDS)) == sorted(spec.MANIFEST_OPTIONAL_FIELDS)
    assert _table_fields("### 5.1 Leases") == list(spec.LEASE_FIELDS)
    assert _table_fields("Each entry of `shards`") == list(spec.MANIFEST_SHARD_FIELDS)
    assert _table_fields("### 3.2 Dtypes", "dtype") == list(spec.ACT_DTYPES)


def test_the_spool_tables_list_exactly_the_record_fields():
    from actstore.layout import spool

    assert _table_fields("`spool/spool.json`: written once") == list(spool.SPOOL_FIELDS)
    assert _table_fields("`spool/consumers/<name>/rank-<r>.json`: one per rank") == list(spool.CONSUMER_FIELDS)
    assert _table_fields("`spool/dropped/<name>.json`: written by") == list(spool.DROPPED_FIELDS)
    assert _table_fields("`spool/removed/<shard_name>/<remover>.json`: what one") == list(spool.REMOVED_FIELDS)


def test_every_spec_constant_is_named_in_the_document():
    names = [n for n in dir(spec) if n.isupper()]
    missing = [n for n in names if n not in DOC and not n.endswith("_FIELDS")]
    assert missing == []
    for n in names:
        v = getattr(spec, n)
        if isinstance(v, str) and n not in ("SEGMENT_NAME_PATTERN",):
            assert v.replace("{:05d}", "") in DOC or v in DOC, n


def test_written_documents_have_exactly_the_documented_fields(store_path):
    with ShardWriter(store_path, shard=0, layers=[0], d_model=2, tokens=3, world_size=2) as w:
        w.append(np.zeros((2, 1, 3, 2), np.float16))
    actstore.finalize(store_path, allow_partial=True)  # rank 1 wrote nothing: every optional field
    ident = json.loads((store_path / spec.IDENTITY_FILE).read_text())
    manifest = json.loads((store_path / spec.MANIFEST_FILE).read_text())
    commit = json.loads((store_path / "shards/shard-00000.zarr" / spec.COMMIT_FILE).read_text())
    block = json.loads((store_path / "shards/shard-00000.zarr" / spec.BLOCKS_FILE).read_text().splitlines()[0])
    assert list(ident) == _table_fields("### 1.1 actstore.json")
    assert list(ident["config"]) == list(spec.CONFIG_FIELDS)  # token_ids (optional) is absent when false
    assert [
        f for f in _table_fields("### 1.2 The configuration object") if f not in spec.CONFIG_OPTIONAL_FIELDS
    ] == list(spec.CONFIG_FIELDS)
    assert sorted(ident["config"]["segments"][0]) == sorted(_table_fields("Each entry of `segments`"))
    assert list(commit) == _table_fields("commit.json:")
    # every optional field but a spool's budget (tests/test_spool_tools.py checks a spool's manifest)
    assert list(manifest) == [f for f in _table_fields("## 6. The manifest") if f != "spool_budget"]
    assert list(manifest["shards"][0]) == _table_fields("Each entry of `shards`")
    documented_block = re.search(
        r"`\{\"start\", \"stop\", \"crc32c\": \{segment: crc\}, \"nbytes\", \"per_sample_crc32c\": \{array: crc\}\}`",
        DOC,
    )
    assert documented_block and list(block) == ["start", "stop", "crc32c", "nbytes", "per_sample_crc32c"]


def test_the_layout_package_matches_the_document():
    """The records' fields and the names in actstore/layout are the document's."""
    import dataclasses

    from actstore.layout import keys, records

    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert sorted(names(records.Commit)) == sorted(_table_fields("commit.json:"))
    assert names(records.ShardEntry) == _table_fields("Each entry of `shards`")
    assert names(records.Block) == ["start", "stop", "crc32c", "nbytes", "per_sample_crc32c"]
    manifest_doc = set(_table_fields("## 6. The manifest"))
    assert set(names(records.Manifest)) <= manifest_doc  # format/order/config fields are implied
    for n in ("IDENTITY", "MANIFEST", "SHARDS", "COMMIT", "BLOCKS", "EL_CRC", "META_DIR", "TEXT_DIR", "ARRAYS"):
        assert getattr(keys, n) in DOC, n
    assert keys.shard_name(7) == "shard-00007.zarr" and keys.parse_shard_name("shard-00007.zarr") == 7
    assert keys.text_file("prompt") == "text/prompt.jsonl" and "text/<name>.jsonl" in DOC
    for seg in ("prompt", "tokens"):
        assert keys.acts_array(seg) == f"arrays/{seg}_activations"
        assert keys.len_array(seg) == f"arrays/{seg}_len"
    assert keys.shard_stats_file(12) == "meta/stats-000000000012.npz"
    assert "stats-<n>.npz" in DOC and "stats-{:012d}.npz" in DOC
