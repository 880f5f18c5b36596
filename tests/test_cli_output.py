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
        "spool": None,  # no spool (test_spool_tools checks a spool's summary)
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

    path = _saev_ready_store(tmp_path / "s")
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


def test_saev_bars_on_a_pipe_are_whole_lines(tmp_path, monkeypatch):
    """verify-saev and import-saev draw their bars through actstore.progress: into a pipe (the
    runner's stderr is no terminal) whole lines, never a carriage return."""
    monkeypatch.setattr(progress, "PIPE_INTERVAL", 0.0)  # a line at once, as a long run would print
    path = _saev_ready_store(tmp_path / "s")
    actstore.finalize(path)
    r = CliRunner()
    directory = r.invoke(main, ["export-saev", str(path), "-o", str(tmp_path / "saev"), "--quiet"]).output.strip()
    for args, desc in (
        (["verify-saev", directory, "--values"], "verify values:"),
        (["import-saev", directory, str(tmp_path / "imported")], "import saev"),
    ):
        res = r.invoke(main, args)
        assert res.exit_code == 0, res.output
        assert "\r" not in res.stderr, (args, res.stderr)
        lines = [line for line in res.stderr.splitlines() if line.startswith(desc)]
        assert lines and "100%" in lines[-1], (args, res.stderr)


def test_every_bar_goes_through_actstore_progress():
    """No module draws its own tqdm bar or writes a carriage return: actstore.progress decides
    (a live bar on a terminal, plain lines in a pipe). A '\\r' in a string is allowed only as
    what input text is stripped of or split at."""
    import ast
    from pathlib import Path

    src = Path(actstore.__file__).parent
    offenders = []
    for path in sorted(src.rglob("*.py")):
        if path == src / "progress.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        allowed = {
            id(a)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("strip", "rstrip", "lstrip", "split", "splitlines", "replace", "endswith")
            for a in n.args
        }
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
                if any(m.split(".")[0] == "tqdm" for m in names):
                    offenders.append(f"{path.relative_to(src)}:{n.lineno}: imports tqdm")
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and "\r" in n.value and id(n) not in allowed:
                offenders.append(f"{path.relative_to(src)}:{n.lineno}: writes a carriage return")
    assert offenders == [], offenders


def _saev_ready_store(path):
    """An unfinalized store that records what export-saev needs (model, CLS, family, dataset)."""
    with actstore.ShardWriter(
        path,
        layers=[0],
        d_model=4,
        tokens=3,
        model_id="tiny",
        attrs={"cls_token": False, "family": "clip", "dataset": "/d"},
    ) as w:
        w.append(np.ones((4, 1, 3, 4), np.float16))
    return path
