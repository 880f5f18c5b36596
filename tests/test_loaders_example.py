"""examples/train_sae.py runs as is (writing its own store) and its loss falls."""

from __future__ import annotations

import pytest

import re
import subprocess
import sys
from pathlib import Path

import torch

import actstore

pytestmark = pytest.mark.slow  # trains a small SAE

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_sae.py"


def test_train_sae_example_loss_falls(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "150", "--checkpoint", str(ckpt)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    losses = [float(m) for m in re.findall(r"^step +\d+ +epoch \d+ +loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) == 7  # steps 1, 25, 50, ..., 150
    assert losses[-1] < 0.5 * losses[0] and losses[-1] < min(losses[:-1])
    store = actstore.ActStore(tmp_path / "out" / "train_sae-store")
    assert len(store) == 384 and store.stats() is not None
    state = torch.load(ckpt, weights_only=False)["stream"]
    # 150 batches of 1024 over 12,672 tokens (13 batches an epoch): epoch 11, 7 batches in.
    assert (state["epoch"], state["batches_done"]) == (150 // 13, 150 % 13)
