"""What commands print: one JSON summary with --json, and progress that does not flood a pipe
(plain periodic lines instead of carriage-return redraws when stderr is not a terminal)."""

from __future__ import annotations

import io
import json
import time

import numpy as np
from click.testing import CliRunner

import actstore
from actstore import progress
from actstore.cli import main


def test_progress_on_a_pipe_is_periodic_whole_lines(monkeypatch):
    monkeypatch.setattr(progress, "PIPE_INTERVAL", 0.05)
    out = io.StringIO()  # not a terminal
    with progress.bar(total=6, desc="work", unit="ex", file=out) as b:
        for _ in range(6):
            time.sleep(0.03)
            b.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 2 <= len(lines) <= 6 and all(line.startswith("work:") for line in lines)
    assert lines[-1].startswith("work: 100%") and "6/6" in lines[-1]

    quick = io.StringIO()
    monkeypatch.setattr(progress, "PIPE_INTERVAL", 30.0)
    with progress.bar(total=3, desc="quick", file=quick) as b:
        b.update(3)
    assert quick.getvalue() == ""  # work shorter than the interval prints nothing


def test_finalize_and_export_saev_print_one_json_summary(tmp_path):
    path = tmp_path / "s"
    with actstore.ShardWriter(path, shard=0, layers=[0], d_model=4, tokens=3, world_size=2) as w:
        w.append(np.ones((5, 1, 3, 4), np.float16))
    r = CliRunner()
    res = r.invoke(main, ["finalize", str(path), "--allow-partial", "--json"])
    assert res.exit_code == 0
    assert json.loads(res.stdout) == {
        "store": str(path),
        "examples": 5,
        "shards": [0],
        "world_size": 2,
        "partial": {"missing_ranks": [1], "incomplete_shards": []},
    }
    assert r.invoke(main, ["finalize", str(path), "--allow-partial", "--quiet"]).output == ""
    res = r.invoke(
        main,
        [
            "export-saev",
            str(path),
            "--out",
            str(tmp_path / "dump"),
            "--cls",
            "none",
            "--family",
            "clip",
            "--dataset",
            "/data",
            "--ckpt",
            "tiny",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["examples"] == 5 and summary["protocol"] == "2.0" and not summary["reused"]
    assert summary["path"] == str(tmp_path / "dump" / summary["hash"])


def test_quiet_commands_print_nothing_on_success(tmp_path):
    """--quiet on every command: nothing on success (write keeps its summary line for job logs,
    export-saev the directory it made, verify the problems it finds)."""
    from actstore.cli import bench

    path = tmp_path / "s"
    with actstore.ShardWriter(
        path,
        layers=[0],
        d_model=4,
        tokens=3,
        model_id="tiny",
        attrs={"cls_token": False, "family": "clip", "dataset": "/d"},
    ) as w:
        w.append(np.ones((4, 1, 3, 4), np.float16))
    r = CliRunner()
    saev_root = tmp_path / "saev" / "shards"
    runs = [
        ["finalize", path],
        ["info", path],
        ["verify", path],
        ["verify", "--deep", path],
        ["cp", path, tmp_path / "copy"],
        ["export-pkl", path, "--out", tmp_path / "pkl"],
        ["import-pkl", tmp_path / "pkl", tmp_path / "from-pkl"],
    ]  # (export-saelens, which needs torch: tests/test_saelens.py)
    for args in runs:
        res = r.invoke(main, [*map(str, args), "--quiet"])
        assert (res.exit_code, res.output) == (0, ""), (args, res.output)
    res = r.invoke(main, ["export-saev", str(path), "-o", str(saev_root), "--quiet"])
    assert res.exit_code == 0 and res.output == f"{saev_root / res.output.strip().rsplit('/', 1)[-1]}\n"
    directory = res.output.strip()
    for args in (
        ["verify-saev", directory],
        ["import-saev", directory, tmp_path / "imported"],
        ["link-run", tmp_path / "runs" / "saev" / "runs" / "r", "--train-shards", directory],
    ):
        res = r.invoke(main, [*map(str, args), "--quiet"])
        assert (res.exit_code, res.output) == (0, ""), (args, res.output)
    (path / "stray.tmp").write_bytes(b"x")  # a warning: --quiet --strict still says why it fails
    res = r.invoke(main, ["verify", str(path), "--quiet", "--strict"])
    assert res.exit_code == 1 and "stray.tmp" in res.output
    assert "--quiet" in r.invoke(main, ["bench", "--help"]).output and bench.available()


def test_io_errors_are_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    res = CliRunner().invoke(
        main, ["export-pkl", str(_tiny_store(tmp_path / "s")), "--out", str(tmp_path / "file" / "out")]
    )
    assert (
        res.exit_code == 1 and res.output.startswith("actstore: error: ") and len(res.output.strip().splitlines()) == 1
    ), res.output


def _tiny_store(path):
    with actstore.ShardWriter(path, layers=[0], d_model=4, tokens=3) as w:
        w.append(np.ones((2, 1, 3, 4), np.float16))
    actstore.finalize(path)
    return path
