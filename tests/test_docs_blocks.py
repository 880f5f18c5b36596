"""Every python and bash code block in docs/*.md runs, as written, in a fresh folder.

A document's blocks run in order: python blocks in one namespace (a fragment may use what
an earlier block defined), bash blocks as `bash -e` scripts with this tree's `actstore` on
the PATH. A document may hold a setup in an HTML comment (`<!-- docs-test setup: ... -->`,
python): the store or files its fragments assume (`path`, `ex`, `acts.store`, ...), made
before its first block. Blocks talking to S3 run against moto's server (its endpoint and
credentials in the environment, as docs/remote.md sets them). A bash block whose commands
fail on purpose says so: `<!-- docs-test: exit codes 1 0 ... -->` (one per command line).

A block that cannot run here is marked on the line before it, `<!-- docs-test: not run:
REASON -->`, with one of the few REASONS below; the test fails on an unmarked block that
does not run and on a marked one whose reason is not listed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from factory import cli
from watchdog import within

pytestmark = pytest.mark.torch  # the capture commands of docs/ need torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
REASONS = {
    "signature": "a call signature (every argument with its default), not a call",
    "cluster": "needs a Slurm, torchrun or Ray cluster with GPUs and a model from the Hugging Face Hub",
    "provider": "needs a cloud provider's endpoint and credentials (MinIO at a fixed port, R2, GCS)",
    "benchmark": "a benchmark: minutes of measurement on a quiet machine (benchmarks/, `actstore bench`)",
    "cuda": "needs a CUDA device",
    "hub": "downloads a model from the Hugging Face Hub (tests have no network)",
    "paths": "sets SAEV_SCRATCH and SAEV_NFS to the example's /scratch and /nfs folders",
}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- docs-test: (not run: (\w+)|exit codes ([\d ]+)) -->\s*$")
SETUP = re.compile(r"<!-- docs-test setup:\n(.*?)-->", re.S)
BLOCK_LIMIT_S = 300.0


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    not_run: str | None
    exit_codes: list[int] | None

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} ({self.lang})"


def blocks(doc: Path) -> list[Block]:
    text = SETUP.sub("", doc.read_text())  # a setup is not a block of the document
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) not in ("python", "bash"):
            continue  # output, trees and diagrams
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        line = doc.read_text().count("\n", 0, doc.read_text().find(m.group(0))) + 1
        out.append(
            Block(
                doc.name,
                line,
                m.group(1),
                m.group(2),
                mark and mark.group(2),
                [int(c) for c in mark.group(3).split()] if mark and mark.group(3) else None,
            )
        )
    return out


def test_every_block_runs_or_is_marked_with_a_known_reason():
    marked = [(str(b), b.not_run) for d in DOCS for b in blocks(d) if b.not_run]
    unknown = [(b, r) for b, r in marked if r not in REASONS]
    assert not unknown, f"blocks marked with reasons not in REASONS: {unknown}"
    n = sum(len(blocks(d)) for d in DOCS)
    print(f"\n{n} python/bash blocks in docs/: {n - len(marked)} run, {len(marked)} not run: {marked}")
    assert (
        len(marked) <= 17
    )  # a new exclusion needs a reason above and a place in this budget (17th: the Hub push of export.md)


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["SAEV_SCRATCH"] = str(tmp / "scratch")
    env["HF_HUB_OFFLINE"] = "1"
    return env


SHELL = re.compile(r"[|&;<>`*?]|\$\(")  # pipes, lists, redirections, substitutions, globs: bash's work
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def _commands(code: str) -> list[str]:
    """A bash block's command lines: continuations joined, blank and comment lines left out."""
    lines = code.replace("\\\n", " ").splitlines()
    return [c for c in lines if c.strip() and not c.lstrip().startswith("#")]


def _in_process(command: str) -> list[str] | None:
    """`actstore ARGS` as click gets it from bash ($VARS expanded, quotes and comments as the
    shell reads them), or None for a line that needs the shell."""
    argv = shlex.split(os.path.expandvars(command), comments=True)
    if SHELL.search(QUOTED.sub("", command).split("#", 1)[0]) or not argv or argv[0] != "actstore":
        return None
    return argv[1:]


def _run_bash(b: Block, tmp: Path) -> None:
    """A bash block, line by line as `bash -e` runs it: a plain `actstore ...` line through
    click's runner in this process (the CLI is what the docs show, not the interpreter's start:
    each fresh one imports torch), any other line in bash."""
    commands = _commands(b.code)
    wants = b.exit_codes or [0] * len(commands)
    assert len(commands) == len(wants), f"{b}: {len(commands)} commands, {len(wants)} exit codes marked"
    env = _env(tmp)
    for command, want in zip(commands, wants):
        argv = _in_process(command)
        if argv is not None:
            res = cli(*argv, ok=False)
            code, out, err = res.exit_code, res.stdout, res.stderr
            crashed = res.exception is not None and not isinstance(res.exception, SystemExit)
            trace = "".join(traceback.format_exception(res.exception)) if crashed else ""
        else:
            r = subprocess.run(
                ["bash", "-c", command], cwd=tmp, env=env, capture_output=True, text=True, timeout=BLOCK_LIMIT_S
            )
            code, out, err = r.returncode, r.stdout, r.stderr
            trace = err if "Traceback" in err else ""
        assert code == want, (
            f"{b}: `{command}` exited {code}, the doc says {want}:\n{out[-2000:]}\n{err[-3000:]}{trace}"
        )
        assert not trace, f"{b}: `{command}` printed a traceback:\n{trace}"


SLOW_DOCS = {"capture.md", "export.md"}  # they run real captures and exports: marked slow


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(d.name, marks=[pytest.mark.slow] if d.name in SLOW_DOCS else [])
        for d in DOCS
        if any(not b.not_run for b in blocks(d))
    ],
)
def test_blocks_of_each_document_run(doc, tmp_path, monkeypatch, request):
    path = ROOT / "docs" / doc
    setup = SETUP.search(path.read_text())
    namespace: dict = {"__name__": "__docs__"}
    if "s3://" in "".join(b.code for b in blocks(path) if not b.not_run):
        namespace["S3_ENDPOINT"] = request.getfixturevalue("s3_endpoint")  # moto, its variables in os.environ
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.syspath_prepend(str(ROOT / "src"))
    if setup:
        exec(compile(setup.group(1), f"{doc} (setup)", "exec"), namespace)  # noqa: S102 - the docs' own setup
    for b in blocks(path):
        if b.not_run:
            continue
        with within(BLOCK_LIMIT_S, str(b)):
            if b.lang == "python":
                exec(compile(b.code, str(b), "exec"), namespace)  # noqa: S102 - the docs' own code
            else:
                _run_bash(b, tmp_path)


def test_marks_are_parsed():
    marked = {b.not_run for b in blocks(ROOT / "docs" / "distributed.md")}
    assert marked == {"cluster", None}
    assert [b.exit_codes for b in blocks(ROOT / "docs" / "distributed.md") if b.exit_codes] == [[1, 0, 0, 1]]


def test_every_example_script_runs_in_a_test():
    """Each examples/*.py is run by some test (test_examples.py, test_loaders_example.py, ...)."""
    sources = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py") if p.name != Path(__file__).name)
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert scripts
    assert [s for s in scripts if f'"{s}"' not in sources and f"examples/{s}" not in sources] == []
