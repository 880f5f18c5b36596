"""`actstore show`: a PNG of per-patch activation norms laid over the image a ViT saw.

Every picture and page `show` writes records the store state it was drawn from (the store
and the sha256 of its manifest: PNG text chunks `actstore:store`, `actstore:manifest_sha256`;
an HTML page's meta tags of the same names), checked unchanged since the store was opened
(a store finalized again, replaced or deleted meanwhile is a StoreChangedError: nothing is
written)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actstore.errors import CaptureError
from actstore.read.state import check_unchanged
from actstore.storage.files import atomic_write

if TYPE_CHECKING:
    from actstore.read.interface import Reader
    from actstore.read.store import ActStore

# A perceptually ordered dark-to-bright map (inferno's anchors), interpolated to 256 steps.
_ANCHORS = np.array(
    [
        [0, 0, 4],
        [40, 11, 84],
        [101, 21, 110],
        [159, 42, 99],
        [212, 72, 66],
        [245, 125, 21],
        [250, 193, 39],
        [252, 255, 164],
    ],
    dtype=np.float64,
)
SCALE = 2  # the picture is drawn at twice the model's input size


def colormap(v01: np.ndarray) -> np.ndarray:
    """(…,) values in [0, 1] -> (…, 3) uint8 colours."""
    x = np.clip(v01, 0, 1) * (len(_ANCHORS) - 1)
    i = np.minimum(x.astype(int), len(_ANCHORS) - 2)
    f = (x - i)[..., None]
    return (_ANCHORS[i] * (1 - f) + _ANCHORS[i + 1] * f).astype(np.uint8)


def patch_norms(store: ActStore, ex: int, layer: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(grid_h, grid_w) L2 norms of the patch tokens, the prefix tokens' norms, image attrs."""
    im = store.config.attrs.get("image")
    if not im:
        raise CaptureError(
            f"{store.path} holds no image activations (no 'image' attrs); "
            "show draws stores written from a vision transformer, e.g. actstore write --model embedded:dinov2-s14"
        )
    acts = np.asarray(store[ex, layer], dtype=np.float32)
    gh, gw = im["grid"]
    prefix = int(im["prefix_tokens"])
    if acts.shape[0] != prefix + gh * gw:
        raise CaptureError(f"example {ex} has {acts.shape[0]} tokens; the attrs promise {prefix} + {gh}x{gw} patches")
    norms = np.linalg.norm(acts, axis=1)
    return norms[prefix:].reshape(gh, gw), norms[:prefix], im


def drawn_from(store: Reader) -> dict[str, str]:
    """The state a picture was drawn from, checked unchanged since `store` was opened."""
    return {"store": str(store.path), "manifest_sha256": check_unchanged(store, "`actstore show`") or ""}


def save_png(canvas: Any, out: Path, state: dict[str, str]) -> Path:
    """Write `canvas` as the PNG `out` whole (a temporary name, then a rename), with `state`
    as its text chunks `actstore:<key>`."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in state.items():
        info.add_text(f"actstore:{key}", value)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: canvas.save(tmp, format="PNG", pnginfo=info))  # never a half-written picture
    return out


def render(path: str | os.PathLike | ActStore, ex: int, layer: int | str, out: str | os.PathLike | None = None) -> Path:
    """Write the picture for (ex, layer) of the store at `path` (or an open ActStore);
    returns the PNG's path, which records the store state it was drawn from.

    Left: the image as the model saw it (resized, centre-cropped). Middle: per-patch L2
    norms of the activations over it. Right: the colour scale from min to max norm.
    """
    from PIL import Image, ImageDraw

    from actstore.inputs.data import load_image
    from actstore.inputs.prepare import crop_pixels
    from actstore.read.store import ActStore

    store = path if isinstance(path, ActStore) else ActStore(path)
    path = store.path
    layer = store.layer_number(layer)  # a number, -1 or a name (actstore.read.layers)
    grid, prefix_norms, im = patch_norms(store, ex, layer)
    sample = store.sample(ex)
    ref = sample.get("image")
    if not isinstance(ref, dict):
        raise CaptureError(f"example {ex} of {path} has no image reference (text field 'image')")
    size = int(im["size"])
    rgb = crop_pixels(load_image(ref), size)
    lo, hi = float(grid.min()), float(grid.max())
    heat = colormap((grid - lo) / (hi - lo) if hi > lo else np.zeros_like(grid))
    heat_img = Image.fromarray(heat).resize((size * SCALE, size * SCALE), Image.NEAREST)  # one block per patch
    base = Image.fromarray(rgb).resize((size * SCALE, size * SCALE), Image.BICUBIC)
    overlay = Image.blend(base, heat_img, 0.6)
    bar_w, pad, head = 24, 10, 34
    w = size * SCALE * 2 + bar_w + 70 + pad * 3
    h = size * SCALE + head + pad
    canvas = Image.new("RGB", (w, h), (255, 255, 255))
    canvas.paste(base, (pad, head))
    canvas.paste(overlay, (pad * 2 + size * SCALE, head))
    ramp = colormap(np.linspace(1, 0, size * SCALE))[:, None, :].repeat(bar_w, axis=1)
    bx = pad * 3 + size * SCALE * 2
    canvas.paste(Image.fromarray(ramp), (bx, head))
    draw = ImageDraw.Draw(canvas)
    draw.text((bx + bar_w + 4, head), f"{hi:.1f}", fill=(0, 0, 0))
    draw.text((bx + bar_w + 4, head + size * SCALE - 12), f"{lo:.1f}", fill=(0, 0, 0))
    cls = f", prefix token norms {', '.join(f'{v:.1f}' for v in prefix_norms)}" if len(prefix_norms) else ""
    draw.text(
        (pad, 4), f"{sample['sample_key']}  example {ex}  layer {layer}  ({store.config.model_id})", fill=(0, 0, 0)
    )
    what = store.config.attrs.get("hooks", {}).get(str(layer), f"layer {layer}")
    draw.text(
        (pad, 18),
        f"per-patch L2 norm of the output of {what}, {grid.shape[0]}x{grid.shape[1]} patches{cls}",
        fill=(0, 0, 0),
    )
    out_path = Path(out) if out is not None else Path(f"ex{ex}-layer{layer}.png")
    return save_png(canvas, out_path, drawn_from(store))
