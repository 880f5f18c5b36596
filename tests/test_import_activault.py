"""import-activault: megabatches written the way Activault's HookUploader writes them
(torch.save of {"states", "input_ids", "tensor_bytes"}, metadata.json from _get_metadata
plus bytes_per_file, statistics.json from save_stats), local and on moto's S3; values and
token ids exact; parallel, resumable, verified; a clear error for each kind of damage."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from import_sources import ACTIVAULT_HOOK as HOOK
from import_sources import check_store, write_hook

from actstore.cli import main
from actstore.errors import CorruptStoreError, StoreMismatchError
from actstore.importers import ActivaultFormatError, driver, import_activault
from actstore.storage import open_storage


def test_local_hook_folder_exact_and_metadata_kept(tmp_path):
    files = write_hook(tmp_path)
    rep = import_activault(tmp_path / "run" / HOOK, tmp_path / "store", progress=False, workers=2)
    st = check_store(tmp_path / "store", files)
    assert (rep.n_parts, rep.n_written, rep.n_examples, rep.n_tokens) == (3, 3, 12, 60)
    assert list(st.layers) == [3] and st.dtype == "bfloat16" and st.d_model == 8
    a = st.config.attrs["activault"]
    assert a["hook"] == HOOK and a["metadata"]["batches_per_file"] == 2 and a["statistics"]["norm"] == 2.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_run_folder_with_hook_and_other_dtypes_via_cli(tmp_path, dtype):
    files = write_hook(tmp_path, dtype=dtype, n_files=2)
    write_hook(tmp_path, hook="models.layers.7.attn", n_files=1, seed=3)
    res = CliRunner().invoke(
        main,
        [
            "import-activault",
            str(tmp_path / "run"),
            str(tmp_path / "s"),
            "--hook",
            HOOK,
            "--quiet",
            "--zarr-format",
            "3",
            "--layer",
            "11",
        ],
    )
    assert res.exit_code == 0, res.output
    check_store(tmp_path / "s", files, layer=11)
    res = CliRunner().invoke(main, ["import-activault", str(tmp_path / "run"), str(tmp_path / "t"), "--quiet"])
    assert res.exit_code == 1
    assert (
        "has no metadata.json: it is a run folder: pass --hook-name NAME, one of ['models.layers.3.mlp.post', 'models.layers.7.attn']"
        in res.output
    )


def test_from_s3(tmp_path, s3_url):
    files = write_hook(s3_url, n_files=2)
    import_activault(f"{s3_url}/run", tmp_path / "s", hook=HOOK, progress=False)
    check_store(tmp_path / "s", files)


def test_resumes_after_a_failure_mid_part_and_continues_exactly(tmp_path, monkeypatch):
    files = write_hook(tmp_path, n_files=3, batch_size=4, batches_per_file=2)
    from actstore.importers.activault import ActivaultSource

    real = ActivaultSource.read
    monkeypatch.setattr("actstore.importers.activault.BATCH_BYTES", 5 * 8 * 2)  # one example per batch

    def dying(self, part, start):
        for k, b in enumerate(real(self, part, start)):
            if part.key == sorted(files)[1] and k == 5:
                raise KeyboardInterrupt("killed")
            yield b

    monkeypatch.setattr(ActivaultSource, "read", dying)
    with pytest.raises(KeyboardInterrupt):
        import_activault(tmp_path / "run" / HOOK, tmp_path / "s", progress=False, workers=1, commit_bytes=1)
    monkeypatch.setattr(ActivaultSource, "read", real)
    starts = []
    monkeypatch.setattr(
        ActivaultSource,
        "read",
        lambda self, part, start: (starts.append((part.key, start)), real(self, part, start))[1],
    )
    rep = import_activault(tmp_path / "run" / HOOK, tmp_path / "s", progress=False, workers=2)
    assert (rep.n_skipped, rep.n_resumed, rep.n_written) == (1, 1, 1)
    assert sorted(starts) == sorted([(sorted(files)[1], 5), (sorted(files)[2], 0)])
    check_store(tmp_path / "s", files)


def test_a_store_of_another_source_is_refused(tmp_path):
    write_hook(tmp_path, n_files=1)
    import_activault(tmp_path / "run" / HOOK, tmp_path / "s", progress=False)
    write_hook(tmp_path / "other", n_files=1, seed=4)
    with pytest.raises(
        StoreMismatchError, match="already holds shard 0, not imported from .* import into a new store path"
    ):
        import_activault(tmp_path / "other" / "run" / HOOK, tmp_path / "s", progress=False)


def _hook_dir(tmp_path, **kw):
    files = write_hook(tmp_path, **kw)
    return tmp_path / "run" / HOOK, sorted(files)


def test_truncated_megabatch_named_before_reading(tmp_path):
    d, names = _hook_dir(tmp_path)
    p = d / names[1]
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(ActivaultFormatError) as e:
        import_activault(d, tmp_path / "s", progress=False)
    size = p.stat().st_size
    assert (
        str(e.value) == f"{p} has {size} bytes; metadata.json says bytes_per_file {size + 100} (truncated or replaced?)"
    )
    assert not (tmp_path / "s").exists()  # refused before anything was written


def test_truncated_megabatch_without_bytes_per_file_fails_in_torch_load_naming_the_file(tmp_path):
    d, names = _hook_dir(tmp_path)
    md = json.loads((d / "metadata.json").read_text())
    del md["bytes_per_file"]
    (d / "metadata.json").write_text(json.dumps(md))
    p = d / names[0]
    p.write_bytes(p.read_bytes()[:-400])
    with pytest.raises(ActivaultFormatError, match=rf"^{p} cannot be read by torch.load: truncated or damaged"):
        import_activault(d, tmp_path / "s", progress=False)


def test_shapes_that_disagree_with_metadata(tmp_path):
    d, names = _hook_dir(tmp_path)
    md = json.loads((d / "metadata.json").read_text())
    with pytest.raises(
        ActivaultFormatError,
        match=r"metadata.json: shape \[2, 5, 9\] disagrees with batch_size, sequence_length, d_in = \[2, 5, 8\]",
    ):
        (d / "metadata.json").write_text(json.dumps({**md, "shape": [2, 5, 9]}))
        import_activault(d, tmp_path / "s", progress=False)
    # metadata says d_in 100000: the files are far too small for it, refused before any is loaded
    del md["bytes_per_file"]
    (d / "metadata.json").write_text(json.dumps({**md, "d_in": 100_000, "shape": [2, 5, 100_000]}))
    size = (d / names[0]).stat().st_size
    with pytest.raises(ActivaultFormatError) as e:
        import_activault(d, tmp_path / "s", progress=False)
    assert str(e.value) == (
        f"{d / names[0]} has {size} bytes; metadata.json's shapes (4 x 5 x 100000 torch.bfloat16) need "
        f"4000080..{4_000_160 + 2**20}: the file is truncated or not of this hook"
    )
    # metadata says d_in 4: within the size slack, so the megabatch is mapped and its shape refused
    (d / "metadata.json").write_text(json.dumps({**md, "d_in": 4, "shape": [2, 5, 4]}))
    with pytest.raises(
        ActivaultFormatError,
        match=r"states is torch.bfloat16 \(4, 5, 8\); metadata.json says torch.bfloat16 \(4, 5, 4\)",
    ):
        import_activault(d, tmp_path / "s", progress=False)


def test_megabatch_of_other_shape_than_metadata(tmp_path):
    d, names = _hook_dir(tmp_path)
    md = json.loads((d / "metadata.json").read_text())
    del md["bytes_per_file"]
    (d / "metadata.json").write_text(
        json.dumps({**md, "sequence_length": 4, "shape": [2, 4, 8], "input_ids_shape": [2, 4]})
    )
    # 4 x 4 x 8 bf16 = 256 bytes of states: the 5-token files are within the slack, so torch.load runs and the shape check refuses
    with pytest.raises(
        ActivaultFormatError,
        match=r"states is torch.bfloat16 \(4, 5, 8\); metadata.json says torch.bfloat16 \(4, 4, 8\)",
    ):
        import_activault(d, tmp_path / "s", progress=False)


class Evil:
    def __reduce__(self):
        return (print, ("owned",))


def test_a_pickle_that_is_not_weights_only_is_refused(tmp_path):
    d, names = _hook_dir(tmp_path, n_files=1)
    buf = io.BytesIO()
    states = torch.zeros(4, 5, 8, dtype=torch.bfloat16)
    torch.save({"states": states, "input_ids": torch.zeros(4, 5, dtype=torch.int64), "tensor_bytes": Evil()}, buf)
    md = json.loads((d / "metadata.json").read_text())
    (d / names[0]).write_bytes(buf.getvalue())
    (d / "metadata.json").write_text(json.dumps({**md, "bytes_per_file": len(buf.getvalue())}))
    with pytest.raises(
        ActivaultFormatError,
        match=rf"^{d / names[0]} is not a weights-only torch file: its pickle builds objects other than tensors",
    ):
        import_activault(d, tmp_path / "s", progress=False)


def test_foreign_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metadata.json").write_text("[1, 2]")
    with pytest.raises(ActivaultFormatError, match=r"metadata.json must be a JSON object. Got list."):
        import_activault(tmp_path / "x", tmp_path / "s", progress=False)
    (tmp_path / "x" / "metadata.json").write_text("{nope")
    with pytest.raises(ActivaultFormatError, match=r"metadata.json is not valid JSON"):
        import_activault(tmp_path / "x", tmp_path / "s", progress=False)


def test_verification_catches_a_store_that_does_not_hold_the_source(tmp_path, monkeypatch):
    d, _ = _hook_dir(tmp_path, n_files=2)
    monkeypatch.setattr(driver, "_checksum", lambda *a: 12345)
    with pytest.raises(
        driver.ImportVerifyError, match=r"example 0 \(the first of .*\) does not hold the bytes read from the source"
    ):
        import_activault(d, tmp_path / "s", progress=False)


KILL_SCRIPT = """
import sys, time
from actstore.importers import activault, import_activault
real = activault.ActivaultSource.read
activault.BATCH_BYTES = 5 * 8 * 2  # one example per batch
def slow(self, part, start):
    for b in real(self, part, start):
        time.sleep(0.05)
        yield b
activault.ActivaultSource.read = slow
import_activault(sys.argv[1], sys.argv[2], progress=False, workers=2, commit_bytes=1)
"""


def test_sigkill_mid_import_then_rerun_continues_exactly(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from actstore import catalog

    files = write_hook(tmp_path, n_files=3, batch_size=8, batches_per_file=2)
    d, store = tmp_path / "run" / HOOK, tmp_path / "s"
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root + "/src", root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(d), str(store)], env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill once a shard has committed some, not all, of its 16 examples
            st = open_storage(store)
            try:  # (a shard's folder appears a moment before its first commit record)
                committed = catalog.read_commit(catalog.shard_storage(st, 0)).n_committed
            except CorruptStoreError:
                committed = 0
            if 3 <= committed < 16:
                break
            assert proc.poll() is None, "the import ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (store / "manifest.json").exists()  # nothing published
    rep = import_activault(d, store, progress=False)
    assert rep.n_resumed >= 1 and rep.n_resumed + rep.n_written + rep.n_skipped == 3
    check_store(store, files)
