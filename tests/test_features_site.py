"""`actstore features` and `actstore view` end to end on a text store: the files are read by
pandas and pyarrow, the context windows decode the store's token ids with the tokenizer the
store records, and the site renders in a real headless browser (Debian's chromium), which
shows the top example's decoded text; a screenshot is kept among the test's outputs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from browser import _browser, _chromium, screenshot, site_record
from click.testing import CliRunner
from factory import WORD_D, WORDS, image_store, word_tokenizer

import actstore
from actstore.cli import main
from actstore.features import FeatureError, TokenizerNotFoundError
from actstore.features.views.context import load_tokenizer, text_windows
from actstore.features.views.site import build_site

D = WORD_D


def test_features_cli_writes_tables_any_reader_opens(text_store, tmp_path):
    path, _ = text_store
    out = tmp_path / "feat"
    res = CliRunner().invoke(
        main, ["features", str(path), "--layer", "4", "--neurons", "--top-k", "3", "--out", str(out), "--quiet"]
    )
    assert res.exit_code == 0, res.output
    top = pd.read_parquet(out / "top.parquet")
    assert [str(t) for t in top.dtypes] == ["int32", "int8", "int32", "int64", "int32", "float32"]
    assert list(top.columns) == ["feature", "sign", "rank", "example", "token", "activation"]
    z = top[top.feature == 0]
    # the two zebras (example 8 = shard 1's row 3, then example 2), then the 0.02 tokens, earliest first
    assert list(z.example[:2]) == [9, 2] and list(z.token[:2]) == [5, 5] and list(z["rank"]) == [0, 1, 2]
    assert z.activation.iloc[0] == np.float32(np.float16(6.0 + 0.01 * ((len(WORDS) - 1) % 3)))
    assert (top.activation < 40).all()  # the BOS rows (label 1) never enter
    feats = pd.read_parquet(out / "features.parquet")
    assert len(feats) == D and feats.n_tokens.iloc[0] == 12 * 8
    meta = json.loads((out / "meta.json").read_text())
    assert meta["layer"] == 4 and meta["encoder"]["kind"] == "neurons" and meta["masks"]["token_mask"] == "content"
    assert len(meta["store"]["sha256"]) == 64 and meta["command"].startswith("actstore features")
    first = (out / "top.parquet").read_bytes()
    CliRunner().invoke(
        main, ["features", str(path), "--layer", "4", "--neurons", "--top-k", "3", "--out", str(out), "--quiet"]
    )
    assert (out / "top.parquet").read_bytes() == first  # the same command gives the same files


def test_context_windows_decode_the_stored_ids(text_store):
    path, _ = text_store
    store = actstore.open(path)
    tok = load_tokenizer(store)
    from actstore.features import neurons

    recs = text_windows(
        store,
        4,
        neurons(D),
        {
            "feature": np.array([0]),
            "example": np.array([2]),
            "token": np.array([5]),
            "activation": np.array([5.0], np.float32),
        },
        tok,
        window=(3, 1),
    )
    r = recs[0]
    ids = store.token_ids(2)
    # pieces of the window's decoded text: the word-level decode puts a space between words
    assert r["tokens"] == [WORDS[ids[2]]] + [" " + WORDS[i] for i in ids[3:7]] and r["tokens"][r["center"]] == " zebra"
    assert "".join(r["tokens"]) == tok.decode(ids[2:7]) and r["partial"] == [False] * 5
    np.testing.assert_array_equal(r["acts"], np.asarray(store[2, 4], np.float32)[2:7, 0])


def test_no_recorded_tokenizer_is_a_clear_error(tmp_path):
    path = tmp_path / "s"
    with actstore.ShardWriter(path, layers=[0], d_model=2, tokens=2, token_ids=True) as w:
        w.append(np.zeros((1, 1, 2, 2), np.float16), token_ids=np.zeros((1, 2), int))
    actstore.finalize(path)
    with pytest.raises(TokenizerNotFoundError, match="records no model id, so no tokenizer: pass --tokenizer FOLDER"):
        load_tokenizer(actstore.open(path))
    with pytest.raises(FeatureError, match="holds no meta.json"):
        build_site(str(tmp_path), tmp_path / "site")


def test_site_in_headless_chromium(text_store, tmp_path, request):
    exe = _chromium()
    path, _ = text_store
    out = tmp_path / "feat"
    assert (
        CliRunner()
        .invoke(
            main,
            ["features", str(path), "--layer", "4", "--neurons", "--top-k", "3", "--out", str(out), "--quiet"],
        )
        .exit_code
        == 0
    )
    res = CliRunner().invoke(main, ["view", str(out), "--out", str(tmp_path / "site"), "--quiet"])
    assert res.exit_code == 0, res.output
    site = tmp_path / "site"
    assert not (site / "f").exists() and len(list((site / "data" / "f" / "0").glob("*.js"))) == D  # data, not pages
    prof = tmp_path / "profile"
    dom = _browser(exe, prof, "--virtual-time-budget=5000", "--dump-dom", url=(site / "index.html").as_uri())
    assert "6 of 6 features" in dom  # the script ran and drew the rows from data/index.js
    assert 'href="feature.html#0"' in dom and "<mark> zebra</mark>" in dom  # the token that fired, marked
    assert "dead (never active)" in dom and "dense (active on &gt; 10.0%)" in dom
    page = _browser(exe, prof, "--virtual-time-budget=5000", "--dump-dom", url=(site / "feature.html").as_uri() + "#0")
    # the top example's decoded text, with the top token marked and its value on hover
    ids = actstore.open(path).token_ids(9)
    assert '<h1 id="title">Feature 0</h1>' in page and "<svg" in page and 'data-feature="0"' in page
    text = page.split("Top activations", 1)[1]
    for w in [WORDS[i] for i in ids[1:6]]:
        assert f"> {w}</span>" in text  # each word's piece of the decoded text: " " + word
    assert 'class="tk fire" style="background:rgba(255,110,0,1.00)" title="6 · id 15"> zebra<' in text
    assert 'class="tk off" style="background:rgba(255,110,0,0.00)" title="50 (left out by the pass)' in text  # BOS
    assert "68.8%" in page  # density in percent
    rec = site_record(site, 0)
    assert rec["rows"]["ex"][:2] == [9, 2] and rec["stats"]["density"] == pytest.approx(66 / 96)
    screenshot(exe, prof, (site / "feature.html").as_uri() + "#0", "feature-page-small.png", request)


@pytest.fixture(scope="module")
def vit_store(tmp_path_factory):
    """A ViT-like store: 1 CLS + 3x3 patches of images on disk; dimension 1 fires on one patch."""
    root = tmp_path_factory.mktemp("vit")
    return image_store(root / "store", root, d_model=D)


def test_features_to_s3_and_view_from_s3(text_store, s3_url, tmp_path):
    from actstore.features.run import run_features
    from actstore.features.topk.tables import TOP, read_meta, read_table

    path, _ = text_store
    url = s3_url.replace("/store", "/features")
    meta = run_features(path, 4, url, neurons=True, top_k=2)
    assert read_meta(url) == meta
    top = read_table(url, TOP).to_pandas()
    local = tmp_path / "local"
    run_features(path, 4, str(local), neurons=True, top_k=2)
    pd.testing.assert_frame_equal(top, pd.read_parquet(local / "top.parquet"))
    index = build_site(url, tmp_path / "site")
    rec = site_record(index.parent, 0)
    vocab = (index.parent / "data" / "vocab.js").read_text()
    assert rec["rows"]["ex"][0] == 9 and '"zebra"' in vocab


def test_neuronpedia_export_reads_back_in_saedashboard(text_store, tmp_path):
    """SAEDashboard 0.8.0's own classes rebuild every batch file exactly; logits come from the
    decoder direction times W_U."""
    from sae_dashboard.neuronpedia.neuronpedia_dashboard import NeuronpediaDashboardBatch

    path, _ = text_store
    np.save(tmp_path / "dirs.npy", np.eye(D, dtype=np.float32))
    W_U = np.zeros((D, len(WORDS)), np.float32)
    for i in range(D):
        W_U[i, 10 + i] = 1.0  # dimension i raises token 10 + i ("red" for 0)
    np.save(tmp_path / "wu.npy", W_U)
    out = tmp_path / "feat"
    assert (
        CliRunner()
        .invoke(
            main,
            [
                "features",
                str(path),
                "--layer",
                "4",
                "--directions",
                str(tmp_path / "dirs.npy"),
                "--top-k",
                "2",
                "--out",
                str(out),
                "--quiet",
            ],
        )
        .exit_code
        == 0
    )
    res = CliRunner().invoke(
        main, ["export-neuronpedia", str(out), "--out", str(tmp_path / "np"), "--unembedding", str(tmp_path / "wu.npy")]
    )
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "np" / "batch-0.json").read_text())
    assert NeuronpediaDashboardBatch(**data).to_dict() == data
    f0 = data["features"][0]
    assert f0["feature_index"] == 0 and f0["pos_str"][0] == "red" and f0["pos_values"][0] == 1.0
    assert f0["neuron_alignment_indices"] == [0, 1, 2] and f0["neuron_alignment_values"][0] == 1.0
    top = f0["activations"][0]
    assert (
        top["bin_min"] == -1
        and top["tokens"][top["qualifying_token_index"]] == " zebra"
        and top["values"][top["qualifying_token_index"]] == 6.0
    )
    feats = pd.read_parquet(out / "features.parquet")
    assert f0["frac_nonzero"] == feats.density[0] and sum(f0["freq_hist_data_bar_heights"]) == feats.n_active[0]
    # the site's logit table: the decoder direction of feature 0 raises "red" most
    res = CliRunner().invoke(
        main,
        ["view", str(out), "--out", str(tmp_path / "site"), "--unembedding", str(tmp_path / "wu.npy"), "--quiet"],
    )
    assert res.exit_code == 0, res.output
    rec = site_record(tmp_path / "site", 0)
    vocab = json.loads((tmp_path / "site" / "data" / "vocab.js").read_text()[len('ACTSTORE.load("vocab",') : -3])
    pos, value = rec["logits"]["pos"][0]
    assert vocab["text"][pos] == "red" and value == 1.0
    assert rec["nb"][0][1] == 0.0  # the identity directions are orthogonal


def test_several_images_share_one_colour_scale(vit_store, tmp_path):
    from PIL import Image

    from actstore.features.views.context import image_pixels
    from actstore.features.views.heatmaps import heatmap

    res = CliRunner().invoke(
        main,
        [
            "show",
            str(vit_store),
            "--ex",
            "0",
            "--ex",
            "1",
            "--layer",
            "11",
            "--dim",
            "1",
            "-o",
            str(tmp_path / "two.png"),
        ],
    )
    assert res.exit_code == 0, res.output
    canvas = np.asarray(Image.open(tmp_path / "two.png").convert("RGB"))
    store = actstore.open(vit_store)
    grids = [np.asarray(store[e, 11], np.float32)[1:, 1].reshape(3, 3) for e in (0, 1)]
    lo, hi = min(g.min() for g in grids), max(g.max() for g in grids)
    for i, g in enumerate(grids):  # each tile is its heatmap on the shared [lo, hi]
        want = np.asarray(heatmap(image_pixels(store, i, 28), g - lo, hi - lo))
        x0 = 8 + i * (56 + 8)
        np.testing.assert_array_equal(canvas[24 : 24 + 56, x0 : x0 + 56], want)
    alone = np.asarray(heatmap(image_pixels(store, 0, 28), grids[0] - grids[0].min(), grids[0].max() - grids[0].min()))
    assert not np.array_equal(canvas[24:80, 8:64], alone)  # its own scale would look different


def test_info_plots_count_the_tokens_the_features_count(text_store, tmp_path):
    import re

    path, _ = text_store
    res = CliRunner().invoke(main, ["info", str(path), "--plots", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    assert f"plots: {tmp_path / 'plots'}/plots.html" in res.output
    svg = (tmp_path / "plots" / "positions.svg").read_text()
    pts = [tuple(map(float, p.split(","))) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]
    # token 0 (BOS, norm ~122, label 1) is left out as the feature pass leaves it out: the
    # zebras' position 5 is the highest, position 0 has no tokens
    assert len(pts) == 9 and pts[0][1] == 166.0 and pts[5][1] == 22.0
    norms = (tmp_path / "plots" / "norms.svg").read_text()
    assert norms.count("<polyline") == 1 and "layer 4" in norms
    page = (tmp_path / "plots" / "plots.html").read_text()
    assert 'src="norms.svg"' in page and "12 of 12 examples, spread evenly; 96 content tokens (BOS" in page


def test_index_of_16384_features_draws_only_what_shows(tmp_path):
    """The index reads its columns as one script and draws only the rows in view (a virtual
    list): 16,384 features make an index.js under 2 MB and a page of a few dozen row elements;
    searching by condition and sorting run in the page (index.html#q=...&sort=-max)."""
    import re
    import shutil as sh

    from actstore.features.views import sitedata
    from actstore.features.views.site import ASSETS, STATIC

    exe = _chromium()
    rng = np.random.default_rng(0)
    n = 16384
    site = tmp_path / "site"
    (site / "data").mkdir(parents=True)
    for name in ASSETS:
        sh.copyfile(STATIC / name, site / name)
    density = rng.random(n) * 0.02
    density[:100] = 0.0  # dead
    density[100:130] = 0.5  # dense
    index = {
        "feature": list(range(n)),
        "max": [round(float(v), 3) for v in rng.random(n) * 10],
        "density": density.tolist(),
        "mean": [1.0] * n,
        "n_active": [int(d * 1e6) for d in density],
        "text": [["the cat ", f"tok{f}", " sat"] for f in range(n)],
    }
    meta = {
        "title": "t",
        "store": "x",
        "layer": 3,
        "encoder": {"kind": "saelens"},
        "n_features": n,
        "n_tokens": 10**6,
        "k": 20,
        "edges": [1.0],
        "window": [12, 4],
        "dense": 0.1,
        "bucket": 1000,
        "plots": False,
    }
    for name, value in (("meta", meta), ("index", index)):
        (site / "data" / f"{name}.js").write_text(sitedata.script(name, value))
    assert (site / "data" / "index.js").stat().st_size < 2**21
    dom = _browser(
        exe, tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom", url=(site / "index.html").as_uri()
    )
    assert (
        "16,384 of 16,384 features" in dom
        and "<b>100</b><span>dead (never active)" in dom
        and "<b>30</b><span>dense" in dom
    )
    drawn = re.findall(r'<a class="vrow" [^>]*href="feature.html#(\d+)"', dom)
    assert 10 < len(drawn) < 100 and drawn[0] == "0" and 'data-ms="' in dom
    url = (site / "index.html").as_uri() + "#q=density>1%20tok1&sort=-max"
    dom = _browser(exe, tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom", url=url)
    want = [f for f in range(n) if density[f] > 0.01 and "tok1" in f"tok{f}"]
    drawn = [int(f) for f in re.findall(r'<a class="vrow" [^>]*href="feature.html#(\d+)"', dom)]
    assert f"{len(want):,} of 16,384 features" in dom
    assert drawn == sorted(want, key=lambda f: (-index["max"][f], f))[: len(drawn)]  # ties by feature id


def test_packed_windows_map_to_documents(tmp_path):
    """A --pack store's windows (text field `runs`): each shown token names its document and
    position there (token_origins)."""
    from actstore.features import neurons

    tok_dir = word_tokenizer(tmp_path / "tok")
    path = tmp_path / "packed"
    ids = np.array([[3, 4, 5, 7, 1, 2], [6, 2, 7, 1, 1, 1]])
    runs = [[[0, "doc-a", 5, 3], [1, "doc-b", 0, 3]], [[1, "doc-b", 3, 2], [2, "doc-c", 0, 4]]]
    x = np.zeros((2, 1, 6, D), np.float32)
    x[0, 0, 4, 2] = 3.0  # window 0, token 4: document 1, its token 1
    with actstore.ShardWriter(
        path, layers=[0], d_model=D, segments={"tokens": 6}, token_ids=True, texts=("runs",), model_id=str(tok_dir)
    ) as w:
        w.append(tokens=x.astype(np.float16), lengths=np.array([6, 6]), token_ids=ids, texts={"runs": runs})
    actstore.finalize(path)
    store = actstore.open(path)
    rec = text_windows(
        store,
        0,
        neurons(D),
        {
            "feature": np.array([2]),
            "example": np.array([0]),
            "token": np.array([4]),
            "activation": np.array([3.0], np.float32),
        },
        load_tokenizer(store),
        window=(2, 1),
    )[0]
    assert (rec["key"], rec["doc_token"]) == ("doc-b", 1)
    assert rec["tokens"] == [WORDS[ids[0, 2]]] + [" " + WORDS[i] for i in ids[0, 3:6]]
    assert rec["acts"][rec["center"]] == 3.0


def test_bad_direction_source_writes_nothing(text_store, tmp_path):
    path, _ = text_store
    np.save(tmp_path / "wrong.npy", np.zeros((7, 3), np.float32))
    out = tmp_path / "feat"
    res = CliRunner().invoke(
        main, ["features", str(path), "--layer", "4", "--directions", str(tmp_path / "wrong.npy"), "--out", str(out)]
    )
    assert (
        res.exit_code == 1
        and "the directions encoder takes d_in=7 but layer 4 of" in res.output
        and "has d_model=6" in res.output
    )
    assert not out.exists()
    from sae_lens import StandardSAE, StandardSAEConfig

    StandardSAE(StandardSAEConfig(d_in=5, d_sae=8, dtype="float32", device="cpu")).save_model(tmp_path / "sae5")
    res = CliRunner().invoke(
        main, ["features", str(path), "--layer", "4", "--sae", str(tmp_path / "sae5"), "--out", str(out)]
    )
    assert res.exit_code == 1 and "the saelens encoder takes d_in=5 but layer 4 of" in res.output and not out.exists()
    res = CliRunner().invoke(main, ["features", str(path), "--layer", "9", "--neurons", "--out", str(out)])
    assert res.exit_code == 1 and "this store holds layers [4]" in res.output and not out.exists()
    res = CliRunner().invoke(
        main, ["features", str(path), "--layer", "4", "--neurons", "--top-k", "0", "--out", str(out)]
    )
    assert res.exit_code == 1 and "--top-k must be an int in 1..10000. Got 0." in res.output and not out.exists()
