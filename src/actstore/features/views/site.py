"""`actstore view`: a static site of a feature pass that scales to dictionaries of 100k+
latents. The pages are shipped with actstore (actstore/features/views/static: index.html,
feature.html, their scripts and style; nothing fetched from the internet, no build step);
a build writes only data (actstore.features.views.sitedata): one small script per feature, an
index of columns, the decoded vocabulary, and for a ViT store each image once
(actstore.features.views.sitevision: the pages draw the heatmaps). The pages work from file:// and any static host.

The build is staged beside the target and swapped in whole (actstore.features.staging): a
killed or out-of-space build leaves the old site as it was, and a second build into the same
folder is refused while one runs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.encoders.encoder import Encoder
from actstore.features.staging import staged_folder
from actstore.features.topk.passdata import PassData, check_store, load_pass, open_store_of
from actstore.features.topk.quality import DENSE_FRACTION
from actstore.features.views import context, relations, sitedata
from actstore.features.views.sitedata import KIND_INTERVAL, KIND_TOP, Rows, Vocab
from actstore.features.views.sitevision import VisionPages
from actstore.features.views.thumbs import DEFAULT_SIZE as DEFAULT_THUMB
from actstore.features.views.thumbs import parse_size
from actstore.features.views.windows import DEFAULT_WINDOW, n_examples, text_windows, window_pieces
from actstore.inputs.tokentext import TokenText
from actstore.progress import updater
from actstore.read.api import Reader, ReaderLike
from actstore.storage.durable import write_all

STATIC = Path(__file__).with_name("static")
ASSETS = ("index.html", "feature.html", "common.js", "index-page.js", "feature-page.js", "vision.js", "style.css")
DENSE = DENSE_FRACTION  # the index counts features active on more than this fraction of tokens as dense
KIND = "actstore view"
NO_IDS_NOTE = (
    "this store keeps no token ids: rows name the example and the token's position in it, and each token "
    "of a row's context shows as its position [N]; a store written with token ids (actstore write, or "
    "ShardWriter(token_ids=True) with the ids appended) shows text"
)


def build_site(
    src: Any,
    out: str | Path,
    *,
    store: ReaderLike | None = None,
    encoder: Encoder | None = None,
    tokenizer: str | None = None,
    unembedding: str | None = None,
    window: tuple[int, int] = DEFAULT_WINDOW,
    plot_examples: int = 200,
    neighbours: int = relations.N_NEIGHBOURS,
    overwrite: bool = False,
    on_store_change: str = "refuse",
    thumb_size: int = DEFAULT_THUMB,
    progress: bool = False,
) -> Path:
    """Write the site of feature-pass output `src` as folder `out`; returns its index.html.

    Args:
        src: the folder or URL that `actstore features` wrote.
        out: the site folder; an existing site is replaced only with `overwrite`.
        store: the store, a Reader or its path or URL (default: the one meta.json names).
        encoder: the encoder (default: reloaded from meta.json's source, checksum checked).
        tokenizer: a tokenizer overriding the store's: "embedded:smollm2-135m", a hub id
            in the local cache or a folder. Without one the pages show token ids.
        unembedding: W_U for the logit tables: "auto" (the store's model), a .npy, a
            safetensors file or a model folder.
        neighbours: decoder-cosine neighbours listed per feature (0: none computed).
        on_store_change: "refuse" or "warn" when the store is not the state the pass read.
        thumb_size: ViT stores: the side in pixels of each image's thumbnail (written once).
    """
    p = load_pass(src)
    st = open_store_of(p.meta, store)
    check_store(p.meta, st, on_store_change)
    if encoder is None:
        encoder = encoder_from_meta(p.meta, st)
    is_image = bool(st.config.attrs.get("image"))
    if is_image:
        parse_size(thumb_size)  # before any work
    tok, note = (None, None) if is_image else context.tokenizer_or_note(st, tokenizer)
    positions = not is_image and not st.config.token_ids  # (a ShardWriter store written without token ids)
    if positions:
        tok, note = None, NO_IDS_NOTE
    rows = sitedata.gather_rows(p)
    feats = p.features["feature"].astype(np.int64)
    logit = _logits(st, encoder, unembedding, feats, is_image)  # (before any work: a W_U that cannot apply fails now)
    with staged_folder(out, kind=KIND, overwrite=overwrite, source=st) as stage:
        for name in ASSETS:
            shutil.copyfile(STATIC / name, stage / name)
        tt = TokenText(tok)
        if is_image:
            images = VisionPages(
                st, int(p.meta["layer"]), encoder, rows, stage, thumb_size=thumb_size, progress=progress
            )
            wins, vocab = None, Vocab(np.zeros(0, np.int64), tt)
        else:
            bar = updater(progress, n_examples(rows.example), "examples", "example")
            wins = text_windows(
                st,
                p.meta["layer"],
                encoder,
                rows.feature,
                rows.example,
                rows.token,
                window=window,
                progress=bar,
                positions=positions,
            )
            images = None
        if wins is not None:
            extra = [] if logit is None else [logit.top_ids.ravel(), logit.bottom_ids.ravel()]
            vocab = Vocab(np.concatenate([wins.ids.ravel(), *extra]), tt)
        pieces = None
        if wins is not None:  # every row's text, its window decoded whole
            pieces = window_pieces(tt, wins, progress=updater(progress, len(rows), "windows decoded", "window"))
        rel = _relations(p, encoder, rows, wins, feats, neighbours, progress)
        pages = _FeaturePages(p, rows, wins, vocab, images, rel, logit, pieces)
        bar = updater(progress, len(feats), "features", "feature")
        index_text = []
        for b in np.unique(feats // sitedata.BUCKET).tolist():
            (stage / "data" / "f" / str(b)).mkdir(parents=True)
        with _Writer() as writer:  # files are created on other threads while the next records are made
            for j, f in enumerate(feats.tolist()):
                value, text = pages.record(j, f)
                writer.put(stage / sitedata.feature_path(f), sitedata.script("feature", value))
                index_text.append(text)
                if bar is not None:
                    bar(1)
        _write_data(stage, p, images, vocab, index_text, window, note, logit is not None, plot_examples)
        if plot_examples:
            from actstore.features.views.plots import write_plots

            write_plots(
                st, stage / "plots", layers=[int(p.meta["layer"])], max_examples=plot_examples, progress=progress
            )
    return Path(out) / "index.html"


def _write_data(
    stage: Path,
    p: PassData,
    images: VisionPages | None,
    vocab: Vocab,
    text: list[Any],
    window: Any,
    note: Any,
    logits: bool,
    plots: int,
) -> None:
    """data/meta.js, data/index.js and data/vocab.js."""
    c = p.features
    index = {
        "feature": c["feature"].tolist(),
        "max": [sitedata.short_float(v) for v in c["max"].tolist()],
        "density": c["density"].tolist(),
        "mean": [sitedata.short_float(v) for v in c["mean_active"].tolist()],
        "n_active": c["n_active"].tolist(),
        "text": text,
    }
    if p.has_negative:
        index |= {
            "min": [sitedata.short_float(v) for v in c["min"].tolist()],
            "density_neg": c["density_negative"].tolist(),
        }
    m = p.meta
    meta = {
        "title": f"Features of layer {m['layer']}",
        "store": str(m["store"]["path"]),
        "store_sha256": m["store"].get("sha256"),
        "layer": m["layer"],
        "encoder": {k: m["encoder"].get(k) for k in ("kind", "path", "n_features", "activation")},
        "n_features": p.n_features,
        "n_tokens": m.get("n_tokens"),
        "k": m.get("options", {}).get("k"),
        "sign": m.get("options", {}).get("sign", "positive"),
        "edges": m["histogram_edges"],
        "edges_negative": m.get("histogram_edges_negative"),
        "window": list(window),
        "note": note,
        "dense": DENSE,
        "logits": logits,
        "plots": bool(plots),
        "image": images.meta() if images is not None else False,
        "bucket": sitedata.BUCKET,
        "token_mask": m.get("masks", {}).get("token_mask"),
        "quality": m.get("quality"),  # an SAE's reconstruction quality (actstore.features.topk.quality)
    }
    (stage / "data").mkdir(exist_ok=True)
    for name, value in (("meta", meta), ("index", index), ("vocab", vocab.value())):
        (stage / "data" / f"{name}.js").write_text(sitedata.script(name, value), encoding="utf-8")


class _FeaturePages:
    """Each feature's record (data/f/...) and its index snippet, from the gathered arrays."""

    def __init__(
        self, p: PassData, rows: Rows, wins: Any, vocab: Vocab, images: Any, rel: dict, logit: Any, pieces: Any
    ) -> None:
        """`pieces`: each row's window as display pieces (None for an image store)."""
        self.p, self.rows, self.wins, self.vocab, self.pieces = p, rows, wins, vocab, pieces
        self.images, self.rel, self.logit = images, rel, logit
        feats = p.features["feature"].astype(np.int64)
        self.starts, self.ends = rows.bounds(feats)
        self.v = vocab.positions(wins.ids) if wins is not None else None
        self.ids_of = dict(zip(vocab.ids.tolist(), range(len(vocab.ids))))
        self.vbytes = sitedata.position_bytes(len(vocab.ids))

    def record(self, j: int, f: int) -> tuple[dict[str, Any], list[str]]:
        """Feature j's value and its index snippet."""
        p, r, s, e = self.p, self.rows, int(self.starts[j]), int(self.ends[j])
        rec: dict[str, Any] = {"f": f, "stats": sitedata.stats(p, j)}
        rec["hist"] = sitedata.histogram(p.features["histogram"][j])
        if p.has_negative:
            rec["hist_neg"] = sitedata.histogram(p.features["histogram_negative"][j])
        code = r.kind[s:e].astype(np.int64) * (1 << 22) + r.interval[s:e]
        starts = np.flatnonzero(np.concatenate([[True], code[1:] != code[:-1]])) if e > s else np.zeros(0, np.int64)
        groups = []
        for g0 in starts.tolist():
            i = s + g0
            g = {"kind": ("top", "bottom", "interval")[int(r.kind[i])], "sign": int(r.sign[i])}
            if r.kind[i] == KIND_INTERVAL:
                g |= {
                    "lo": sitedata.short_float(r.lo[i]),
                    "hi": sitedata.short_float(r.hi[i]),
                    "exact": bool(r.exact[i]),
                }
            groups.append(g)
        first = np.zeros(e - s, bool)
        first[starts] = True
        group_of = np.cumsum(first) - 1
        rec["groups"] = groups
        rec["cols"] = {  # packed arrays (sitedata.pack): the page decodes them once
            "g": sitedata.pack(group_of),
            "rank": sitedata.pack(r.rank[s:e]),
            "ex": sitedata.pack(r.example[s:e]),
            "tok": sitedata.pack(r.token[s:e]),
            "act": sitedata.pack(r.activation[s:e], "<f4"),
        }
        text = ["", "", ""]
        if self.wins is not None:
            text = self._windows(rec, s, e)
        elif self.images is not None:
            text = self.images.record(rec, f, s, e)
        for key in ("common", "nb", "co"):
            if f in self.rel.get(key, {}):
                rec[key] = self.rel[key][f]
        if "common" in rec:
            rec["common"] = [[self.ids_of.get(t, -1), n] for t, n in rec["common"]]
        if self.logit is not None:
            L = self.logit
            rec["logits"] = {
                "pos": [[self.ids_of[int(t)], sitedata.short_float(v)] for t, v in zip(L.top_ids[j], L.top_values[j])],
                "neg": [
                    [self.ids_of[int(t)], sitedata.short_float(v)] for t, v in zip(L.bottom_ids[j], L.bottom_values[j])
                ],
                "hist": [sitedata.short_float(L.lo[j]), sitedata.short_float(L.hi[j]), L.hist[j].tolist()],
            }
        return rec, text

    def _windows(self, rec: dict[str, Any], s: int, e: int) -> list[str]:
        """Windows of rows s:e into rec (vocab positions, integer activations, the tokens whose
        text is not their vocabulary default and the partial ones, left-out tokens, document
        keys); returns the index snippet of the feature's first row."""
        w = self.wins
        acts = w.acts[s:e]
        shown = np.abs(acts[~w.off[s:e]])  # left-out tokens (a BOS outlier) do not set the scale
        top = float(shown.max()) if shown.size else 0.0
        scale = top / sitedata.ACT_LEVELS if top > 0 else 1.0
        rec["scale"] = scale
        rec["width"] = int(w.ids.shape[1])
        levels = np.clip(np.rint(acts / scale), -32767, 32767)  # left-out outliers clip at 32x the scale
        cols = rec["cols"]
        cols["v"] = sitedata.pack(self.v[s:e].ravel(), "<i2" if self.vbytes == 2 else "<i4")
        cols["a"] = sitedata.pack(levels.ravel(), "<i2")
        rec["off"] = np.flatnonzero(w.off[s:e].ravel()).tolist()
        width, px, part = w.ids.shape[1], [], []
        for r in range(s, e):
            texts, partial = self.vocab.window(self.v[r], self.pieces[r])
            px += [[(r - s) * width + c, t] for c, t in texts]
            part += [(r - s) * width + c for c in partial]
        if px:
            rec["px"] = px
        if part:
            rec["part"] = part
        docs = w.doc[s:e].tolist()
        if any(d >= 0 for d in docs):
            local: dict[int, int] = {}
            cols["doc"] = sitedata.pack(np.array([-1 if d < 0 else local.setdefault(d, len(local)) for d in docs]))
            rec["keys"] = [w.keys[k] for k in local]
            if (w.doc_token[s:e] >= 0).any():
                cols["dt"] = sitedata.pack(w.doc_token[s:e])
        if e == s:
            return ["", "", ""]
        return sitedata.snippet(self.pieces[s], self.v[s], w.before)


def _relations(
    p: PassData, encoder: Encoder, rows: Rows, wins: Any, feats: np.ndarray, n_nb: int, progress: Any
) -> dict:
    """Per feature: decoder neighbours (nb), co-occurring features (co), common tokens (common)."""
    out: dict[str, dict[int, Any]] = {}
    if encoder.W_dec is not None and n_nb > 0 and len(feats) > 1:
        idx, cos = relations.neighbours(encoder.W_dec[feats], n_nb, progress=progress)
        out["nb"] = {
            int(f): [[int(feats[i]), round(float(c), 4)] for i, c in zip(idx[j], cos[j])] for j, f in enumerate(feats)
        }
    span = int(rows.token.max()) + 1 if len(rows) else 1
    pos = rows.example * span + rows.token
    top = rows.kind == KIND_TOP
    out["co"] = relations.cooccurring(rows.feature[top], pos[top], rows.feature, pos)
    if wins is not None:
        positive = rows.sign > 0
        out["common"] = relations.common_tokens(rows.feature[positive], wins.ids[positive, wins.before])
    return out


def _logits(st: Reader, encoder: Encoder, unembedding: Any, feats: np.ndarray, image: bool) -> Any:
    from actstore.features.views.logits import applicable_unembedding, load_unembedding, logit_tables

    unembedding = applicable_unembedding(unembedding, encoder, image)
    if unembedding is None:
        return None
    return logit_tables(encoder.W_dec[feats], load_unembedding(unembedding, encoder.d_in, st))


def encoder_from_meta(meta: dict[str, Any], store: Reader) -> Encoder:
    """The pass's encoder, reloaded from the source meta.json names (its checksum must match)."""
    from actstore.features.encoders import sources

    e = meta["encoder"]
    enc = sources.from_meta(e, int(store.d_model))
    if e.get("kind") == "neurons":
        return enc
    if enc.source.get("sha256") != e.get("sha256"):
        raise FeatureError(
            f"{e['path']} changed since the pass (sha256 {enc.source.get('sha256')}, meta.json has {e.get('sha256')}): rerun `actstore features`"
        )
    return enc


class _Writer:
    """Writes files in batches on a few threads while this one waits (creating a file is a
    syscall that releases the GIL; a site has one a feature). Writing while this thread
    computes would make each file wait for the GIL's switch interval. The first error is
    raised (the file named)."""

    THREADS = 4
    BATCH = 1024  # files held before a batch is written

    def __enter__(self) -> _Writer:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="site-write")
        self.pending: list[tuple[Path, str]] = []
        return self

    def put(self, path: Path, text: str) -> None:
        self.pending.append((path, text))
        if len(self.pending) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        parts = [self.pending[i :: self.THREADS] for i in range(self.THREADS)]
        self.pending = []
        for fut in [self.pool.submit(_write_all, part) for part in parts if part]:
            fut.result()

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                self.flush()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _write_all(files: list[tuple[Path, str]]) -> None:
    for path, text in files:
        _write(path, text)


def _write(path: Path, text: str) -> None:
    """One data file (os-level: a site has one per feature); an error names the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, (text.encode("utf-8"),))
        finally:
            os.close(fd)
    except OSError as e:
        e.filename = e.filename or str(path)
        raise
