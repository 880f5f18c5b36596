"""Image heatmaps for `actstore show --ex A --ex B`: per-patch values over the image a ViT
saw, on one colour scale given by the caller (so its examples compare), the top patch
outlined. (A site draws its heatmaps in the browser: actstore.features.views.sitevision.)"""

from __future__ import annotations

from typing import Any

import numpy as np

SCALE = 2  # drawn at twice the model's input size
ALPHA = 0.55  # weight of the heat colours over the image


def heatmap(rgb: np.ndarray, grid: np.ndarray, vmax: float, *, vmin: float = 0.0) -> Any:
    """A PIL image: `rgb` (size, size, 3) blended with `grid`'s colours on [vmin, vmax]."""
    from PIL import Image, ImageDraw

    from actstore.features.views.show_png import colormap

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
