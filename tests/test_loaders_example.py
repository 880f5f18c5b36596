"""examples/train_sae.py runs as is (writing its own store) and its loss falls;
examples/train_while_capturing.py trains on a store while another process fills it."""

from __future__ import annotations

import re
from pathlib import Path

import forked
import pytest
import torch

import actstore

pytestmark = pytest.mark.slow  # trains a small SAE

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_sae.py"


def test_train_sae_example_loss_falls(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    proc = forked.run(EXAMPLE, "--steps", "150", "--checkpoint", str(ckpt), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    losses = [float(m) for m in re.findall(r"^step +\d+ +epoch \d+ +loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) == 7  # steps 1, 25, 50, ..., 150
    assert losses[-1] < 0.5 * losses[0] and losses[-1] < min(losses[:-1])
    store = actstore.ActStore(tmp_path / "out" / "train_sae-store")
    assert len(store) == 384 and store.stats() is not None
    state = torch.load(ckpt, weights_only=False)["stream"]
    # 150 batches of 1024 over 12,672 tokens (13 batches an epoch): epoch 11, 7 batches in.
    assert (state["epoch"], state["batches_done"]) == (150 // 13, 150 % 13)


def test_train_while_capturing(tmp_path):
    """One process captures (a tiny random Llama, record()), this example's process trains a
    TopK SAE on the same store meanwhile (TokenStream.follow()), on every stored token."""
    # forked with torch imported (tests/forked.py); the capture it starts is a fresh interpreter
    r = forked.run(
        EXAMPLE.parent / "train_while_capturing.py", tmp_path / "twc.store", cwd=EXAMPLE.parents[1], timeout=300
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
