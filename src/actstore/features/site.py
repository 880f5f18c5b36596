"""`actstore view`: a static site from the files of a feature pass (actstore.features.tables).

SITE/index.html lists the features from `data/index.js` (a script, so that the page works
from file:// where fetch is refused), sorted and filtered in the page, a page of rows at a
time: 16,384 features are one array of about 1 MB. SITE/f/<feature>.html is rendered here
(Jinja2 templates shipped in actstore/features/templates/): statistics, an SVG histogram,
the top examples with each token's activation as its colour (the value on hover) or an
image heatmap, interval samples and, given the decoder and an unembedding, logit tables.
Nothing is fetched from the internet; no build step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from actstore.features import context
from actstore.features.encoders import Encoder
from actstore.errors import FeatureError
from actstore.features.tables import FEATURES, INTERVALS, TOP, read_meta, read_table
from actstore.read.api import Reader, ReaderLike, as_reader

PER_PAGE = 100
HIST_W, HIST_H = 480, 120


def _env() -> Any:
    try:
        import jinja2
    except ImportError:
        raise FeatureError("actstore view needs jinja2: pip install 'actstore[views]'") from None
    return jinja2.Environment(loader=jinja2.PackageLoader("actstore.features", "templates"), autoescape=True)


def histogram_svg(counts: np.ndarray, edges: list[float]) -> str:
    """An inline SVG bar chart of counts on log bins (bins 0 and -1: below / above the edges)."""
    nz = np.flatnonzero(counts)
    if not len(nz):
        return "<p class='meta'>no positive activations</p>"
    lo, hi = nz[0], nz[-1] + 1
    c = counts[lo:hi].astype(float)
    w = HIST_W / len(c)
    bars = []
    for i, v in enumerate(c):
        h = 0 if v == 0 else max(1.0, (np.log1p(v) / np.log1p(c.max())) * (HIST_H - 20))
        left = "0" if lo + i == 0 else f"{edges[lo + i - 1]:.3g}"
        bars.append(
            f'<rect x="{i * w:.1f}" y="{HIST_H - 15 - h:.1f}" width="{max(w - 1, 1):.1f}" height="{h:.1f}" fill="#e8740c">'
            f"<title>[{left}, ...): {int(v)}</title></rect>"
        )
    first = "0" if lo == 0 else f"{edges[lo - 1]:.3g}"
    last = f"{edges[min(hi - 1, len(edges) - 1)]:.3g}"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{HIST_W}" height="{HIST_H}" role="img" aria-label="histogram">'
        + "".join(bars)
        + f'<text x="0" y="{HIST_H - 2}" font-size="10">{first}</text>'
        f'<text x="{HIST_W}" y="{HIST_H - 2}" font-size="10" text-anchor="end">{last}</text></svg>'
    )


def _spans(rec: dict[str, Any], vmax: float) -> list[dict[str, Any]]:
    """Each token's text, value, colour strength and marks; the tokens the pass left out
    (specials) are greyed, uncoloured."""
    out = []
    for i, (t, a) in enumerate(zip(rec["tokens"], rec["acts"])):
        off = rec.get("left_out", [False] * len(rec["tokens"]))[i]
        alpha = 0.0 if off or vmax <= 0 else min(1.0, max(0.0, a / vmax))
        out.append({"text": t, "act": a, "alpha": f"{alpha:.2f}", "top": i == rec["center"], "off": off})
    return out


def _columns(table: Any) -> dict[str, np.ndarray]:
    return {n: table.column(n).to_numpy(zero_copy_only=False) for n in table.column_names}


def build_site(
    src: str,
    out: str | os.PathLike,
    *,
    store: ReaderLike | None = None,
    encoder: Encoder | None = None,
    tokenizer: str | None = None,
    unembedding: str | None = None,
    window: tuple[int, int] = context.DEFAULT_WINDOW,
    plot_examples: int = 200,
    progress: bool = False,
) -> Path:
    """Render the site of feature-pass output `src` into folder `out`; returns index.html.

    Args:
        src: the folder or URL that `actstore features` wrote.
        out: the site folder (created; files in it are replaced).
        store: the store, a Reader or its path or URL (default: the one meta.json names, opened).
        encoder: the encoder (default: reloaded from meta.json's source, checksum checked).
        tokenizer: a tokenizer folder or id overriding the store's (text stores).
        unembedding: W_U (.npy or safetensors) for logit tables of the decoder directions.
        plot_examples: examples read for the plots page (token norms; 0: no plots).
    """
    meta = read_meta(src)
    store = _open(meta, store)
    if encoder is None:
        encoder = encoder_from_meta(meta, store)
    layer = int(meta["layer"])
    top = _columns(read_table(src, TOP))
    feats = _columns(read_table(src, FEATURES))
    ivs = _columns(read_table(src, INTERVALS))
    is_image = bool(store.config.attrs.get("image"))
    tok = None if is_image else context.load_tokenizer(store, tokenizer)
    logits_of = None
    if unembedding is not None and encoder.W_dec is not None and tok is not None:
        W_U = context.load_unembedding(unembedding, encoder.d_in)
        logits_of = lambda f: context.logit_table(encoder.W_dec[f], W_U, tok)  # noqa: E731
    out = Path(out)
    (out / "f").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    env = _env()
    title = f"Features of layer {layer}"
    ctx_top = _contexts(store, layer, encoder, top, tok, window, out, feats, "t")
    ctx_iv = _contexts(store, layer, encoder, ivs, tok, window, out, feats, "i")
    page = env.get_template("feature.html")
    by_feature_top = _group(top["feature"])
    by_feature_iv = _group(ivs["feature"])
    rows = []
    n_f = len(feats["feature"])
    bar = _bar(progress, n_f)
    for j in range(n_f):
        f = int(feats["feature"][j])
        fd = {c: (feats[c][j] if c != "histogram" else None) for c in feats}
        tops = [ctx_top[i] | {"rank": int(top["rank"][i])} for i in by_feature_top.get(f, [])]
        intervals = []
        for i in by_feature_iv.get(f, []):
            key = int(ivs["interval"][i])
            if not intervals or intervals[-1]["key"] != key:
                intervals.append(
                    {
                        "key": key,
                        "lo": float(ivs["lo"][i]),
                        "hi": float(ivs["hi"][i]),
                        "exact": bool(ivs["exact"][i]),
                        "rows": [],
                    }
                )
            intervals[-1]["rows"].append(ctx_iv[i])
        prev_f = int(feats["feature"][j - 1]) if j else None
        next_f = int(feats["feature"][j + 1]) if j + 1 < n_f else None
        html = page.render(
            title=title,
            f=fd,
            prev_f=prev_f,
            next_f=next_f,
            top=tops,
            intervals=intervals,
            histogram=histogram_svg(np.asarray(feats["histogram"][j]), meta["histogram_edges"]),
            logits=logits_of(f) if logits_of else None,
        )
        _put(out / "f" / f"{f}.html", html)
        first = tops[0] if tops else {}
        text = "".join(first.get("tokens", [])) if first.get("tokens") else ""
        rows.append([f, float(fd["max"]), float(fd["density"]), float(fd["mean_active"]), text])
        if bar is not None:
            bar(1)
    if plot_examples:
        from actstore.features.plots import write_plots

        write_plots(store, out / "plots", layers=[layer], max_examples=plot_examples)
    return write_index(out, rows, meta, title=title, plots=bool(plot_examples))


def write_index(out: Path, rows: list[list[Any]], meta: dict[str, Any], *, title: str, plots: bool = False) -> Path:
    """index.html, style.css and data/index.js (rows: [feature, max, density, mean_active,
    top example text]); the page draws PER_PAGE rows at a time."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    _put(out / "data" / "index.js", "window.ACTSTORE_FEATURES = " + json.dumps(rows, separators=(",", ":")) + ";\n")
    _put(out / "style.css", (Path(__file__).with_name("templates") / "base.css").read_text())
    index = (
        _env()
        .get_template("index.html")
        .render(title=title, meta=meta | {"k": meta["options"]["k"]}, per_page=PER_PAGE, plots=plots)
    )
    _put(out / "index.html", index)
    return out / "index.html"


def encoder_from_meta(meta: dict[str, Any], store: Reader) -> Encoder:
    """The pass's encoder, reloaded from the source meta.json names (its checksum must match)."""
    from actstore.features import sources

    e = meta["encoder"]
    enc = sources.from_meta(e, int(store.d_model))
    if e.get("kind") == "neurons":
        return enc
    if enc.source.get("sha256") != e.get("sha256"):
        raise FeatureError(
            f"{e['path']} changed since the pass (sha256 {enc.source.get('sha256')}, meta.json has {e.get('sha256')}): rerun `actstore features`"
        )
    return enc


def _open(meta: dict[str, Any], store: ReaderLike | None) -> Reader:
    """`store` as a Reader, or (None) the store the pass's meta.json names, opened."""
    if store is not None:
        return as_reader(store)
    from actstore.opener import open as open_store

    return open_store(meta["store"]["path"])


def _group(col: np.ndarray) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, f in enumerate(col.tolist()):
        out.setdefault(f, []).append(i)
    return out


def _contexts(
    store: Reader,
    layer: int,
    enc: Encoder,
    rows: dict[str, np.ndarray],
    tok: Any,
    window: tuple[int, int],
    out: Path,
    feats: dict[str, np.ndarray],
    tag: str,
) -> list[dict[str, Any]]:
    """The context record of every row: token spans (text) or a heatmap file (ViT)."""
    vmax = dict(zip(feats["feature"].tolist(), feats["max"].tolist()))
    if tok is not None:
        recs = context.text_windows(store, layer, enc, rows, tok, window=window)
        return [r | {"spans": _spans(r, vmax[r["feature"]])} for r in recs]
    from actstore.features.images import heatmap_png

    (out / "img").mkdir(exist_ok=True)
    recs = []
    for i in range(len(rows["feature"])):
        f, ex = int(rows["feature"][i]), int(rows["example"][i])
        name = f"img/{tag}{f}-{i}.png"
        width = heatmap_png(store, layer, enc, f, ex, out / name, vmax=vmax[f])
        recs.append(
            {
                "feature": f,
                "example": ex,
                "token": int(rows["token"][i]),
                "activation": float(rows["activation"][i]),
                "image": name,
                "width": width,
            }
        )
    return recs


def _put(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a page is whole or absent


def _bar(progress: bool, total: int) -> Any:
    if not progress:
        return None
    from actstore.progress import bar

    return bar(total=total, desc="pages", unit="page", file=sys.stderr).update
