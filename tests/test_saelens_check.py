"""An export-saelens folder records its row count and each data file's size and sha256;
`actstore verify OUT` (verify_saelens_folder) checks them: a file cut at a record-batch
boundary, which `datasets` loads short with no error, a changed byte, a missing or a stray
file are each named with the fix."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.saelens import SaelensFolderError, export_saelens, verify_saelens_folder
from actstore.saelens import export as export_mod


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-layer store exported with small record batches (2 rows) and files (6 rows)."""
    root = tmp_path_factory.mktemp("slc")
    rng = np.random.default_rng(1)
    with actstore.ShardWriter(root / "s.store", layers=[0, 1], d_model=8, tokens=12, model_id="tiny") as w:
        w.append(rng.standard_normal((20, 2, 12, 8)).astype(np.float16))
    actstore.finalize(root / "s.store")
    mp = pytest.MonkeyPatch()
    mp.setattr(export_mod, "BATCH_BYTES", 2 * 8 * 8 * 4)
    mp.setattr(export_mod, "FILE_BYTES", 6 * 8 * 8 * 4)
    try:
        res = export_saelens(root / "s.store", root / "out", layer=1, context_size=8, progress=False)
    finally:
        mp.undo()
    return res


def _copy(res, tmp_path):
    return shutil.copytree(res.path, tmp_path / "out")


def _verify(path):
    return CliRunner().invoke(main, ["verify", str(path)])


def _boundaries(path) -> list[int]:
    """Byte offsets after the schema and after each record batch of an Arrow stream file."""
    out = []
    with pa.OSFile(str(path)) as f:
        reader = pa.ipc.MessageReader.open_stream(f)
        while True:
            try:
                reader.read_next_message()
            except StopIteration:
                return out
            out.append(f.tell())


def test_the_config_records_rows_and_every_files_checksum(exported):
    import hashlib

    cfg = json.loads((exported.path / "saelens_config.json").read_text())
    files = sorted(p.name for p in exported.path.glob("data-*.arrow"))
    assert len(files) == 5 and cfg["n_rows"] == exported.n_rows == 30  # 240 tokens in rows of 8, 6 rows a file
    assert cfg["files"] == [
        {
            "name": f,
            "bytes": (exported.path / f).stat().st_size,
            "sha256": hashlib.sha256((exported.path / f).read_bytes()).hexdigest(),
        }
        for f in files
    ]
    r = _verify(exported.path)
    assert r.exit_code == 0 and r.output == (
        f"verify (saelens export) {exported.path}: 30 rows in 5 data files, "
        f"{sum(d['bytes'] for d in cfg['files'])} bytes read: OK\n"
    )
    rep = verify_saelens_folder(exported.path)
    assert rep.ok and rep.checksums and rep.n_rows == 30
    j = json.loads(CliRunner().invoke(main, ["verify", "--json", str(exported.path)]).stdout)
    assert j["ok"] is True and j["kind"] == "saelens-export" and j["problems"] == []


def test_a_file_cut_at_a_record_batch_boundary_loads_short_in_datasets_and_fails_verify(exported, tmp_path):
    import datasets

    out = _copy(exported, tmp_path)
    last = out / "data-00004-of-00005.arrow"
    cut_at = _boundaries(last)[1]  # the schema and the first record batch (2 of its 6 rows)
    with open(last, "r+b") as f:
        f.truncate(cut_at)
    assert len(datasets.load_from_disk(str(out))) == 26  # short, no error: what this check is for
    r = _verify(out)
    assert r.exit_code == 1
    assert r.output.splitlines()[1:] == [
        f"  {last} has {cut_at} bytes; the export wrote {(exported.path / last.name).stat().st_size}: truncated or overwritten "
        "(copy it again from the source, or export again)",
        "  the data files hold 26 rows; the export wrote 30 (saelens_config.json n_rows): a file was cut or replaced; "
        "datasets would load it short with no error",
    ]
    with pytest.raises(SaelensFolderError, match=r"does not match its export: .*26 rows; the export wrote 30"):
        verify_saelens_folder(out)


def test_a_changed_byte_a_missing_and_a_stray_file_are_named(exported, tmp_path):
    out = _copy(exported, tmp_path)
    f = out / "data-00002-of-00005.arrow"
    data = bytearray(f.read_bytes())
    data[-100] ^= 1  # inside the last batch's values: the rows still add up
    f.write_bytes(bytes(data))
    (out / "data-00003-of-00005.arrow").unlink()
    shutil.copy(out / "data-00000-of-00005.arrow", out / "data-00000-of-00005 (1).arrow")
    problems = verify_saelens_folder(out, raise_on_error=False).problems
    assert (
        problems[0] == "data files not in state.json: ['data-00000-of-00005 (1).arrow'] (datasets would not read them)"
    )
    assert problems[1].startswith(f"{f}: sha256 ") and "differs from the export's" in problems[1]
    assert problems[2] == f"{out / 'data-00003-of-00005.arrow'} is missing (state.json lists it)"
    assert problems[3].startswith("the data files hold 24 rows; the export wrote 30") and len(problems) == 4


def test_an_export_without_checksums_is_checked_for_rows_and_says_so(exported, tmp_path):
    out = _copy(exported, tmp_path)
    cfg = json.loads((out / "saelens_config.json").read_text())
    del cfg["files"]
    (out / "saelens_config.json").write_text(json.dumps(cfg))
    r = _verify(out)
    assert (
        r.exit_code == 0
        and "(no checksums recorded: exported before actstore recorded them; rows and files checked): OK" in r.output
    )
    (out / "state.json").write_text("{")
    r = _verify(out)
    assert r.exit_code == 1 and "is not a readable export-saelens folder" in r.output and "export it again" in r.output


def test_import_saelens_checks_an_export_before_importing_it(exported, tmp_path, s3_url):
    """import-saelens refuses an export that does not match its own record (a file cut at a
    record-batch boundary, a changed byte), locally before anything is written; on an object
    store by its files' sizes; a sound export imports whole."""
    from actstore.importers import SaelensDatasetError, import_saelens
    from actstore.storage import open_storage

    ok = CliRunner().invoke(main, ["import-saelens", str(exported.path), str(tmp_path / "ok.store"), "--quiet"])
    assert ok.exit_code == 0, ok.output
    assert len(actstore.open(tmp_path / "ok.store")) == 30
    cut = _copy(exported, tmp_path)
    last = cut / "data-00004-of-00005.arrow"
    with open(last, "r+b") as f:
        f.truncate(_boundaries(last)[1])
    with pytest.raises(SaelensDatasetError, match=r"does not match its export .*26 rows; the export wrote 30"):
        import_saelens(cut, tmp_path / "cut.store", progress=False)
    assert not (tmp_path / "cut.store").exists()
    changed = shutil.copytree(exported.path, tmp_path / "changed")
    first = changed / "data-00000-of-00005.arrow"
    raw = bytearray(first.read_bytes())
    raw[-20] ^= 0xFF
    first.write_bytes(bytes(raw))
    with pytest.raises(SaelensDatasetError, match=r"data-00000-of-00005.arrow: sha256 .* differs"):
        import_saelens(changed, tmp_path / "changed.store", progress=False)
    remote = open_storage(s3_url + "/cut")
    for p in sorted(cut.iterdir()):
        remote.put(p.name, p.read_bytes())
    with pytest.raises(
        SaelensDatasetError, match=r"data-00004-of-00005.arrow has \d+ bytes; the export wrote \d+ \(copy it again\)"
    ):
        import_saelens(s3_url + "/cut", tmp_path / "cut2.store", progress=False)
