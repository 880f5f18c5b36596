"""The scripts in examples/ run as they are and print what they promise."""

from __future__ import annotations

from pathlib import Path

import forked
import pytest

pytestmark = pytest.mark.slow  # the example scripts end to end

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart(tmp_path):
    r = forked.run(ROOT / "examples" / "quickstart.py", str(tmp_path / "qs"), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "n=80, layers=[2, 6, 11], d_model=64, prompt=32, response=16" in r.stdout
    line = next(l for l in r.stdout.splitlines() if l.startswith("store[5, 6]:"))
    # The printed shape is prompt length + response length of example 5.
    shape = eval(line.split(":", 1)[1].split("float16")[0])  # noqa: S307 - our own output
    lengths = eval(line.split("lengths", 1)[1])  # noqa: S307
    assert shape == (lengths["prompt"] + lengths["response"], 64)
