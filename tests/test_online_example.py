"""examples/online_sae.py: SmolLM2 captured into a spool of a third of the capture while two
consumers train SAEs on two layers; every captured token reaches each once, and the
activation files on disk never pass the budget plus one block."""

from __future__ import annotations

import re
from pathlib import Path

import forked
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # the embedded SmolLM2, end to end

ROOT = Path(__file__).resolve().parents[1]


def test_online_sae(tmp_path):
    # forked with torch imported (tests/forked.py): the threads, the spool and the model are the script's own
    r = forked.run(ROOT / "examples" / "online_sae.py", tmp_path / "osae.store", "--texts", "24", cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    tokens = int(re.search(r"^captured (\d+) tokens of layers \[8, 16\]", out, re.M).group(1))
    high, budget, block = (
        int(v) for v in re.search(r"high-water: (\d+) bytes .*budget (\d+) bytes \+ one block of (\d+)", out).groups()
    )
    assert 0 < high <= budget + block and tokens * 2 * 576 * 2 > 2 * budget  # more captured than the spool holds
    for layer in (8, 16):
        seen, steps, first, last = re.search(
            rf"^sae-l{layer}: (\d+) tokens in (\d+) steps, loss ([\d.]+) -> ([\d.]+)", out, re.M
        ).groups()
        assert int(seen) == tokens and int(steps) == -(-tokens // 128) and float(last) < float(first)
