"""Image heatmaps: a feature's per-patch activations over the image a ViT saw, on one
colour scale given by the caller (a feature's max, so its examples compare), the top patch
outlined."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from actstore.features import context
from actstore.features.encoders import Encoder
from actstore.read.api import Reader

SCALE = 2  # drawn at twice the model's input size
ALPHA = 0.55  # weight of the heat colours over the image


def heatmap(rgb: np.ndarray, grid: np.ndarray, vmax: float, *, vmin: float = 0.0) -> Any:
    """A PIL image: `rgb` (size, size, 3) blended with `grid`'s colours on [vmin, vmax]."""
    from PIL import Image, ImageDraw

    from actstore.features.show_image import colormap

    size = rgb.shape[0] * SCALE
    span = vmax - vmin
    heat = colormap((grid - vmin) / span if span > 0 else np.zeros_like(grid))
    heat_img = Image.fromarray(heat).resize((size, size), Image.NEAREST)  # one block per patch
    base = Image.fromarray(rgb).resize((size, size), Image.BICUBIC)
    out = Image.blend(base, heat_img, ALPHA)
    gh, gw = grid.shape
    r, c = np.unravel_index(int(np.argmax(grid)), grid.shape)
    ph, pw = size / gh, size / gw
    ImageDraw.Draw(out).rectangle([c * pw, r * ph, (c + 1) * pw - 1, (r + 1) * ph - 1], outline=(0, 255, 0), width=2)
    return out


def heatmap_png(
    store: Reader, layer: int, enc: Encoder, feature: int, ex: int, path: str | os.PathLike, *, vmax: float
) -> int:
    """Write the heatmap of (feature, example) as a PNG; returns its width in pixels."""
    grid, im = context.patch_grid(store, layer, enc, feature, ex)
    rgb = context.image_pixels(store, ex, int(im["size"]))
    img = heatmap(rgb, grid, vmax)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    img.save(tmp, format="PNG")
    os.replace(tmp, path)  # never a half-written picture
    return img.width
