"""Token chunks sized to the measured lengths (docs/spec-answers.md): `actstore write`
chunks a text or prompt segment whose budget it measured by the smallest power of two >=
the median length, so most reads touch one chunk holding little padding; the store still
equals the model's hidden states, and a resume keeps the store's chunks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from capture_support import WORDS, save_llama, tiny_llama, write_jsonl
from click.testing import CliRunner

import actstore
from actstore.capture.target import CaptureTarget
from actstore.cli import main
from actstore.errors import StoreMismatchError
from actstore.inputs.budgets import MIN_T_CHUNK, measured_t_chunk
from actstore.write import ShardWriter


def cli(*args) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


@pytest.mark.parametrize(
    ("lengths", "budget", "want"),
    [
        ([75, 60, 90], 224, 128),  # median 75 -> 128 (the matrix's best for prompts of median 75)
        ([128, 128, 200], 500, 128),  # a power of two is kept
        ([129, 129, 3], 500, 256),
        ([3, 5, 9], 9, 9),  # at most the budget
        ([3, 5, 9], 100, MIN_T_CHUNK),
        ([300] * 5, 256, 256),
    ],
)
def test_measured_t_chunk(lengths, budget, want):
    assert measured_t_chunk(lengths, budget) == want


def prompts(n: int, seed: int = 0) -> list[dict]:
    """Prompts of 10 to 80 words (so the median needs several 16-token chunks)."""
    rng = np.random.default_rng(seed)
    return [
        {"prompt": " ".join(rng.choice(WORDS, int(k))), "response": "paris is the capital ."}
        for k in rng.integers(10, 80, n)
    ]


def test_write_chunks_prompts_by_their_median_length_and_resume_keeps_them(tmp_path):
    model_dir = save_llama(tmp_path / "llama", layers=2)
    data = write_jsonl(tmp_path / "p.jsonl", prompts(12))
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        model_dir,
        "--data",
        data,
        "--layers",
        "0,1",
        "--batch-size",
        "4",
        "--max-examples",
        "8",
        "--quiet",
    )
    store = actstore.ActStore(out)
    segs = store.meta["segments"]
    lens = [store.lengths(i)["prompt"] for i in range(8)]  # the budget is their max (quantile 0.99 of 8): none was cut
    p_max = max(lens)
    assert segs["prompt"]["t_max"] == p_max and segs["prompt"]["t_chunk"] == measured_t_chunk(lens, p_max) < p_max
    assert segs["response"]["t_chunk"] == segs["response"]["t_max"]
    model, _ = tiny_llama(layers=2)
    for i in range(8):
        p = store.lengths(i)["prompt"]
        ids = store.token_ids(i).tolist()
        with torch.inference_mode():
            hs = (
                model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0].numpy()
            )  # layer 0 (the last one is normed)
        got = store.segment("prompt")[i, 0].astype(np.float32)
        assert got.shape == (p, hs.shape[1]) and np.abs(got - hs[:p]).max() <= 2e-3 * max(1.0, np.abs(hs[:p]).max())
    assert sum(n > segs["prompt"]["t_chunk"] for n in lens) >= 2  # prompts spanning several chunks were read back
    # A resume takes budgets and chunks from the store, and reopens shards with them.
    assert CaptureTarget(out).stored_budgets() == (
        p_max,
        segs["response"]["t_max"],
        segs["prompt"]["t_chunk"],
    )
    cfg = CaptureTarget(out).identity()  # what a resume that has nothing left to capture reopens the shard with
    kw = {"config": cfg, "stats": True}
    other = dataclasses.replace(cfg, segments=tuple(dataclasses.replace(s, t_chunk=s.t_max) for s in cfg.segments))
    with pytest.raises(StoreMismatchError, match="t_chunk"):  # the store's chunks are part of its identity
        ShardWriter(out, shard=1, config=other, stats=True)
    ShardWriter(out, shard=1, **kw).close()
    assert actstore.ActStore(out).meta["segments"] == segs
    fixed = tmp_path / "f"
    cli("write", fixed, "--model", model_dir, "--data", data, "--layers", "0", "--p-max", "70", "--quiet")
    assert (
        actstore.ActStore(fixed).meta["segments"]["prompt"]["t_chunk"] == 70
    )  # a given budget: the writer's default chunks
