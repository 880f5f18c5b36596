"""Feature views end to end on a store captured from a real shipped model (MiniLM over
Python's pydoc topics): the pass, the site's decoded windows with the store's recorded
tokenizer (tokenizer files only), and the embedded SmolLM2's tokenizer from its GGUF."""

from __future__ import annotations

import html
import re

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.features.views.context import load_tokenizer

pytestmark = pytest.mark.slow


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def test_minilm_store_features_and_site(tmp_path, request):
    from browser import _browser, _chromium, screenshot, site_record
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
        "--quiet",
    )
    top = pd.read_parquet(tmp_path / "feats" / "top.parquet")
    labels = store.field("tokens_token_labels")
    assert (labels[top.example, top.token] == 0).all()  # [CLS] / [SEP] are left out by default
    _cli("view", tmp_path / "feats", "--out", tmp_path / "site", "--quiet")
    tok = AutoTokenizer.from_pretrained(minilm_folder())
    row = top[(top.feature == 7) & (top["rank"] == 0)].iloc[0]
    tid = int(store.token_ids(int(row.example))[int(row.token)])
    word = tok.decode([tid])
    rec = site_record(tmp_path / "site", 7)
    assert rec["rows"]["ex"][0] == int(row.example) and rec["rows"]["act"][0] == float(row.activation)
    assert rec["keys"][rec["rows"]["doc"][0]] == store.sample(int(row.example))["sample_key"]  # the document's key
    exe = _chromium()
    page = _browser(
        exe,
        tmp_path / "prof",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url=(tmp_path / "site" / "feature.html").as_uri() + "#7",
    )
    fired = re.findall(
        r'class="tk fire[^"]*" style="background:rgba\(255,110,0,1.00\)" title="([^"]*)">([^<]*)</span>', page
    )
    # the token that fired, its piece of the window's decoded text (a WordPiece decode puts a space before a word)
    assert (f"{float(row.activation):.4g} · id {tid}", word) in [(t, html.unescape(w).strip()) for t, w in fired]
    site = (tmp_path / "site").as_uri()
    screenshot(exe, tmp_path / "prof", site + "/index.html", "features-index.png", request, size="1280,900")
    screenshot(exe, tmp_path / "prof", site + "/feature.html#7", "feature-page.png", request, size="1280,1500")


def test_smollm2_tokenizer_from_its_gguf():
    class Store:
        meta = {"model_id": "embedded:smollm2-135m (SmolLM2-135M-Instruct Q4_1)"}

    tok = load_tokenizer(Store())
    ids = tok("The activation store")["input_ids"]
    assert "".join(tok.decode([i]) for i in ids).strip() == "The activation store"
    assert np.all(np.asarray(ids) < tok.vocab_size + len(tok.get_added_vocab()))


def test_unembedding_auto_from_the_embedded_smollm2():
    """--unembedding auto for a store of the embedded SmolLM2: its tied embeddings (GGUF,
    dequantised) times the final RMSNorm's weight, (d_model, vocab)."""
    import gguf
    from gguf.quants import dequantize

    from actstore.features.views.logits import load_unembedding
    from actstore.inputs.embedded import SMOLLM2_GGUF, smollm2_folder

    class Store:
        meta = {"model_id": "embedded:smollm2-135m (SmolLM2-135M-Instruct Q4_1)"}
        path = "s"

    U = load_unembedding("auto", 576, Store())
    tensors = {t.name: t for t in gguf.GGUFReader(str(smollm2_folder() / SMOLLM2_GGUF)).tensors}
    emb = dequantize(tensors["token_embd.weight"].data, tensors["token_embd.weight"].tensor_type)
    gamma = np.asarray(tensors["output_norm.weight"].data, np.float32)
    assert U.W.shape == (576, 49152) and U.norm == "rms"
    np.testing.assert_allclose(U.W[:, :100], emb[:100].T * gamma[:, None], rtol=1e-6)


def test_dinov2_store_vision_site(tmp_path, request):
    """The demo's store (DINOv2-S/14 over the embedded images): a feature page draws every
    image of its rows on a canvas, each image written once, named by its sample key."""
    from browser import _browser, _chromium, screenshot, site_record

    out = tmp_path / "vit"
    _cli("write", out, "--model", "embedded:dinov2-s14", "--data", "embedded:images", "--layers", "11", "--quiet")
    store = actstore.open(out)
    _cli(
        "features",
        out,
        "--layer",
        "11",
        "--neurons",
        "--features",
        "0-15",
        "--top-k",
        "12",
        "--out",
        tmp_path / "f",
        "--quiet",
    )
    _cli("view", tmp_path / "f", "--out", tmp_path / "site", "--quiet")
    site = tmp_path / "site"
    top = pd.read_parquet(tmp_path / "f" / "top.parquet")
    shown = set(top.example) | set(pd.read_parquet(tmp_path / "f" / "intervals.parquet").example)
    assert len(list((site / "img").rglob("*.jpg"))) == len(shown)  # the 21 images hold 21 references: one file each
    keys = store.field("sample_key")
    rec = site_record(site, 6)
    assert [name for _, name in rec["images"]] == [str(keys[e]) for e in sorted(set(rec["rows"]["ex"]))]
    exe = _chromium()
    url = (site / "feature.html").as_uri() + "#6"
    page = _browser(
        exe, tmp_path / "prof", "--window-size=1280,1600", "--virtual-time-budget=8000", "--dump-dom", url=url
    )
    n = page.count('<canvas class="heat"')
    assert n == len(set(zip(rec["rows"]["g"], rec["rows"]["im"])))  # a card per image of each group
    assert f'data-drawn="{n}"' in page and page.count('data-drawn="1"') == n
    name = str(keys[rec["rows"]["ex"][0]])
    assert f">{name}</b>" in page
    screenshot(exe, tmp_path / "prof", url, "feature-page-vision.png", request, size="1280,1500")
