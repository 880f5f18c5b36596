"""The default mask, one rule for every reader (issue 23 item 5): a text store whose labels
mark token kinds is read as its content tokens (label 0) only, so the BOS that starts every
--pack/--chunk window (labelled special: an attention-sink outlier) is left out of the
loaders (TokenStream, PairDataset, aligned streams), the exports (saev, SAELens) and the
capture's statistics unless asked for (token_mask="all", --keep-special). Image stores,
whose labels are classes, are read whole as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.loaders.pairs import PairDataset, PairIndex
from actstore.loaders.tokens import TokenStream
from actstore.read.masks import default_token_mask, leaves_out_special
from factory import text_store, vit_store
from test_capture_support import SENTENCES, save_llama, write_jsonl

DOCS = [" ".join(SENTENCES[(k + j) % len(SENTENCES)] for j in range(1 + k % 3)) for k in range(6)]


def cli(*args, ok=True):
    res = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert res.exit_code == 0, res.output + repr(res.exception)
    return res


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A --pack capture of a tiny LLM (two layers, statistics on): every window starts with a BOS labelled 1."""
    root = tmp_path_factory.mktemp("packed")
    model = save_llama(root / "llama", layers=3)
    corpus = write_jsonl(root / "c.jsonl", [{"text": d} for d in DOCS])
    cli(
        "write",
        root / "s",
        "--model",
        model,
        "--data",
        corpus,
        "--layers",
        "0,2",
        "--pack",
        "--context",
        "8",
        "--quiet",
    )
    store = actstore.ActStore(root / "s")
    labels = store.field("tokens_token_labels")
    assert all(labels[i, 0] == 1 for i in range(len(store)))  # the window BOS, special
    return store


def _real(store, layer):
    """(vectors, is_content, token position, example) of every real token of `layer`, store order."""
    labels, lens = store.field("tokens_token_labels"), store.field("tokens_len")
    x = np.concatenate([store[i, layer][: lens[i]].astype(np.float32) for i in range(len(store))])
    content = np.concatenate([labels[i, : lens[i]] == 0 for i in range(len(store))])
    pos = np.concatenate([np.arange(lens[i]) for i in range(len(store))])
    ex = np.concatenate([np.full(lens[i], i) for i in range(len(store))])
    return x, content, pos, ex


def _rows(a: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in np.ascontiguousarray(a, np.float32)}


def test_the_rule(packed, tmp_path):
    assert leaves_out_special(packed) and default_token_mask(packed) == "content"
    prs = text_store(tmp_path / "pairs")  # a prompt/response store whose labels are classes (ShardWriter)
    assert not leaves_out_special(prs) and default_token_mask(prs) is None
    kinds = text_store(tmp_path / "kinds", kinds=True)  # ... whose writer said they are token kinds
    assert leaves_out_special(kinds) and kinds.config.token_label_names == {0: "content", 1: "special", 2: "template"}
    assert not leaves_out_special(text_store(tmp_path / "nolabels", labels=False))
    vit = vit_store(tmp_path / "vit")  # labels are classes
    assert not leaves_out_special(vit) and default_token_mask(vit) is None


def test_token_stream_epoch_leaves_out_window_bos(packed):
    x, content, pos, ex = _real(packed, 0)
    got = list(TokenStream(packed, batch_size=5, layers=[0], shuffle=False, return_index=True))
    tokens = torch.cat([b["token"] for b in got]).numpy()
    assert 0 not in tokens.tolist() and len(tokens) == int(content.sum()) < len(x)
    np.testing.assert_array_equal(torch.cat([b["acts"] for b in got]).float().numpy(), x[content])
    every = list(TokenStream(packed, batch_size=5, layers=[0], shuffle=False, return_index=True, token_mask="all"))
    assert torch.cat([b["token"] for b in every]).numpy().tolist() == pos.tolist()
    assert len(TokenStream(packed, batch_size=5, token_mask=None)) == len(
        TokenStream(packed, batch_size=5, token_mask="all")
    )
    shuffled = torch.cat(list(TokenStream(packed, batch_size=4, layers=[0], seed=1)))
    assert _rows(shuffled.float().numpy()) == _rows(x[content])  # the outliers never reach training


def test_aligned_streams_leave_out_window_bos(packed):
    x0, content, _, _ = _real(packed, 0)
    pairs = list(TokenStream(packed, aligned=True, batch_size=5, layers=[0, 2], shuffle=False))
    a = torch.cat([p[0] for p in pairs]).float().numpy()
    np.testing.assert_array_equal(a, x0[content])
    every = list(TokenStream(packed, aligned=True, batch_size=5, layers=[0, 2], shuffle=False, token_mask="all"))
    assert sum(len(p[0]) for p in every) == len(x0)


def test_pair_dataset_mask_leaves_out_window_bos(packed):
    exs = np.arange(len(packed))
    idx = PairIndex(exs, np.zeros((len(exs), 1), np.int64))
    labels, lens = packed.field("tokens_token_labels"), packed.field("tokens_len")
    within = np.arange(labels.shape[1])[None, :] < lens[:, None]
    mask = PairDataset(packed, return_mask=True)[idx]["mask"].numpy()
    assert not mask[:, 0].any()
    np.testing.assert_array_equal(mask, within & (labels == 0))
    every = PairDataset(packed, return_mask=True, token_mask="all")[idx]["mask"].numpy()
    assert every[:, 0].all()
    np.testing.assert_array_equal(every, within)


def test_statistics_and_standardize_cover_content_tokens(packed):
    st = packed.stats()
    for layer in (0, 2):
        x, content, _, _ = _real(packed, layer)
        k = st.keys.index(f"layer{layer}/tokens")
        assert int(st.count[k]) == int(content.sum())
        np.testing.assert_allclose(st.mean[k], x[content].astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            st.norm_sum[k], np.linalg.norm(x[content].astype(np.float64), axis=1).sum(), rtol=1e-5
        )
    z = (
        torch.cat(list(TokenStream(packed, batch_size=8, layers=[0], normalize="standardize")))
        .numpy()
        .astype(np.float64)
    )
    np.testing.assert_allclose(z.mean(axis=0), 0, atol=1e-3)  # the statistics match what the stream serves
    np.testing.assert_allclose(z.std(axis=0), 1, atol=1e-2)


def test_export_saev_leaves_out_window_bos(packed, tmp_path):
    x, content, pos, ex = _real(packed, 0)
    out = cli(
        "export-saev", packed.path, tmp_path / "a" / "saev" / "shards", "--family", "clip", "--layers", "0", "--quiet"
    ).output.split()[-1]
    cli("verify-saev", out)
    sv = actstore.open(out)
    assert len(sv) == int(content.sum())
    np.testing.assert_array_equal(np.concatenate([sv[i, 0] for i in range(len(sv))]), x[content])
    assert "special_tokens" in str(json.loads((sv.path / "metadata.json").read_text())["data"])  # and in the hash
    offsets = np.fromfile(sv.path / "example_offsets.bin", "<i8")
    assert np.diff(offsets).tolist() == np.bincount(ex[content], minlength=len(packed)).tolist()
    out2 = cli(
        "export-saev",
        packed.path,
        tmp_path / "b" / "saev" / "shards",
        "--family",
        "clip",
        "--layers",
        "0",
        "--keep-special",
        "--quiet",
    ).output.split()[-1]
    cli("verify-saev", out2)
    sv2 = actstore.open(out2)
    assert len(sv2) == len(x) and sv2.path.name != sv.path.name
    np.testing.assert_array_equal(np.concatenate([sv2[i, 0] for i in range(len(sv2))]), x)
    np.testing.assert_array_equal(
        np.fromfile(sv2.path / "labels.bin", np.uint8), packed.field("tokens_token_labels")[ex, pos]
    )


def test_export_saelens_leaves_out_window_bos(packed, tmp_path):
    import datasets

    x, content, pos, ex = _real(packed, 2)
    bos = int(packed.token_ids(0)[0])
    hook = "blocks.2.hook_resid_post"

    def read(folder):
        ds = datasets.load_from_disk(str(folder))
        ids = np.asarray(ds["token_ids"]).reshape(-1)
        acts = np.asarray(ds[hook], np.float32).reshape(-1, packed.d_model)
        return ids, acts[ids >= 0]

    cli("export-saelens", packed.path, tmp_path / "lens", "--layer", hook, "--context-size", "4", "--quiet")
    ids, acts = read(tmp_path / "lens")
    assert bos not in ids.tolist() and int((ids >= 0).sum()) == int(content.sum())
    assert _rows(acts) == _rows(x[content])
    cli(
        "export-saelens",
        packed.path,
        tmp_path / "all",
        "--layer",
        hook,
        "--context-size",
        "4",
        "--keep-special",
        "--quiet",
    )
    ids, acts = read(tmp_path / "all")
    assert ids.tolist().count(bos) == len(packed) and int((ids >= 0).sum()) == len(x)
    assert _rows(acts) == _rows(x)


def test_vit_stores_are_read_whole(tmp_path):
    store = vit_store(tmp_path / "vit", n=4, tokens=5)  # labels 0..19 are classes, not a mask
    n = len(store) * 5 * len(store.layers)
    assert TokenStream(store, batch_size=4).n_tokens == TokenStream(store, batch_size=4, token_mask="all").n_tokens == n
    mask = PairDataset(store, return_mask=True)[PairIndex(np.arange(4), np.full((4, 1), 2))]["mask"].numpy()
    assert mask.all()
    out = cli("export-saev", store.path, tmp_path / "saev" / "shards", "--quiet").output.split()[-1]
    assert len(actstore.open(out)) == 4 and "special_tokens" not in str(
        json.loads((actstore.open(out).path / "metadata.json").read_text())["data"]
    )
