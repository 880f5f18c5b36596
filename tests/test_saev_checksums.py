"""A saev export's checksum sidecar (actstore_checksums.json): every file as written,
padding included; `verify-saev --values` and `import-saev` find a zeroed range inside an
acts file that every size rule passes; a directory without the sidecar (saev's own, an
older export) is read, verified and imported as before; the sidecar changes nothing a
saev reader opens (metadata, hash, shards.json, acts files)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from factory import vit_store

import actstore
from actstore.cli import main
from actstore.layout import saevspec as P
from actstore.saev import SaevFormatError, export_saev, import_saev, verify_saev
from actstore.saev.checksums import file_crc


@pytest.fixture
def exported(tmp_path):
    store = vit_store(tmp_path / "s", n=7)  # 3 examples per shard: 3, 3, 1 (the last padded)
    res = export_saev(store, tmp_path / "d" / "saev" / "shards", patches_per_shard=3 * 2 * 5, progress=False)
    for p in [res.path, *res.path.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return store, res


def test_the_sidecar_records_every_file_as_written_padding_included(exported):
    _, res = exported
    doc = json.loads((res.path / P.CHECKSUMS_FILE).read_text())
    names = sorted(p.name for p in res.path.iterdir() if p.name.endswith(".bin"))
    assert doc["algorithm"] == "crc32c" and sorted(doc["files"]) == names == [
        "acts000000.bin",
        "acts000001.bin",
        "acts000002.bin",
        "labels.bin",
    ]
    for name in names:
        data = (res.path / name).read_bytes()
        assert doc["files"][name] == {"bytes": len(data), "crc32c": file_crc(res.path / name)["crc32c"]}
    last = (res.path / "acts000002.bin").read_bytes()
    assert len(last) == len((res.path / "acts000000.bin").read_bytes()) and not any(
        last[len(last) // 3 :]
    )  # 1 of 3 examples, zeros after
    assert doc["files"]["acts000002.bin"]["crc32c"] != file_crc(res.path / "acts000000.bin")["crc32c"]


def test_a_zeroed_range_passes_size_rules_but_not_values_or_import(exported, tmp_path):
    store, res = exported
    acts = res.path / "acts000001.bin"
    with open(acts, "r+b") as f:
        f.seek(200)
        f.write(bytes(64))  # 16 values of example 4 zeroed: same size, still finite
    assert verify_saev(res.path).problems == []  # the protocol's rules cannot see it
    probs = verify_saev(res.path, values=True).problems
    assert (
        len(probs) == 1
        and probs[0].startswith("acts000001.bin: crc32c ")
        and probs[0].endswith("its bytes changed after the export (copy it again, or export again)")
    )
    r = CliRunner().invoke(main, ["verify-saev", "--values", str(res.path)])
    assert r.exit_code == 1 and r.stdout.splitlines() == probs
    with pytest.raises(
        SaevFormatError,
        match=rf"^{res.path} does not match its checksums \(actstore_checksums.json\): acts000001.bin: crc32c ",
    ):
        import_saev(res.path, tmp_path / "imported", progress=False)
    assert not (tmp_path / "imported" / "manifest.json").exists()  # nothing copied
    r = CliRunner().invoke(main, ["import-saev", str(res.path), str(tmp_path / "imported2")])
    assert r.exit_code == 1 and "acts000001.bin: crc32c" in r.stderr


def test_without_the_sidecar_a_directory_reads_verifies_and_imports_as_before(exported, tmp_path):
    store, res = exported
    with_sidecar = actstore.open(res.path)
    rows = [with_sidecar[ex, layer] for ex in range(7) for layer in store.layers]
    (res.path / P.CHECKSUMS_FILE).unlink()
    assert verify_saev(res.path, values=True).problems == []
    back = import_saev(res.path, tmp_path / "imported", progress=False)
    for ex in range(7):
        for k, layer in enumerate(store.layers):
            np.testing.assert_array_equal(back[ex, layer], store[ex, layer].astype(np.float32))
            np.testing.assert_array_equal(rows[ex * len(store.layers) + k], back[ex, layer])


def test_the_sidecar_changes_nothing_a_saev_reader_opens(tmp_path):
    """saev's loaders open metadata.json, shards.json, the acts files shards.json names and
    labels.bin, under a directory named by the metadata's hash (docs/export.md): all of
    these are byte for byte what they were before the sidecar existed, so saev ignores
    the extra file as it ignores example_offsets.bin."""
    store = vit_store(tmp_path / "s", n=7)
    res = export_saev(store, tmp_path / "d" / "saev" / "shards", patches_per_shard=3 * 2 * 5, progress=False)
    files = sorted(p.name for p in res.path.iterdir())
    assert files == [
        "acts000000.bin",
        "acts000001.bin",
        "acts000002.bin",
        P.CHECKSUMS_FILE,
        "labels.bin",
        "metadata.json",
        "shards.json",
    ]
    md = json.loads((res.path / "metadata.json").read_text())
    assert (
        res.path.name == P.metadata_hash(md, res.protocol)
        and P.CHECKSUMS_FILE not in (res.path / "shards.json").read_text()
    )
    assert list(md) == list(P.FIELDS[res.protocol])  # no new metadata key (saev's loader rejects unknown keys)
