"""A full disk or another OS error during an export (saev, SAELens, legacy pkl) names the
file being written and the fix, publishes nothing, and leaves no partial files behind
(pkl: an unfinished export that a rerun replaces). Real limits come from RLIMIT_FSIZE in
the CLI's process (EFBIG, the file-size limit a full disk behaves like); ENOSPC and EIO
are raised by a stand-in for the gathered write (storage.durable.write_all)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import forked
import numpy as np
import pytest

import actstore
from actstore.errors import DiskFullError, ExportWriteError
from actstore.saev import export_saev
from actstore.saev import pipeline as saev_pipeline

pytestmark = pytest.mark.torch  # export-saelens streams through torch's TokenStream

REPO = Path(__file__).resolve().parent.parent
LIMIT = 64 * 1024  # bytes a file of the exporting process may reach


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("oserr") / "s.store"
    rng = np.random.default_rng(0)
    with actstore.ShardWriter(
        path,
        layers=[0, 1],
        d_model=32,
        tokens=17,
        model_id="facebook/dinov2-small",
        attrs={"cls_token": True, "dataset": "/d"},
    ) as w:
        w.append(rng.standard_normal((40, 2, 17, 32)).astype(np.float16))  # 40 x 2 x 17 x 32 x 4 = 170 KB in float32
    actstore.finalize(path)
    return path


def _cli_limited(*args) -> subprocess.CompletedProcess:
    """`actstore ARGS` in a process of its own (forked: tests/forked.py) whose files may not grow past LIMIT bytes."""
    return forked.run_cli(*args, fsize=LIMIT, cwd=REPO, timeout=300)


def test_export_saev_past_a_file_size_limit_names_the_file_and_the_fix(store, tmp_path):
    dump = tmp_path / "dump"
    r = _cli_limited("export-saev", store, "--out", dump, "--quiet", "--protocol", "2.0")
    assert r.returncode == 1 and r.stdout == ""
    (target,) = [p for p in dump.iterdir()] or [None]  # the <HASH> directory is not there
    assert target is None
    line = r.stderr.strip()
    assert line.startswith(f"actstore: error: exporting {store} to saev: File too large writing {dump}/."), line
    assert "/acts000000.bin: a file-size limit (ulimit -f) was reached. Nothing was published to " in line
    assert (
        line.endswith(
            "and the partial files were removed; free space there (or export elsewhere), then rerun "
            "the same export-saev command"
        )
        and len(r.stderr.splitlines()) == 1
    )


def test_export_saelens_past_a_file_size_limit_names_the_file_and_the_fix(store, tmp_path):
    out = tmp_path / "sl"
    r = _cli_limited("export-saelens", store, "--out", out, "--layer", "1", "--context-size", "16", "--quiet")
    assert r.returncode == 1 and not out.exists() and list(tmp_path.iterdir()) == []
    line = r.stderr.strip()
    assert line.startswith(
        f"actstore: error: exporting {store} for SAELens: File too large writing {tmp_path}/.sl.staging-"
    ), line
    assert line.endswith(
        f"/part-00000.arrow: a file-size limit (ulimit -f) was reached. Nothing was published to {out} and "
        "the partial files were removed; free space there (or export elsewhere), then rerun the same "
        "export-saelens command"
    )


def test_export_pkl_past_a_file_size_limit_names_the_file_and_what_is_left(store, tmp_path):
    out = tmp_path / "pkl"
    r = _cli_limited("export-pkl", store, "--out", out, "--no-compress", "--quiet")
    assert r.returncode == 1 and not (out / "metadata.json").exists()
    line = r.stderr.strip()
    assert line.startswith(f"actstore: error: exporting {store} to pkl: File too large writing {out}/shard_0001.pkl"), (
        line
    )
    assert line.endswith(
        f": a file-size limit (ulimit -f) was reached. {out} holds an unfinished export (no metadata.json), "
        "which no reader takes for a complete one; free space there (or export elsewhere), then rerun the "
        "same export-pkl command (it replaces the unfinished export)"
    )


@pytest.mark.parametrize(
    ("err", "kind", "says"),
    [
        (errno.ENOSPC, DiskFullError, ": the disk or quota is full. Nothing was published to "),
        (
            errno.EIO,
            ExportWriteError,
            "; the disk reported an I/O error: check the device (dmesg, its health), then export again",
        ),
    ],
)
def test_export_saev_on_a_full_or_failing_disk(store, tmp_path, monkeypatch, err, kind, says):
    calls, real = [0], saev_pipeline.write_all

    def write_all(fd, parts):  # the one gathered write fails after its first call (a full disk, a bad sector)
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(err, os.strerror(err))
        return real(fd, parts)

    monkeypatch.setattr(saev_pipeline, "write_all", write_all)
    with pytest.raises(kind) as e:
        export_saev(store, tmp_path / "dump", protocol="2.0", progress=False, batch_bytes=4096)
    msg = str(e.value)
    assert msg.startswith(f"exporting {store} to saev: {os.strerror(err)} writing {tmp_path}/dump/.") and says in msg
    assert e.value.errno == err and e.value.filename.endswith("/acts000000.bin")
    assert list((tmp_path / "dump").iterdir()) == []  # nothing published, the temporary directory removed
