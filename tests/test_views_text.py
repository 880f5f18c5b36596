"""Round trip: every view and export shows a window's text as `tokenizer.decode(ids)` of the
window (the example's text for a window whose edge cuts a character: whole characters only),
over German, Cyrillic, CJK, emoji, math, Arabic and Hebrew text, with the embedded SmolLM2
tokenizer and a byte-level BPE built here; never a U+FFFD (the texts hold none). Views:
`info --examples`, `show`, the context windows, the site's data and its pages rendered in
Debian's chromium (rows, logit tables), and export-neuronpedia (windows, logit strings).
export-delphi writes token ids only (delphi decodes them itself): no text to check."""

from __future__ import annotations

import gzip
import json
import re
from html.parser import HTMLParser
from types import SimpleNamespace

import numpy as np
import pytest
from browser import _browser, _chromium, site_record
from click.testing import CliRunner
from multilingual import TEXTS, byte_level_tokenizer, load, multilingual_store, slow_pieces, smollm2_tokenizer

import actstore
from actstore.cli import main
from actstore.features import neurons
from actstore.features.exports.dashboards import WINDOW as NP_WINDOW
from actstore.features.exports.dashboards import export_neuronpedia
from actstore.features.run import run_features
from actstore.features.topk.passdata import load_pass
from actstore.features.views.context import text_windows
from actstore.features.views.show import example_texts, text_html
from actstore.features.views.site import build_site
from actstore.features.views.sitedata import KIND_INTERVAL, KIND_TOP, gather_rows
from actstore.features.views.windows import DEFAULT_WINDOW

pytestmark = pytest.mark.torch  # transformers' tokenizers, chromium

D = 4


# The shipped SmolLM2 tokenizer (read from its GGUF file) is slow: `--fast` runs the byte-level one.
@pytest.fixture(scope="module", params=[pytest.param("smollm2", marks=pytest.mark.slow), "byte-level"])
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "smollm2":
        model_id, tok = "embedded:smollm2-135m", smollm2_tokenizer()
    else:
        model_id = str(byte_level_tokenizer(root / "tok"))
        tok = load(model_id)
    path, seqs = multilingual_store(root / "store", tok, model_id, d_model=D)
    feats = root / "feat"
    np.save(root / "dirs.npy", np.eye(D, dtype=np.float32))  # directions: the neurons, with a decoder
    run_features(str(path), 0, str(feats), directions=str(root / "dirs.npy"), top_k=12, device="cpu")
    split = [i for i in sorted({i for s in seqs for i in s}) if "\ufffd" in tok.decode([i])]
    W_U = np.zeros((D, max(len(tok), max(map(max, seqs)) + 1)), np.float32)
    W_U[0, split[:8]] = np.arange(8, 0, -1)  # dimension 0 raises tokens that hold part of a character
    np.save(root / "wu.npy", W_U)
    return SimpleNamespace(tok=tok, path=path, seqs=seqs, feats=feats, wu=root / "wu.npy", root=root, split=split[:8])


def window_text(case, ex, lo, hi):
    """What a view must show for tokens lo..hi-1 of example ex: the decode of those ids when
    it is whole characters, else the pieces of the example's decode those tokens complete."""
    seq = case.seqs[ex]
    pieces, _ = _slow(case, ex)
    want = "".join(pieces[lo:hi])
    window = case.tok.decode(seq[lo:hi])
    if "\ufffd" not in window:
        assert want == window
    assert "\ufffd" not in want
    return want, "\ufffd" not in window


def _slow(case, ex, cache={}):  # noqa: B006 - one slow decode per (tokenizer, example)
    key = (id(case.tok), tuple(case.seqs[ex]))
    if key not in cache:
        cache[key] = slow_pieces(case.tok, case.seqs[ex])
    return cache[key]


class _Tokens(HTMLParser):
    """The token spans' text in each cell of class `cell` (control marks read back as the
    characters they stand for; newline marks dropped), and which spans are partial."""

    def __init__(self, cell: str) -> None:
        super().__init__(convert_charrefs=True)
        self.cell, self.cells, self.stack, self.partial = cell, [], [], []

    def handle_starttag(self, tag, attrs):
        cls = (dict(attrs).get("class") or "").split()
        if tag == "td" and self.cell in cls:
            self.cells.append([])
            self.partial.append([])
        if tag == "span" and "tk" in cls and self.cells:
            self.cells[-1].append("")
            self.partial[-1].append("part" in cls)
        if tag in ("span", "td"):
            self.stack.append(cls)

    def handle_endtag(self, tag):
        if tag in ("span", "td") and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if not self.cells or not any("tk" in c for c in self.stack):
            return
        if "ctl" in self.stack[-1]:
            data = chr(int(data[2:], 16))
        elif "nl" in self.stack[-1]:
            return
        self.cells[-1][-1] += data


def tokens_in(page: str, cell: str = "ctx") -> tuple[list[list[str]], list[list[bool]]]:
    p = _Tokens(cell)
    p.feed(page)
    return p.cells, p.partial


def test_info_examples_is_the_decode_of_each_example(case):
    recs, note = example_texts(actstore.open(case.path), len(TEXTS))
    assert note is None
    for ex, rec in enumerate(recs):
        assert rec["segments"]["text"] == case.tok.decode(case.seqs[ex])
        assert rec["segments"]["text"].endswith(list(TEXTS.values())[ex])
    res = CliRunner().invoke(main, ["info", str(case.path), "--examples", "7", "--json"])
    assert res.exit_code == 0, res.output
    got = [e["segments"]["text"] for e in json.loads(res.output)["examples"]]
    assert got == [case.tok.decode(s) for s in case.seqs]


def test_show_draws_each_example_as_its_decode(case):
    store = actstore.open(case.path)
    n_partial = 0
    for ex, seq in enumerate(case.seqs):
        page = text_html(store, ex, 0, feature=0)
        (cells,), (partial,) = tokens_in(page.replace('<p class="ctx">', '<table><td class="ctx">'))
        assert len(cells) == len(seq) and "".join(cells) == case.tok.decode(seq)
        assert cells == _slow(case, ex)[0] and partial == _slow(case, ex)[1]
        n_partial += sum(partial)
    assert n_partial > 20


def test_context_windows_are_the_decode_of_their_ids(case):
    store = actstore.open(case.path)
    top = load_pass(str(case.feats)).top
    rows = {k: np.asarray(top[k]) for k in ("feature", "example", "token", "activation")}
    recs = text_windows(store, 0, neurons(D), rows, _tok_of(store))  # the directions are the identity
    cut = 0
    for r in recs:
        lo, hi = r["start"], r["start"] + len(r["tokens"])
        want, whole = window_text(case, r["example"], lo, hi)
        assert "".join(r["tokens"]) == want
        cut += not whole
    assert cut > 0 and len(recs) == 12  # windows whose edge cuts a character are among them


def _tok_of(store):
    from actstore.features.views.context import load_tokenizer

    return load_tokenizer(store)


def _site_rows(case, site, f):
    """Each row of feature f's page as the page draws it (feature-page.js's piece()), with
    the example and the window's token range."""
    rec = site_record(site, f)
    vocab = json.loads((site / "data" / "vocab.js").read_text()[len('ACTSTORE.load("vocab",') : -3])
    px = {k: t for k, t in rec.get("px", [])}
    width, out = rec["width"], []
    v = rec["v"].reshape(-1, width)
    for r, (ex, tok) in enumerate(zip(rec["rows"]["ex"], rec["rows"]["tok"])):
        texts = []
        for c in np.flatnonzero(v[r] >= 0).tolist():
            p = int(v[r, c])
            texts.append(px.get(r * width + c, vocab["ctx"].get(str(p), vocab["text"][p])))
        lo = tok - DEFAULT_WINDOW[0] + int(np.argmax(v[r] >= 0))
        out.append((ex, lo, lo + len(texts), texts))
    return rec, vocab, out


def test_site_rows_and_logit_tables_are_the_decode(case):
    site = case.root / "site"
    build_site(str(case.feats), site, unembedding=str(case.wu), plot_examples=0, overwrite=True)
    cut = 0
    for f in range(D):
        rec, vocab, rows = _site_rows(case, site, f)
        for ex, lo, hi, texts in rows:
            want, whole = window_text(case, ex, lo, hi)
            assert "".join(texts) == want
            cut += not whole
    assert cut > 0
    rec, vocab, _ = _site_rows(case, site, 0)
    shown = [vocab["text"][p] for p, _ in rec["logits"]["pos"]]
    assert [vocab["ids"][p] for p, _ in rec["logits"]["pos"]][:8] == case.split
    raw = set(vocab["raw"])
    assert all(p in raw for p, _ in rec["logits"]["pos"][:8])  # drawn as bytes, marked
    assert all("\ufffd" not in t for t in vocab["text"]) and any(re.search(r"\\x[89ab]", t) for t in shown)
    index = (site / "data" / "index.js").read_text()
    assert "\\ufffd" not in index and "\ufffd" not in index


def test_site_pages_render_the_decode_in_chromium(case):
    exe = _chromium()
    site = case.root / "site-c"
    build_site(str(case.feats), site, unembedding=str(case.wu), plot_examples=0)
    dom = _browser(
        exe, case.root / "prof", "--virtual-time-budget=5000", "--dump-dom", url=(site / "feature.html").as_uri() + "#0"
    )
    assert 'data-feature="0"' in dom and "\ufffd" not in dom
    _, vocab, rows = _site_rows(case, site, 0)
    cells, partial = tokens_in(dom)
    ctx = [(c, p) for c, p in zip(cells, partial) if len(c) > 1]  # the examples' context cells (token tables: 1 token)
    assert len(ctx) == len(rows)
    for (texts, part), (ex, lo, hi, want_texts) in zip(ctx, rows):
        assert texts == want_texts and "".join(texts) == window_text(case, ex, lo, hi)[0]
        assert part == [bool(x) for x in _slow(case, ex)[1][lo:hi]]
    assert any(any(p) for _, p in ctx)  # partial tokens are marked on the page
    tables = [c[0] for c in cells if len(c) == 1]
    assert any(re.fullmatch(r"( |\\x[0-9a-f]{2})+", t) for t in tables)  # a logit table's split token, as bytes


def test_neuronpedia_windows_and_logits_are_the_decode(case):
    out = case.root / "np"
    export_neuronpedia(str(case.feats), out, unembedding=str(case.wu), overwrite=True)
    data = json.loads((out / "batch-0.json").read_text())
    p = load_pass(str(case.feats))
    rows = gather_rows(p)
    pos = np.flatnonzero(rows.sign > 0)
    n_checked = cut = 0
    for feature in data["features"]:
        f = feature["feature_index"]
        mine = [i for i in pos if rows.feature[i] == f and rows.kind[i] in (KIND_TOP, KIND_INTERVAL)]
        assert len(mine) == len(feature["activations"])
        for i, a in zip(mine, feature["activations"]):
            ex, tok = int(rows.example[i]), int(rows.token[i])
            lo = max(tok - NP_WINDOW[0], 0)
            want, whole = window_text(case, ex, lo, lo + len(a["tokens"]))
            assert "".join(a["tokens"]) == want and a["qualifying_token_index"] == tok - lo
            n_checked, cut = n_checked + 1, cut + (not whole)
    assert n_checked > 20
    f0 = data["features"][0]
    assert "\ufffd" not in "".join(f0["pos_str"]) and any("\\x" in t for t in f0["pos_str"])
    folder = next(out.glob("*/*/activations"))
    for line in gzip.decompress(next(folder.glob("*.jsonl.gz")).read_bytes()).splitlines():
        assert "\ufffd" not in "".join(json.loads(line)["tokens"])


def test_right_to_left_tokens_read_right_to_left_in_chromium(tmp_path):
    """The site's style lets a right-to-left text's tokens take part in the bidi order: the
    tokens of "مرحبا بالعالم" are drawn right to left, as the text is (each token isolated,
    they were drawn left to right: "عالمبال حبامر")."""
    exe = _chromium()
    from actstore.features.views.site import STATIC

    tokens = ["مر", "حبا", " بال", "عالم"]
    spans = "".join(f'<span class="tk">{t}</span>' for t in tokens)
    measure = (
        "var x = Array.from(document.querySelectorAll('.tk')).map(function (s) {"
        " return Math.round(s.getBoundingClientRect().left); });"
        "document.body.dataset.x = x.join(',');"
    )
    page = tmp_path / "rtl.html"
    page.write_text(
        f'<!doctype html><html><head><meta charset="utf-8"><link rel="stylesheet" href="{(STATIC / "style.css").as_uri()}">'
        f'</head><body><table class="t examples"><tr><td class="ctx">{spans}</td></tr></table>'
        f"<script>{measure}</script></body></html>",
        encoding="utf-8",
    )
    dom = _browser(exe, tmp_path / "prof", "--virtual-time-budget=3000", "--dump-dom", url=page.as_uri())
    x = [int(v) for v in re.search(r'data-x="([-\d,]+)"', dom).group(1).split(",")]
    assert x == sorted(x, reverse=True) and len(set(x)) == len(tokens)  # each token left of the one before it
