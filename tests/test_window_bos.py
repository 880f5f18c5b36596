"""Every --pack / --chunk window starts with the tokenizer's BOS (its EOS as the stand-in
when it has no BOS), labelled special, so the attention-sink position is a special token
and not content (issue 23 item 5); --no-window-bos opts out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from capture_support import SENTENCES, tiny_llama, write_jsonl
from factory import cli
from tokenizers import processors

import actstore
from actstore.capture import token_origins
from actstore.inputs.packing import doc_tokens, plan_windows
from actstore.loaders.tokens import TokenStream

DOCS = [" ".join(SENTENCES[i % len(SENTENCES)] for i in range(k, k + 1 + k % 3)) for k in range(6)]


def _no_bos(tok):
    """The tiny tokenizer made to add no BOS to a text (like the embedded SmolLM2's)."""
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    return tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("m")
    model, tok = tiny_llama(layers=2)
    model.save_pretrained(root / "bos")
    tok.save_pretrained(root / "bos")
    model.save_pretrained(root / "nobos")
    _no_bos(tok).save_pretrained(root / "nobos")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("c") / "c.jsonl", [{"text": d} for d in DOCS])


@pytest.mark.parametrize("mode", ["--pack", "--chunk"])
def test_every_window_starts_with_bos_labelled_special(tmp_path, models, corpus, mode):
    model, tok = tiny_llama(layers=2)
    tok = _no_bos(tok)
    assert tok("a b")["input_ids"][0] != tok.bos_token_id  # the tokenizer adds none
    out = tmp_path / "s"
    cli("write", out, "--model", models / "nobos", "--data", corpus, "--layers", "0", mode, "--context", "8", "--quiet")
    store = actstore.ActStore(out)
    corpus_ids = [doc_tokens(tok, d) for d in DOCS]
    stored = []
    for i in range(len(store)):
        ids = store.token_ids(i).tolist()
        labels = store.field("tokens_token_labels")[i, : len(ids)].tolist()
        assert ids[0] == tok.bos_token_id and labels[0] == 1  # special, so token_mask="content" leaves it out
        assert tok.bos_token_id not in ids[1:] and len(ids) <= 8
        origins = token_origins(store, i)
        assert origins[0].tolist() == [-1, 0] and len(origins) == len(ids)
        assert [corpus_ids[d][p] for d, p in origins[1:]] == ids[1:]
        stored += ids[1:]
        with torch.inference_mode():  # the model saw the BOS too
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0].numpy()
        np.testing.assert_allclose(store[i, 0].astype(np.float32), hs, rtol=2e-3, atol=2e-3)
    assert stored == [t for ids in corpus_ids for t in ids]  # every corpus token once, in order
    packing = store.config.attrs["packing"]
    assert packing["window_bos"] == tok.bos_token_id and packing["tokens"] == len(stored)
    content = TokenStream(store, batch_size=4, token_mask="content", return_index=True, shuffle=False)
    assert 0 not in torch.cat([b["token"] for b in content]).tolist()


def test_a_tokenizer_that_adds_bos_gets_one_per_window_not_two(tmp_path, models, corpus):
    _, tok = tiny_llama(layers=2)
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        models / "bos",
        "--data",
        corpus,
        "--layers",
        "0",
        "--pack",
        "--context",
        "8",
        "--quiet",
    )
    store = actstore.ActStore(out)
    flat = [t for d in DOCS for t in doc_tokens(tok, d) if t != tok.bos_token_id]
    got = []
    for i in range(len(store)):
        ids = store.token_ids(i).tolist()
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        got += ids[1:]
    assert got == flat


def test_no_window_bos_keeps_the_plain_stream(tmp_path, models, corpus):
    _, tok = tiny_llama(layers=2)
    tok = _no_bos(tok)
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        models / "nobos",
        "--data",
        corpus,
        "--layers",
        "0",
        "--pack",
        "--context",
        "8",
        "--no-window-bos",
        "--quiet",
    )
    store = actstore.ActStore(out)
    flat = [t for d in DOCS for t in doc_tokens(tok, d)]
    assert np.concatenate([store.token_ids(i) for i in range(len(store))]).tolist() == flat
    assert store.config.attrs["packing"]["window_bos"] is None and store.token_ids(1)[0] != tok.bos_token_id


def test_the_window_planner_counts_the_bos_in_the_context():
    _, tok = tiny_llama(layers=2)
    src = actstore.inputs.data.Source(
        kind="text", name="t", n=len(DOCS), get=lambda i: {"key": f"d{i}", "text": DOCS[i]}
    )
    n = sum(len(doc_tokens(tok, d)) - 1 for d in DOCS)  # each document's own BOS gives way to the window's
    win = plan_windows(src, tok, 8, "pack", window_bos=True)
    assert len(win) == -(-n // 7) and win.n_tokens == n
    assert all(win.runs(w)[0] == (-1, 0, 1) and sum(r[2] for r in win.runs(w)) <= 8 for w in range(len(win)))
    with pytest.raises(actstore.errors.CaptureError, match=r"--context 1 leaves no room after each window's BOS"):
        plan_windows(src, tok, 1, "pack", window_bos=True)
