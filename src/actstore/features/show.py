"""`actstore show` beyond one ViT image: a text example's tokens coloured by one dimension or
feature (an HTML page), and several ViT examples side by side on one colour scale (a PNG)."""

from __future__ import annotations

import html
import os
from pathlib import Path

import numpy as np

from actstore.features import context
from actstore.features.encoders import Encoder, neurons
from actstore.errors import FeatureError
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
    blue negative, one scale: the largest magnitude), the value on hover."""
    tok = context.load_tokenizer(store, tokenizer)
    ids = store.token_ids(ex)
    if ids is None:
        raise FeatureError(f"{store.path} keeps no token ids: showing text needs a store captured with token_ids")
    v = _values(store, ex, layer, encoder, feature)
    scale = float(np.abs(v).max()) or 1.0
    spans = []
    for t, a in zip(context.token_texts(tok, ids), v):
        a = float(a)
        rgb = "255,110,0" if a >= 0 else "30,110,255"
        spans.append(
            f'<span style="background: rgba({rgb},{abs(a) / scale:.2f})" title="{a:.4g}">{html.escape(t)}</span>'
        )
    what = "token L2 norm" if feature is None else f"{'dimension' if encoder is None else 'feature'} {feature}"
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>example {ex}</title></head>'
        '<body style="font-family: sans-serif">'
        f"<h1>Example {ex}, layer {layer}</h1><p>{html.escape(what)}; scale &plusmn;{scale:.4g}</p>"
        '<p style="font-family: monospace; white-space: pre-wrap; line-height: 1.7">'
        + "".join(spans)
        + "</p></body></html>\n"
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

    from actstore.features.show_image import colormap
    from actstore.features.images import heatmap

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
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    canvas.save(tmp, format="PNG")
    os.replace(tmp, out)  # never a half-written picture
    return out
