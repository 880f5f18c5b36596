"""The vision part of a site (`actstore view` of a ViT store): every image written once as a
thumbnail (actstore.features.views.thumbs), each feature's per-patch activations as data in its
record (actstore.features.views.patches), and feature-page.js draws the heatmaps over the
thumbnails on canvases, a grid of images per feature.

A feature record holds, besides the rows every site has:
- `images`: [[thumbnail number, image name], ...], the distinct images of its rows;
- `cols.im`: each row's image (a position in `images`);
- `cols.pv`: float16 patch values of each image, row-major over the patch grid, either dense
  (len(images) x grid_h x grid_w values) or, when fewer bytes, only the non-zero ones with
  `cols.pi` their flat positions (image * n_patches + patch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actstore.features.encoders.encoder import Encoder
from actstore.features.views import sitedata
from actstore.features.views.patches import patch_values
from actstore.features.views.sitedata import Rows
from actstore.features.views.thumbs import BUCKET, DEFAULT_SIZE, write_thumbnails
from actstore.read.api import Reader


class VisionPages:
    """The images and patch values of a site's rows, written into feature records."""

    def __init__(
        self,
        store: Reader,
        layer: int,
        encoder: Encoder,
        rows: Rows,
        stage: Path,
        *,
        thumb_size: int = DEFAULT_SIZE,
        progress: Any = None,
    ) -> None:
        self.rows = rows
        self.thumb_size = thumb_size
        self.patches = patch_values(store, layer, encoder, rows.feature, rows.example, progress=progress)
        self.thumbs = write_thumbnails(store, rows.example, stage, size=thumb_size, progress=progress)
        self.cls = bool(store.config.attrs.get("cls_token"))

    def meta(self) -> dict[str, Any]:
        """What the pages need to know of the images (data/meta.js's `image`)."""
        P = self.patches
        return {
            "grid": list(P.grid),
            "prefix": P.prefix,
            "cls": self.cls,
            "thumb": self.thumb_size,
            "bucket": BUCKET,
            "n_images": self.thumbs.n_files,
        }

    def where(self, token: int) -> str:
        """A row's place: the patch's (row, column), or the prefix token it is."""
        P = self.patches
        p = token - P.prefix
        if p < 0:
            return "CLS" if self.cls and token == 0 else f"prefix token {token}"
        return f"({p // P.grid[1]}, {p % P.grid[1]})"

    def record(self, rec: dict[str, Any], f: int, s: int, e: int) -> list[str]:
        """Feature f's images and patch values (rows s:e) into rec; returns the index snippet:
        its top row's image name and patch."""
        P, T = self.patches, self.thumbs
        a, b = (int(x) for x in np.searchsorted(P.feature, [f, f + 1]))
        at = T.of(P.example[a:b])
        rec["images"] = [[int(T.file[k]), T.name[k]] for k in at.tolist()]
        cols = rec["cols"]
        cols["im"] = sitedata.pack(P.pair[s:e] - a)
        n_s, n_e = (int(x) for x in np.searchsorted(P.nz_pair, [a, b]))
        flat = (P.nz_pair[n_s:n_e] - a) * P.n_patches + P.nz_patch[n_s:n_e]
        index_bytes = 2 if (b - a) * P.n_patches <= 1 << 15 else 4
        if (n_e - n_s) * (2 + index_bytes) < (b - a) * P.n_patches * 2:
            cols["pi"] = sitedata.pack(flat)
            cols["pv"] = sitedata.pack(P.nz_value[n_s:n_e], "<f2")
        else:
            cols["pv"] = sitedata.pack(P.dense(a, b).ravel(), "<f2")
        if e == s:
            return ["", "", ""]
        return ["", T.name[int(at[P.pair[s] - a])], " " + self.where(int(self.rows.token[s]))]
