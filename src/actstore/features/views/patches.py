"""Per-patch activations of many (feature, example) pairs of a ViT store at once, as sparse
arrays: each example is read and encoded once for the features of all its rows (as
actstore.features.views.windows does for text), and only the non-zero values of each pair's
patches are kept (float16, as the site writes them: a ReLU or TopK latent is zero on most
patches; a neuron is not, and keeps every value).

Patch p of the (grid_h, grid_w) grid is token `prefix + p` of the example (row-major: row
p // grid_w, column p % grid_w); the prefix tokens (CLS, registers) are not patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.dtypes import f32_to_f16
from actstore.errors import FeatureError
from actstore.features.encoders.encoder import Encoder
from actstore.features.views.windows import one_blas_thread
from actstore.progress import updater
from actstore.read.api import Reader


@dataclass(frozen=True)
class Patches:
    """The patch grids of the distinct (feature, example) pairs of some rows.

    Attributes:
        grid: (grid_h, grid_w) patches.
        prefix: tokens before the first patch (CLS, registers).
        feature, example: (m,) the pairs, sorted by feature then example.
        pair: (n,) each row's pair.
        nz_pair, nz_patch: (nnz,) where the non-zero values are, sorted by pair then patch.
        nz_value: (nnz,) float16 the values.
    """

    grid: tuple[int, int]
    prefix: int
    feature: np.ndarray
    example: np.ndarray
    pair: np.ndarray
    nz_pair: np.ndarray
    nz_patch: np.ndarray
    nz_value: np.ndarray

    @property
    def n_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    def dense(self, a: int, b: int) -> np.ndarray:
        """(b - a, n_patches) float16 grids of pairs a..b-1 (zeros filled in)."""
        out = np.zeros((b - a, self.n_patches), np.float16)
        s, e = np.searchsorted(self.nz_pair, [a, b])
        out[self.nz_pair[s:e] - a, self.nz_patch[s:e]] = self.nz_value[s:e]
        return out


def image_geometry(store: Reader) -> tuple[tuple[int, int], int]:
    """((grid_h, grid_w), prefix tokens) from the store's image attrs."""
    im = store.config.attrs.get("image")
    if not im:
        raise FeatureError(f"{store.path} holds no image activations (no 'image' attrs)")
    gh, gw = (int(x) for x in im["grid"])
    return (gh, gw), int(im["prefix_tokens"])


def patch_values(
    store: Reader,
    layer: int,
    encoder: Encoder,
    features: np.ndarray,
    examples: np.ndarray,
    *,
    progress: Any = None,
) -> Patches:
    """The patch grids of the pairs (features[i], examples[i]) of ViT `layer`.

    Args:
        progress: True for a bar on stderr, or a callable taking the examples done.
    """
    (gh, gw), prefix = image_geometry(store)
    n_p = gh * gw
    features = np.asarray(features, np.int64)
    examples = np.asarray(examples, np.int64)
    span = int(examples.max()) + 1 if len(examples) else 1
    codes, pair = np.unique(features * span + examples, return_inverse=True)
    feat, ex = codes // span, codes % span
    by_ex = np.argsort(ex, kind="stable")
    bounds = np.flatnonzero(np.diff(ex[by_ex])) + 1
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    bar = updater(progress, len(bounds) + 1 if len(codes) else 0, "patches", "example")
    with one_blas_thread():  # an example's matmul is small: BLAS threads would only wait on each other
        for grp in np.split(by_ex, bounds) if len(codes) else []:
            e = int(ex[grp[0]])
            acts = np.asarray(store[e, layer], np.float32)
            if acts.shape[0] != prefix + n_p:
                raise FeatureError(
                    f"example {e} has {acts.shape[0]} tokens; the image attrs promise {prefix} + {gh}x{gw} patches"
                )
            values = f32_to_f16(encoder.encode(acts[prefix:], feat[grp], feature_major=True))  # (pairs, patches)
            i, p = np.nonzero(values.view(np.uint16) & 0x7FFF)  # != 0 in integers (float16 compares are slow)
            parts.append((grp[i], p, values[i, p]))
            if bar is not None:
                bar(1)
    if parts:
        nz_pair = np.concatenate([x[0] for x in parts])
        nz_patch = np.concatenate([x[1] for x in parts])
        nz_value = np.concatenate([x[2] for x in parts])
    else:
        nz_pair, nz_patch, nz_value = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float16)
    order = np.argsort(nz_pair, kind="stable")  # a pair's patches are in order already (one example's nonzero)
    return Patches(
        grid=(gh, gw),
        prefix=prefix,
        feature=feat,
        example=ex,
        pair=pair.reshape(-1),
        nz_pair=nz_pair[order],
        nz_patch=nz_patch[order],
        nz_value=nz_value[order],
    )
