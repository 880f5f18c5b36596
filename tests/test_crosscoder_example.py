"""examples/train_crosscoder.py runs as is (writing its own two stores), its loss falls, and
a run stopped mid-epoch and resumed from its checkpoint ends exactly where the
uninterrupted run ends (the same batches, in step across the two stores)."""

from __future__ import annotations

import re
from pathlib import Path

import forked
import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # an example script end to end, three runs (as test_examples.py)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_crosscoder.py"


def _run(cwd, *args):
    proc = forked.run(EXAMPLE, *args, cwd=cwd, timeout=300)  # forked with torch imported (tests/forked.py)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_crosscoder_example_learns_and_resumes_exactly(tmp_path):
    full = _run(tmp_path, "--steps", "60")
    losses = [float(m) for m in re.findall(r"^step +\d+ +epoch \d+ +loss ([0-9.]+)", full, re.M)]
    assert len(losses) == 4 and losses[-1] < 0.6 * losses[0]  # steps 1, 25, 50, 60
    head = _run(tmp_path, "--steps", "60", "--stop-after", "37", "--checkpoint", "ck.pt")
    assert "saved ck.pt at step 37" in head
    tail = _run(tmp_path, "--steps", "60", "--resume", "ck.pt")
    final = re.search(r"final loss ([0-9.]+)", full).group(1)
    assert re.search(r"final loss ([0-9.]+)", tail).group(1) == final
