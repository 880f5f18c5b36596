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
from capture_support import SENTENCES, save_llama, write_jsonl
from click.testing import CliRunner
from factory import cli, text_store, vit_store

import actstore
from actstore.cli import main
from actstore.loaders.pairs import PairDataset, PairIndex
from actstore.loaders.tokens import TokenStream
from actstore.read.masks import default_token_mask, leaves_out_special

DOCS = [" ".join(SENTENCES[(k + j) % len(SENTENCES)] for j in range(1 + k % 3)) for k in range(6)]


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
    pairs = list(TokenStream.aligned(packed, batch_size=5, layers=[0, 2], shuffle=False))
    a = torch.cat([p[0] for p in pairs]).float().numpy()
    np.testing.assert_array_equal(a, x0[content])
    every = list(TokenStream.aligned(packed, batch_size=5, layers=[0, 2], shuffle=False, token_mask="all"))
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


# ---- labels are data unless the store says otherwise (issue 35) ---------------------------
def _classes_store(path, zarr_format):
    """19 prompt/response examples whose labels 0..9 are a probing data set's classes (ShardWriter,
    no token_label_names): the issue's store, of which a saev export kept 15 of 169 real tokens."""
    rng = np.random.default_rng(5)
    n = 19
    with actstore.ShardWriter(
        path,
        layers=[0, 1],
        d_model=4,
        segments={"prompt": 8, "response": 6},
        token_labels=True,
        stats=True,
        zarr_format=zarr_format,
        model_id="probe/model",
        attrs={"dataset": "/data/probe"},
    ) as w:
        w.append(
            prompt=rng.standard_normal((n, 2, 8, 4)).astype(np.float16),
            response=rng.standard_normal((n, 2, 6, 4)).astype(np.float16),
            lengths={"prompt": rng.integers(1, 9, n), "response": rng.integers(0, 7, n)},
            token_labels={"prompt": rng.integers(0, 10, (n, 8)), "response": rng.integers(0, 10, (n, 6))},
        )
    actstore.finalize(path)
    return actstore.ActStore(path)


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_class_labels_are_data_every_consumer_reads_every_real_token(tmp_path, zarr_format):
    store = _classes_store(tmp_path / "s", zarr_format)
    lens = {s: store.field(f"{s}_len") for s in store.segments}
    real = int(sum(v.sum() for v in lens.values()))
    labels = store.field("prompt_token_labels")
    assert store.config.token_label_names is None and (labels > 0).any() and (labels == 0).any()
    assert default_token_mask(store) is None and not leaves_out_special(store)
    assert TokenStream(store, batch_size=8, layers=[0]).n_tokens == real
    idx = PairIndex(np.arange(len(store)), np.zeros((len(store), 1), np.int64))
    mask = PairDataset(store, return_mask=True)[idx]["mask"].numpy()
    within = np.concatenate(
        [np.arange(store.config.segment(s).t_max)[None, :] < lens[s][:, None] for s in store.segments], axis=1
    )
    np.testing.assert_array_equal(mask, within)
    st = store.stats()
    assert sum(int(st.count[st.keys.index(f"layer0/{s}")]) for s in store.segments) == real
    out = cli(
        "export-saev",
        store.path,
        tmp_path / "e" / "saev" / "shards",
        "--family",
        "clip",
        "--layers",
        "0",
        "--quiet",
    ).output.split()[-1]
    assert len(actstore.open(out)) == real  # the export kept label 0 only: 15 of 169
    info = json.loads(cli("info", store.path, "--json").output)
    assert info["mask"] == {
        "keeps": "every real token (its token labels are classes: data, not a mask)",
        "tokens": real,
        "left_out": 0,
    }
    assert (
        f"mask         every real token (its token labels are classes: data, not a mask): all {real:,} real tokens"
        in (cli("info", store.path).output)
    )


def test_a_writer_that_says_its_labels_are_token_kinds_gets_the_content_mask(tmp_path):
    kinds = {0: "content", 1: "special", 2: "template"}
    with actstore.ShardWriter(
        tmp_path / "s", layers=[3], d_model=4, tokens=6, token_labels=True, token_label_names=kinds, stats=True
    ) as w:
        w.append(np.ones((5, 1, 6, 4), np.float16), token_labels=np.tile([1, 0, 0, 2, 0, 0], (5, 1)))
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    doc = json.loads((tmp_path / "s" / "actstore.json").read_text())
    assert doc["config"]["token_labels"] == {
        "meaning": "kinds",
        "names": {"0": "content", "1": "special", "2": "template"},
    }
    assert store.config.token_label_names == kinds and default_token_mask(store) == "content"
    assert TokenStream(store, batch_size=4).n_tokens == 5 * 4
    assert store.stats().count.tolist() == [20]
    info = json.loads(cli("info", store.path, "--json").output)
    assert info["mask"] == {
        "keeps": "content tokens, label 0 (its labels are token kinds: 0 content, 1 special, 2 template)",
        "tokens": 30,
        "left_out": 10,
    }
    assert "leaves out 10 of 30 real tokens (33.3%)" in info["mask_line"]


@pytest.mark.parametrize(
    "names,says",
    [
        ({1: "special"}, "must name label 0"),
        ({0: ""}, "names of 1..64 characters"),
        ({256: "x", 0: "content"}, "labels 0..255"),
        ({True: "x"}, "labels 0..255"),
    ],
)
def test_token_label_names_are_checked(tmp_path, names, says):
    with pytest.raises(ValueError, match=says):
        actstore.ShardWriter(
            tmp_path / "s", layers=[0], d_model=4, tokens=3, token_labels=True, token_label_names=names
        )
    with pytest.raises(ValueError, match="pass token_labels=True too"):
        actstore.ShardWriter(tmp_path / "t", layers=[0], d_model=4, tokens=3, token_label_names={0: "content"})
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


def _as_written_before(root):
    """Rewrite a store's configuration as versions before the meaning was recorded wrote it:
    `token_labels: true` (actstore.json, manifest.json, each shard's group attributes)."""
    from pathlib import Path

    def plain(cfg):
        if isinstance(cfg.get("token_labels"), dict):
            cfg["token_labels"] = True

    root = Path(root)
    for p in [root / "actstore.json", root / "manifest.json"]:
        doc = json.loads(p.read_text())
        plain(doc["config"])
        p.write_text(json.dumps(doc))
    for p in root.glob("shards/*/zarr.json"):
        doc = json.loads(p.read_text())
        plain(doc["attributes"]["actstore"]["config"])
        p.write_text(json.dumps(doc))


def test_a_capture_made_store_written_before_reads_as_token_kinds(packed, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(packed.path, old)
    _as_written_before(old)
    assert json.loads((old / "manifest.json").read_text())["config"]["token_labels"] is True
    assert json.loads((old / "manifest.json").read_text())["config"]["attrs"]["token_labels"]["0"] == "content"
    store = actstore.ActStore(old)
    assert store.config.token_label_names == {0: "content", 1: "special", 2: "template"}
    assert default_token_mask(store) == "content"
    x, content, _, _ = _real(store, 0)
    assert TokenStream(store, batch_size=5, layers=[0]).n_tokens == int(content.sum()) < len(x)
    from actstore.verify import verify_store

    assert verify_store(old).ok  # the config of every copy still agrees


def test_the_commands_say_which_tokens_the_mask_keeps(packed, tmp_path):
    res = CliRunner().invoke(
        main,
        ["export-saev", str(packed.path), str(tmp_path / "a" / "saev" / "shards"), "--family", "clip", "--layers", "0"],
    )
    assert res.exit_code == 0, res.output
    x, content, _, _ = _real(packed, 0)
    left = len(x) - int(content.sum())
    assert (
        f"default mask: content tokens, label 0 (its labels are token kinds: 0 content, 1 special, 2 template): leaves out {left:,} of {len(x):,} real tokens"
        in res.stderr
    )
    every = CliRunner().invoke(
        main,
        [
            "export-saev",
            str(packed.path),
            str(tmp_path / "b" / "saev" / "shards"),
            "--family",
            "clip",
            "--layers",
            "0",
            "--keep-special",
        ],
    )
    assert (
        every.exit_code == 0 and "mask: every real token (asked for: the default mask, content tokens" in every.stderr
    )
    assert f"would leave out {left:,} of {len(x):,} real tokens)" in every.stderr
