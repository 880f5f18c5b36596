"""What a saev export must hold, from the store it was made from (the saev tests share these)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def expected_rows(store, ex, layer, segments, cls):
    """The exported (T, D) float32 of (ex, layer): segments zero-padded to T_max, concatenated."""
    parts = []
    for name in segments:
        seg = store.segment(name)
        x = np.asarray(seg[ex, layer], dtype=np.float32)
        pad = np.zeros((seg.t_max, store.d_model), np.float32)
        pad[: len(x)] = x
        parts.append(pad)
    rows = np.concatenate(parts)
    return rows[1:] if cls == "drop" else rows


def expected_labels(store, segments, cls):
    cols = []
    for name in segments:
        lab = store.field(f"{name}_token_labels").astype(np.uint8)
        lens = store.field(f"{name}_len")
        cols.append(np.where(np.arange(lab.shape[1])[None] < lens[:, None], lab, 0))
    lab = np.concatenate(cols, axis=1)
    return lab[:, 1:] if cls in ("keep", "drop") else lab


def seed_read_vector(directory, ex, layer, token):
    """One vector read with seek + read at the offset of section 4.2 of the seed (no numpy maps)."""
    directory = Path(directory)
    md = json.loads((directory / "metadata.json").read_text())
    proto = md["protocol"]
    content = md["patches_per_ex"] if proto == "2.0" else md["content_tokens_per_example"]
    budget = md["patches_per_shard"] if proto == "2.0" else md["max_tokens_per_shard"]
    L, T, D = len(md["layers"]), content + (1 if md["cls_token"] else 0), md["d_model"]
    S = budget // (T * L)
    shard_idx, ex_in_shard = ex // S, ex % S
    layer_idx = md["layers"].index(layer)
    offset_in_bytes = ((ex_in_shard * L * T) + (layer_idx * T) + token) * D * 4
    with open(directory / f"acts{shard_idx:06d}.bin", "rb") as f:
        f.seek(offset_in_bytes)
        return np.frombuffer(f.read(D * 4), dtype="<f4")


def dir_files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}
