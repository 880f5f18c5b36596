"""Feature views end to end on a store captured from a real shipped model (MiniLM over
Python's pydoc topics): the pass, the site's decoded windows with the store's recorded
tokenizer (tokenizer files only), and the embedded SmolLM2's tokenizer from its GGUF."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.features.context import load_tokenizer

pytestmark = pytest.mark.slow


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def test_minilm_store_features_and_site(tmp_path):
    from transformers import AutoTokenizer

    from actstore.inputs.embedded import minilm_folder

    out = tmp_path / "bert"
    _cli(
        "write",
        out,
        "--model",
        "embedded:minilm-l6",
        "--data",
        "embedded:pydoc-topics",
        "--layers",
        "5",
        "--max-examples",
        "4",
        "--p-max",
        "48",
        "--quiet",
    )
    store = actstore.open(out)
    assert store.token_ids(0) is not None and store.meta["model_id"].startswith("embedded:minilm-l6")
    _cli(
        "features",
        out,
        "--layer",
        "5",
        "--neurons",
        "--features",
        "0-31",
        "--top-k",
        "3",
        "--out",
        tmp_path / "feats",
        "--no-progress",
    )
    top = pd.read_parquet(tmp_path / "feats" / "top.parquet")
    labels = store.field("tokens_token_labels")
    assert (labels[top.example, top.token] == 0).all()  # [CLS] / [SEP] are left out by default
    _cli("view", tmp_path / "feats", "--out", tmp_path / "site", "--no-progress")
    tok = AutoTokenizer.from_pretrained(minilm_folder())
    row = top[(top.feature == 7) & (top["rank"] == 0)].iloc[0]
    word = tok.decode([int(store.token_ids(int(row.example))[int(row.token)])])
    page = (tmp_path / "site" / "f" / "7.html").read_text()
    assert (
        f'class="top" style="background: rgba(255,110,0,1.00)" title="{float(row.activation):.4g}">{html.escape(word)}</span>'
        in page
    )


def test_smollm2_tokenizer_from_its_gguf():
    class Store:
        meta = {"model_id": "embedded:smollm2-135m (SmolLM2-135M-Instruct Q4_1)"}

    tok = load_tokenizer(Store())
    ids = tok("The activation store")["input_ids"]
    assert "".join(tok.decode([i]) for i in ids).strip() == "The activation store"
    assert np.all(np.asarray(ids) < tok.vocab_size + len(tok.get_added_vocab()))
