"""`actstore show` beyond one ViT image: a text example's tokens coloured by one dimension or
feature (an HTML page), and several ViT examples side by side on one colour scale (a PNG)."""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.encoders.encoder import Encoder, neurons
from actstore.features.views import context
from actstore.inputs.tokentext import TokenText
from actstore.read.api import Reader


def _values(store: Reader, ex: int, layer: int, encoder: Encoder | None, feature: int | None) -> np.ndarray:
    """Per stored token of (ex, layer): the feature's value, or the token's L2 norm when no
    feature is named."""
    x = np.asarray(store[ex, layer], np.float32)
    if feature is None:
        return np.linalg.norm(x, axis=1)
    enc = encoder or neurons(store.d_model)
    enc.check_input(int(store.d_model), f"layer {layer}")
    if not 0 <= feature < enc.n_features:
        raise FeatureError(f"feature must be in 0..{enc.n_features - 1}. Got {feature}.")
    return np.asarray(enc.encode(x, np.asarray([feature]))[:, 0])


SCALE_QUANTILE = 98  # without token kinds, the colour scale is this percentile of |value|
_CONTROLS = re.compile(
    "[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]"
)


def shown(text: str) -> str:
    """A token's text as HTML: escaped, every control, bidi and invisible character shown as
    a visible U+XXXX mark (never applied), newlines and tabs marked (as the site shows them)."""

    def mark(m: re.Match) -> str:
        code = f"U+{ord(m.group()):04X}"
        return f'<span class="ctl" title="{code}">{code}</span>'

    out = _CONTROLS.sub(mark, html.escape(text))
    return out.replace("\n", '<span class="nl">\u21b5</span>\n').replace("\t", '<span class="nl">\u2192</span>\t')


def colour_scale(values: np.ndarray, content: np.ndarray | None) -> tuple[float, str]:
    """(scale, how it was chosen): the largest |value| of the content tokens when the store
    says which tokens are special (a BOS outlier then sets nothing), else the 98th percentile
    of |value| (values beyond it take the full colour and are marked)."""
    v = np.abs(np.asarray(values, np.float64))
    if content is not None and content.any():
        return float(v[content].max()) or 1.0, "the largest |value| of the content tokens"
    if not len(v):
        return 1.0, "no tokens"
    return float(np.percentile(v, SCALE_QUANTILE)) or float(
        v.max()
    ) or 1.0, f"the {SCALE_QUANTILE}th percentile of |value|"


def text_html(
    store: Reader,
    ex: int,
    layer: int,
    *,
    encoder: Encoder | None = None,
    feature: int | None = None,
    tokenizer: str | None = None,
) -> str:
    """An HTML page of example `ex`'s tokens, each coloured by its value (orange positive,
    blue negative) on one scale set by the content tokens (colour_scale), the value on hover;
    special and template tokens are outlined and left out of the scale, and a mark shows
    where each segment (a prompt's response) begins. The tokens' text is the example's
    decoded text cut into pieces (actstore.inputs.tokentext): a character split across
    tokens shows on its last token, the tokens before it marked. Without a tokenizer, token ids."""
    from actstore.features.views.windows import left_out, token_labels

    tok, note = context.tokenizer_or_note(store, tokenizer)
    ids = store.token_ids(ex)
    if ids is None:
        raise FeatureError(f"{store.path} keeps no token ids: showing text needs a store captured with token_ids")
    v = _values(store, ex, layer, encoder, feature)
    labels = token_labels(store)
    special = left_out(store, labels, ex, len(ids)) if labels is not None else None
    scale, how = colour_scale(v, None if special is None else ~special)
    starts = {}
    o = 0
    for name, n in store.lengths(ex).items():
        starts[o] = name
        o += n
    spans = []
    pieces = TokenText(tok).pieces(ids)
    for i, (t, a) in enumerate(zip(pieces.text, v)):
        if i in starts and (i or len(starts) > 1):
            spans.append(
                f'<span class="seg" title="segment {html.escape(starts[i])} begins">{html.escape(starts[i])}</span>'
            )
        a = float(a)
        off = special is not None and bool(special[i])
        alpha = 0.0 if off else min(1.0, abs(a) / scale)
        rgb = "255,110,0" if a >= 0 else "30,110,255"
        part = bool(pieces.partial[i])
        cls = (
            "tk"
            + (" special" if off else "")
            + (" clip" if not off and abs(a) > scale else "")
            + (" part" if part else "")
        )
        title = f"{a:.4g} \u00b7 id {int(ids[i])}" + (" (special: left out of the scale)" if off else "")
        title += PART_TITLE if part else ""
        spans.append(
            f'<span class="{cls}" style="background: rgba({rgb},{alpha:.2f})" title="{title}">{shown(t)}</span>'
        )
    what = "token L2 norm" if feature is None else f"{'dimension' if encoder is None else 'feature'} {feature}"
    from actstore.features.views.show_png import drawn_from

    state = "".join(
        f'<meta name="actstore:{k}" content="{html.escape(v)}">' for k, v in drawn_from(store).items()
    )  # the state the page was drawn from
    css = (Path(__file__).with_name("static") / "style.css").read_text()
    notes = f'<p><span class="note">{html.escape(note)}</span></p>' if note else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{state}<title>example {ex}</title>'
        f"<style>{css}{SHOW_CSS}</style></head><body><header><h1>Example {ex}, layer {layer}</h1>"
        f'<p class="meta">{html.escape(what)}; colour scale &plusmn;{scale:.4g} ({how}); '
        f"{len(ids)} tokens of {html.escape(str(store.path))}</p>{notes}</header>"
        '<main><p class="ctx">' + "".join(spans) + "</p></main></body></html>\n"
    )


PART_TITLE = " (holds part of a character that shows on a later token)"
SHOW_CSS = (
    ".tk.special { outline: 1px dashed #98a2b3; color: #667085; }"
    ".tk.clip { box-shadow: inset 0 -3px 0 #b42318; }"
    ".seg { display: inline-block; margin: 0 4px; padding: 0 6px; border-left: 3px solid #175cd3; color: #175cd3;"
    " font: 600 11px system-ui, sans-serif; background: #eff8ff; }"
)


def images_png(
    store: Reader,
    exs: list[int],
    layer: int,
    out: str | os.PathLike,
    *,
    encoder: Encoder | None = None,
    feature: int | None = None,
) -> Path:
    """Several ViT examples side by side, their per-patch values (a feature, or the norm) on
    one colour scale [min, max] over all of them, with a colour bar."""
    from PIL import Image, ImageDraw

    from actstore.features.views.heatmaps import heatmap
    from actstore.features.views.show_png import colormap

    im = store.config.attrs.get("image")
    if not im:
        raise FeatureError(f"{store.path} holds no image activations (no 'image' attrs)")
    prefix, (gh, gw), size = int(im["prefix_tokens"]), im["grid"], int(im["size"])
    grids = [_values(store, ex, layer, encoder, feature)[prefix:].reshape(gh, gw) for ex in exs]
    lo = float(min(g.min() for g in grids))
    hi = float(max(g.max() for g in grids))
    tiles = [heatmap(context.image_pixels(store, ex, size), g - lo, hi - lo) for ex, g in zip(exs, grids)]
    w, pad, bar_w, head = tiles[0].width, 8, 20, 24
    canvas = Image.new("RGB", (len(tiles) * (w + pad) + bar_w + 60, w + head + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (ex, t) in enumerate(zip(exs, tiles)):
        canvas.paste(t, (pad + i * (w + pad), head))
        draw.text((pad + i * (w + pad), 6), f"example {ex}", fill=(0, 0, 0))
    bx = pad + len(tiles) * (w + pad)
    canvas.paste(Image.fromarray(colormap(np.linspace(1, 0, w))[:, None, :].repeat(bar_w, axis=1)), (bx, head))
    draw.text((bx + bar_w + 4, head), f"{hi:.3g}", fill=(0, 0, 0))
    draw.text((bx + bar_w + 4, head + w - 12), f"{lo:.3g}", fill=(0, 0, 0))
    from actstore.features.views.show_png import drawn_from, save_png

    return save_png(canvas, Path(out), drawn_from(store))


def example_texts(store: Reader, n: int, *, tokenizer: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The first `n` examples as text (`actstore info --examples N`): per example its sample key
    and each segment's text, the example's decoded text cut at the segments' first tokens
    (token ids as [id] without a tokenizer, with the note that says so), or the text fields
    a store without token ids keeps; and the note."""
    from actstore.read.store import ActStore

    if n < 0:
        raise FeatureError(f"--examples must be >= 0. Got {n}.")
    tok, note = (None, None)
    if store.config.token_ids:
        tok, note = context.tokenizer_or_note(store, tokenizer)
    tt = TokenText(tok)
    out = []
    for ex in range(min(n, len(store))):
        rec: dict[str, Any] = {"example": ex}
        sample = store.sample(ex) if isinstance(store, ActStore) else {}
        if sample.get("sample_key"):
            rec["key"] = str(sample["sample_key"])
        if store.config.token_ids:
            ids = store.token_ids(ex)
            texts = tt.pieces(ids).text
            o = 0
            rec["segments"] = {}
            for name, k in store.lengths(ex).items():
                rec["segments"][name] = "".join(texts[o : o + k])
                o += k
        else:
            rec["texts"] = {k: v for k, v in sample.items() if k in store.config.texts}
        out.append(rec)
    return out, note
