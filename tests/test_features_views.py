"""The site's build and the views' edges: a build is staged and swapped in whole (killed with
SIGKILL, out of space, or raced by a second build: the old site stays as it was), a site never
replaces a folder it did not write, the views refuse a store that changed since the pass, a
store without a tokenizer shows token ids, bidi controls are isolated and long tokens wrap in
a real browser, the negative tail of a format-2 pass is shown, and the relations and logit
tables are the arithmetic they claim."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import forked
import numpy as np
import pytest
from browser import _browser, _chromium, site_record
from click.testing import CliRunner
from factory import WORD_D, chat_word_store, odd_token_store, word_tokenizer

import actstore
from actstore.cli import main
from actstore.errors import DiskFullError, FeatureError, OutputBusyError, OutputExistsError
from actstore.features.run import run_features
from actstore.features.staging import MARKER
from actstore.features.views.site import build_site

pytestmark = pytest.mark.torch  # chromium, and delphi's loader imports torch


@pytest.fixture(scope="module")
def feats(text_store, tmp_path_factory):
    path, _ = text_store
    out = tmp_path_factory.mktemp("feats") / "feat"
    run_features(path, 4, str(out), neurons=True, top_k=3)
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_build_needs_overwrite_and_never_replaces_other_folders(feats, tmp_path):
    site = tmp_path / "site"
    build_site(str(feats), site, plot_examples=0)
    assert json.loads((site / MARKER).read_text()) == {"kind": "actstore view"}
    with pytest.raises(OutputExistsError, match="exists: pass --overwrite to replace it"):
        build_site(str(feats), site, plot_examples=0)
    res = CliRunner().invoke(main, ["view", str(feats), "--out", str(site), "--quiet"])
    assert res.exit_code == 1 and "pass --overwrite" in res.output
    res = CliRunner().invoke(main, ["view", str(feats), "--out", str(site), "--overwrite", "--quiet"])
    assert res.exit_code == 0, res.output
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    with pytest.raises(OutputExistsError, match="exists: pass --overwrite"):
        build_site(str(feats), mine, plot_examples=0)
    res = CliRunner().invoke(main, ["view", str(feats), "--out", str(mine), "--overwrite", "--quiet"])
    assert res.exit_code == 0 and "was not written by this command; the old folder is kept as" in res.stderr
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("mine.replaced-")]
    assert len(kept) == 1 and (kept[0] / "thesis.tex").read_text() == "precious"  # never deleted: not ours
    assert (mine / "index.html").exists() and not (mine / "thesis.tex").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_site(str(feats), empty, plot_examples=0) == empty / "index.html"  # an empty folder is used
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("mine.")) == ["empty", "mine", "site"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no stage or lock left


def test_a_build_out_of_space_leaves_the_old_site(feats, tmp_path, monkeypatch):
    site = tmp_path / "site"
    build_site(str(feats), site, plot_examples=0)
    before = _tree(site)
    from actstore.features.views import site as site_module

    real = site_module._write
    calls = {"n": 0}

    def full(path, text):
        calls["n"] += 1
        if calls["n"] == 4:  # the disk fills while a 4th feature file is written
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(site_module, "_write", full)
    with pytest.raises(
        DiskFullError, match=r"no space left writing .*\.staging-[^/]+/data/f/0/\d\.js: .*site is unchanged"
    ):
        build_site(str(feats), site, overwrite=True, plot_examples=0)
    monkeypatch.undo()
    assert _tree(site) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


KILLER = """
import os, signal, sys
from actstore.features.views import sitedata
from actstore.features.views.site import build_site
real, n = sitedata.script, [0]
def script(kind, value):
    n[0] += 1
    if n[0] == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(kind, value)
sitedata.script = script
build_site(sys.argv[1], sys.argv[2], overwrite=True, plot_examples=0)
"""


def test_a_killed_build_leaves_the_old_site_and_the_next_one_cleans_up(feats, tmp_path):
    site = tmp_path / "site"
    build_site(str(feats), site, plot_examples=0)
    before = _tree(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = forked.run_code(KILLER, str(feats), str(site), env=env, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert _tree(site) == before  # the old site, whole: not one page of the killed build
    stale = [p.name for p in tmp_path.iterdir() if p.name.startswith(".site.staging-")]
    assert len(stale) == 1
    build_site(str(feats), site, overwrite=True, plot_examples=0)  # the lock died with the process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


SWAP_KILLER = """
import os, signal, sys
from actstore.storage import durable, swap
from actstore.features.views.site import build_site
if sys.argv[3] == "0":
    durable._renameat2 = None  # a file system without an atomic exchange
real_exchange, real_rename = swap.exchange_paths, os.rename
def exchange_paths(a, b):
    done = real_exchange(a, b)
    if done:  # the new site is in, the user's folder under the stage's name
        os.kill(os.getpid(), signal.SIGKILL)
    return done
def rename(a, b):
    real_rename(a, b)
    if os.path.basename(b) == "mine":  # the fallback: the new site renamed in, the old folder aside
        os.kill(os.getpid(), signal.SIGKILL)
swap.exchange_paths, os.rename = exchange_paths, rename
build_site(sys.argv[1], sys.argv[2], overwrite=True, plot_examples=0)
"""


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_view_overwrite_killed_in_the_swap_window_never_loses_the_users_folder(feats, tmp_path, exchange):
    mine = tmp_path / "mine"
    (mine / "figs").mkdir(parents=True)
    (mine / "thesis.tex").write_text("precious")
    (mine / "figs" / "a.png").write_bytes(b"png")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = forked.run_code(SWAP_KILLER, str(feats), str(mine), "1" if exchange else "0", env=env, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert (mine / "index.html").exists()  # killed with the new site in place
    res = CliRunner().invoke(main, ["view", str(feats), "--out", str(mine), "--overwrite", "--quiet"])
    assert res.exit_code == 0, res.output
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("mine.replaced-")]
    assert len(kept) == 1 and _tree(kept[0]) == {"thesis.tex": b"precious", "figs/a.png": b"png"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", kept[0].name]  # no stage, nothing deleted
    assert (mine / "index.html").exists() and not (mine / "thesis.tex").exists()


def test_a_concurrent_build_is_refused(feats, tmp_path):
    import fcntl

    site = tmp_path / "site"
    with open(tmp_path / ".site.lock", "w") as held:  # another build holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OutputBusyError, match="another process is writing site now"):
            build_site(str(feats), site, plot_examples=0)
    assert not site.exists()
    build_site(str(feats), site, plot_examples=0)


def test_a_changed_store_is_refused_or_warned(text_store, tmp_path):
    import shutil

    path, _ = text_store
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    run_features(copy, 4, str(tmp_path / "feat"), neurons=True, top_k=2)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["created"] = "2000-01-01T00:00:00"  # another state of the store
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureError, match="is no longer the state the feature pass read .* pass --allow-store-change"):
        build_site(str(tmp_path / "feat"), tmp_path / "site")
    res = CliRunner().invoke(
        main, ["view", str(tmp_path / "feat"), "--out", str(tmp_path / "site"), "--allow-store-change", "--quiet"]
    )
    assert res.exit_code == 0 and "actstore: warning:" in res.output and "no longer the state" in res.output


def _another_finalize(store: Path, other: Path) -> None:
    """Replace the store at `store` by `other`: the same examples, another finalize."""
    import shutil

    shutil.copytree(store, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["created"] = "2000-01-01T00:00:00"
    (other / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(store)
    os.rename(other, store)


def test_a_view_whose_store_is_replaced_mid_build_is_refused_naming_both_states(text_store, tmp_path, monkeypatch):  # noqa: F811
    import hashlib
    import shutil

    from actstore.errors import StoreChangedError
    from actstore.features.views import sitedata

    path, _ = text_store
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    run_features(copy, 4, str(tmp_path / "feat"), neurons=True, top_k=2)
    site = tmp_path / "site"
    build_site(str(tmp_path / "feat"), site, plot_examples=0)
    before, began = _tree(site), hashlib.sha256((copy / "manifest.json").read_bytes()).hexdigest()
    real, n = sitedata.script, [0]

    def script(kind, value):  # while the 4th page is made, the store is replaced
        n[0] += 1
        if n[0] == 4:
            _another_finalize(copy, tmp_path / "other")
        return real(kind, value)

    monkeypatch.setattr(sitedata, "script", script)
    with pytest.raises(StoreChangedError) as e:
        build_site(str(tmp_path / "feat"), site, overwrite=True, plot_examples=0)
    now = hashlib.sha256((copy / "manifest.json").read_bytes()).hexdigest()
    assert n[0] > 4 and began != now
    assert str(e.value) == (
        f"{copy} changed while `actstore view` read it (manifest sha256 {began[:12]}... when the read began; "
        f"manifest sha256 {now[:12]}... at the end): nothing was published, so what is there is unchanged; "
        "rerun once the store stays as it is"
    )
    assert _tree(site) == before and sorted(p.name for p in tmp_path.iterdir()) == ["feat", "site", "store"]


def test_show_records_the_state_it_drew_and_refuses_a_changed_store(tmp_path, monkeypatch):
    from actstore.features.views import show

    path = _chat_store(tmp_path, model_id=str(tmp_path / "tok"))
    st = actstore.ActStore(path)
    page = show.text_html(st, 0, 0)
    assert (
        f'<meta name="actstore:store" content="{path}"><meta name="actstore:manifest_sha256" content="{st.manifest_sha256}">'
        in page
    )
    real = show._values

    def values(store, *a):  # the store is finalized again while the example is read
        v = real(store, *a)
        _another_finalize(path, tmp_path / "other")
        return v

    monkeypatch.setattr(show, "_values", values)
    out = tmp_path / "ex0.html"
    res = CliRunner().invoke(main, ["show", str(path), "--ex", "0", "--layer", "0", "-o", str(out)])
    assert res.exit_code == 1 and not out.exists(), res.output
    assert (
        f"actstore: error: {path} changed while `actstore show` read it (manifest sha256 {st.manifest_sha256[:12]}"
        in res.output
    )


def _odd_store(tmp_path, *, model_id):
    return odd_token_store(tmp_path / "odd", tmp_path / "tok", model_id=model_id or "")


def test_bidi_controls_are_isolated_and_long_tokens_wrap(tmp_path, request):
    exe = _chromium()
    path = odd_token_store(tmp_path / "odd", tmp_path / "tok")
    run_features(path, 0, str(tmp_path / "feat"), neurons=True, top_k=2)
    site = tmp_path / "site"
    build_site(str(tmp_path / "feat"), site, plot_examples=0)
    prof = tmp_path / "prof"
    for f in (0, 1):
        dom = _browser(
            exe,
            prof,
            "--virtual-time-budget=5000",
            "--window-size=1000,800",
            "--dump-dom",
            url=(site / "feature.html").as_uri() + f"#{f}",
        )
        assert f'data-feature="{f}"' in dom and 'data-wide="0"' in dom  # nothing widens the page
        assert '<span class="ctl" title="U+202E">U+202E</span>right' in dom  # shown, never applied
        assert '<span class="ctl" title="U+2066">U+2066</span>iso' in dom
        assert "\u202e" not in dom and "\u2066" not in dom
    index = _browser(exe, prof, "--virtual-time-budget=5000", "--dump-dom", url=(site / "index.html").as_uri())
    assert "<mark> " + "x" * 39 + "\u2026</mark>" in index  # the index cuts a long token (" " + its word)


def test_a_store_without_a_tokenizer_shows_token_ids(tmp_path):
    path = _odd_store(tmp_path, model_id="")
    run_features(path, 0, str(tmp_path / "feat"), neurons=True, top_k=2)
    build_site(str(tmp_path / "feat"), tmp_path / "site", plot_examples=0)
    meta = (tmp_path / "site" / "data" / "meta.js").read_text()
    assert "token ids shown: records no model id. To decode them, --tokenizer takes embedded:smollm2-135m" in meta
    vocab = json.loads((tmp_path / "site" / "data" / "vocab.js").read_text()[len('ACTSTORE.load("vocab",') : -3])
    assert vocab == {
        "ids": [0, 1, 2, 3, 4, 5],
        "text": ["[0]", "[1]", "[2]", "[3]", "[4]", "[5]"],
        "ctx": {},
        "raw": [],
    }
    with pytest.raises(FeatureError, match="cannot load the tokenizer 'nowhere'"):
        build_site(str(tmp_path / "feat"), tmp_path / "site2", tokenizer="nowhere", plot_examples=0)
    build_site(str(tmp_path / "feat"), tmp_path / "site3", tokenizer=str(tmp_path / "tok"), plot_examples=0)
    assert "x" * 10000 in (tmp_path / "site3" / "data" / "vocab.js").read_text()


def test_a_store_without_token_ids_shows_example_and_position_rows(tmp_path):
    """A ShardWriter store written without token ids: the site names each row by (example,
    position), shows a row's context as positions [N] (never decoded with the store's
    tokenizer, which would read them as ids) and says so in a note; text views still refuse."""
    from actstore.features.views.site import NO_IDS_NOTE
    from actstore.features.views.windows import DEFAULT_WINDOW

    tok = word_tokenizer(tmp_path / "tok")  # a tokenizer that loads: it must not decode positions
    rng = np.random.default_rng(3)
    with actstore.ShardWriter(tmp_path / "s", layers=[2], d_model=6, tokens=7, model_id=str(tok)) as w:
        w.append(rng.standard_normal((9, 1, 7, 6)).astype(np.float32))
    actstore.finalize(tmp_path / "s")
    assert not actstore.ActStore(tmp_path / "s").config.token_ids
    run_features(tmp_path / "s", 2, str(tmp_path / "feat"), neurons=True, top_k=3)
    res = CliRunner().invoke(main, ["view", str(tmp_path / "feat"), "-o", str(tmp_path / "site"), "--quiet"])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "site" / "data" / "meta.js").read_text()[len('ACTSTORE.load("meta",') : -3])
    assert meta["note"] == NO_IDS_NOTE
    vocab = json.loads((tmp_path / "site" / "data" / "vocab.js").read_text()[len('ACTSTORE.load("vocab",') : -3])
    assert vocab == {"ids": list(range(7)), "text": [f"[{t}]" for t in range(7)], "ctx": {}, "raw": []}
    before, after = DEFAULT_WINDOW
    for f in range(6):
        rec = site_record(tmp_path / "site", f)
        rows, width = rec["rows"], rec["width"]
        v = np.asarray(rec["v"]).reshape(-1, width)
        assert width == before + 1 + after and len(v) == len(rows["tok"]) > 0
        for i, t in enumerate(rows["tok"]):
            shown = [vocab["text"][p] if p >= 0 else None for p in v[i].tolist()]
            want = [f"[{t + d}]" if 0 <= t + d < 7 else None for d in range(-before, after + 1)]
            assert shown == want, (f, i)
    from actstore.features.views.windows import text_windows

    with pytest.raises(FeatureError, match="keeps no token ids: text context needs a store captured with token_ids"):
        text_windows(actstore.ActStore(tmp_path / "s"), 2, None, np.zeros(1, int), np.zeros(1, int), np.zeros(1, int))


def test_unembedding_auto_applies_where_it_can_and_a_named_one_is_refused_before_any_work(feats, tmp_path, monkeypatch):
    """--unembedding auto (the README's spelling) on a neurons pass builds the site without
    logit tables; a W_U named for a source without decoder directions (or an image store) is
    refused in one line before any window is read."""
    from actstore.features.exports import dashboards as export_mod
    from actstore.features.views import site as site_mod
    from actstore.features.views.logits import applicable_unembedding

    res = CliRunner().invoke(main, ["view", str(feats), "-o", str(tmp_path / "site"), "--unembedding", "auto"])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "site" / "data" / "meta.js").read_text()[len('ACTSTORE.load("meta",') : -3])
    assert meta["logits"] is False
    np.save(tmp_path / "wu.npy", np.eye(WORD_D, 5, dtype=np.float32))

    def no_work(*a, **kw):
        raise AssertionError("the windows were read before the refusal")

    monkeypatch.setattr(site_mod, "text_windows", no_work)
    monkeypatch.setattr(export_mod, "text_windows", no_work)
    said = (
        "actstore: error: --unembedding gives logit tables of decoder directions through a language model's W_U; "
        "a neurons source has no decoder directions (SAEs and --directions have): leave it out "
        "(--unembedding auto draws them only where they apply)\n"
    )
    for command in ("view", "export-neuronpedia"):
        out = tmp_path / f"{command}-wu"
        res = CliRunner().invoke(main, [command, str(feats), "-o", str(out), "--unembedding", str(tmp_path / "wu.npy")])
        assert (res.exit_code, res.output) == (1, said), res.output
        assert not out.exists()
    neurons = type("E", (), {"W_dec": None, "kind": "neurons"})()
    sae = type("E", (), {"W_dec": np.eye(3), "kind": "sae"})()
    assert [applicable_unembedding(u, sae, False) for u in (None, "auto", "wu.npy")] == [None, "auto", "wu.npy"]
    assert applicable_unembedding("auto", neurons, False) is None and applicable_unembedding("auto", sae, True) is None
    with pytest.raises(FeatureError, match="; this store holds image activations: leave it out"):
        applicable_unembedding("wu.npy", sae, True)


def test_a_pass_of_both_tails_shows_the_negative_one(text_store, tmp_path):
    """A pass with --sign both (format 2: a sign column, the negative statistics): the site
    shows the most negative activations, the negative density and histogram."""
    exe = _chromium()
    path, _ = text_store
    run_features(path, 4, str(tmp_path / "feat2"), neurons=True, top_k=3, sign="both")
    site = tmp_path / "site"
    build_site(str(tmp_path / "feat2"), site, plot_examples=0)
    rec = site_record(site, 1)  # dimension 1: noise of both signs
    kinds = [(g["kind"], g["sign"]) for g in rec["groups"]]
    assert kinds[:2] == [("top", 1), ("bottom", -1)] and ("interval", -1) in kinds
    bottom = [a for g, a in zip(rec["rows"]["g"], rec["rows"]["act"]) if rec["groups"][g]["kind"] == "bottom"]
    assert bottom == sorted(bottom) and bottom[0] == pytest.approx(rec["stats"]["min"], rel=1e-3) and bottom[0] < 0
    assert rec["stats"]["n_negative"] > 0 and rec["hist_neg"] is not None
    dom = _browser(
        exe,
        tmp_path / "prof",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url=(site / "feature.html").as_uri() + "#1",
    )
    assert "Most negative activations" in dom and "density &lt; 0" in dom and "Negative values" in dom
    assert 'style="background:rgba(30,110,255,1.00)"' in dom  # the most negative token, blue at full scale
    index = _browser(
        exe, tmp_path / "prof", "--virtual-time-budget=5000", "--dump-dom", url=(site / "index.html").as_uri()
    )
    assert ">density &lt; 0</div>" in index and "top-3, both tails" in index


def test_neighbours_cooccurrence_and_common_tokens_are_the_arithmetic():
    from actstore.features.views.relations import common_tokens, cooccurring, neighbours

    W = np.array([[1, 0, 0], [0.9, 0.1, 0], [0.5, 1, 0], [0, 0, 0]], np.float32)
    idx, cos = neighbours(W, 2)
    assert idx[0].tolist() == [1, 2] and cos[0][0] == pytest.approx(0.9 / np.hypot(0.9, 0.1))
    assert cos[3].tolist() == [0.0, 0.0]  # a zero direction is nobody's neighbour
    # feature 7's top positions 10, 11, 12; feature 8 shares 10 and 11, feature 9 shares 12
    co = cooccurring(
        np.array([7, 7, 7]),
        np.array([10, 11, 12]),
        np.array([7, 7, 7, 8, 8, 9, 8]),
        np.array([10, 11, 12, 10, 11, 12, 11]),
    )
    assert co[7] == [(8, 2), (9, 1)]
    assert common_tokens(np.array([1, 1, 1, 2]), np.array([5, 5, 6, -1])) == {1: [(5, 2), (6, 1)]}


def test_logit_tables_fold_the_final_norm(tmp_path):
    """--unembedding auto from a model folder: W_U = lm_head.weight.T with the final RMSNorm's
    weight folded in; the tables are the directions times it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from actstore.features.views.logits import load_unembedding, logit_tables

    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.arange(1, 9, dtype=torch.float32))
    model.save_pretrained(tmp_path / "llama")

    class Store:
        meta = {"model_id": str(tmp_path / "llama")}
        path = "s"

    U = load_unembedding("auto", 8, Store())
    want = model.lm_head.weight.detach().numpy().T * np.arange(1, 9, dtype=np.float32)[:, None]
    np.testing.assert_allclose(U.W, want, rtol=1e-6)
    assert U.norm == "rms"
    d = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    L = logit_tables(d, U, n=4, bins=10)
    full = d @ want
    assert L.top_ids[1].tolist() == np.argsort(-full[1])[:4].tolist()
    assert L.bottom_values[2][0] == pytest.approx(full[2].min(), rel=1e-5) and L.hist[0].sum() == 40
    with pytest.raises(FeatureError, match="records no model id: pass --unembedding FILE"):
        load_unembedding("auto", 8, type("S", (), {"meta": {}, "path": "p"})())


def _chat_store(tmp_path, *, model_id):
    word_tokenizer(tmp_path / "tok")
    return chat_word_store(tmp_path / "chat", model_id)


def test_show_scales_colours_by_content_tokens_and_marks_the_response(tmp_path):
    path = _chat_store(tmp_path, model_id=str(tmp_path / "tok"))
    out = tmp_path / "ex0.html"
    res = CliRunner().invoke(main, ["show", str(path), "--ex", "0", "--layer", "0", "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "colour scale &plusmn;6 (the largest |value| of the content tokens)" in page  # not the BOS's 1000
    assert 'class="tk special" style="background: rgba(255,110,0,0.00)" title="1000 · id 0 (special' in page
    # each token's piece of the example's decoded text ("<bos> the cat sat on mat dog")
    assert 'style="background: rgba(255,110,0,0.50)" title="3 · id 3"> sat</span>' in page
    assert '<span class="seg" title="segment response begins">response</span><span class="tk" ' in page
    assert (
        page.index("> sat</span>") < page.index(">response</span>") < page.index("> on</span>")
    )  # the marker precedes the first response token
    assert "<style>" in page and "unicode-bidi: isolate" in page


def test_show_and_info_without_a_tokenizer_show_ids(tmp_path):
    path = _chat_store(tmp_path, model_id="")
    from actstore.features.views.show import colour_scale, text_html

    page = text_html(actstore.open(path), 0, 0)
    assert "token ids shown: records no model id. To decode them, --tokenizer takes embedded:smollm2-135m" in page
    assert ">[5]</span>" in page
    scale, how = colour_scale(np.array([1000.0] + [1.0] * 99), None)  # no token kinds: a robust quantile
    assert scale == 1.0 and how == "the 98th percentile of |value|"
    res = CliRunner().invoke(main, ["info", str(path), "--examples", "1"])
    assert res.exit_code == 0, res.output
    assert (
        "first 1 examples:" in res.output
        and "prompt: '[0][1][2][3]'" in res.output
        and "response: '[4][5][6]'" in res.output
    )
    res = CliRunner().invoke(
        main, ["info", str(path), "--examples", "1", "--tokenizer", str(tmp_path / "tok"), "--json"]
    )
    info = json.loads(res.output)
    # the example's decoded text, cut where the response begins (per-token decodes joined gave "<bos>thecatsat")
    assert info["examples"][0]["segments"] == {"prompt": "<bos> the cat sat", "response": " on mat dog"}


def test_a_table_meta_json_does_not_vouch_for_is_refused(feats, tmp_path):
    import shutil

    shutil.copytree(feats, tmp_path / "feat")
    top = tmp_path / "feat" / "top.parquet"
    import pyarrow.parquet as pq

    t = pq.read_table(top)
    pq.write_table(t.slice(0, len(t) - 1), top)  # a readable table, one row short
    with pytest.raises(FeatureError, match=r"top.parquet is not the file meta.json vouches for \(sha256 differs\)"):
        build_site(str(tmp_path / "feat"), tmp_path / "site", plot_examples=0)
    assert not (tmp_path / "site").exists()
