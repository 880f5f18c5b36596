"""The scripts in examples/ run as they are and print what they promise."""

from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # the example scripts end to end

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart(tmp_path):
    r = subprocess.run(
        [sys.executable, "examples/quickstart.py", str(tmp_path / "qs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "n=80, layers=[2, 6, 11], d_model=64, prompt=32, response=16" in r.stdout
    line = next(l for l in r.stdout.splitlines() if l.startswith("store[5, 6]:"))
    # The printed shape is prompt length + response length of example 5.
    shape = eval(line.split(":", 1)[1].split("float16")[0])  # noqa: S307 - our own output
    lengths = eval(line.split("lengths", 1)[1])  # noqa: S307
    assert shape == (lengths["prompt"] + lengths["response"], 64)


def test_train_while_capturing(tmp_path):
    """One process captures (a tiny random Llama, record()), this example's process trains a
    TopK SAE on the same store meanwhile (TokenStream(follow=True)), on every stored token."""
    r = subprocess.run(
        [sys.executable, "examples/train_while_capturing.py", str(tmp_path / "twc.store")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    trained = next(l for l in r.stdout.splitlines() if l.startswith("trained "))
    final = next(l for l in r.stdout.splitlines() if l.startswith("the finalized store holds "))
    steps, seen, early = (int(trained.split()[i]) for i in (1, 4, 6))
    stored = int(final.split()[6])
    assert seen == stored > 2000 and steps == -(-stored // 64)  # every stored token once, in batches of 64
    assert early >= steps // 2  # most steps ran while the capture was still writing
    first, last = (float(v) for v in final.split("loss ")[1].split(" -> "))
    assert last < first
