"""The plots a researcher expects of a store (`actstore info STORE --plots DIR`, and the
site's plots page): the distribution of token norms per layer, and the mean norm by token
position (outliers at a window's start show). Plain SVG, no plotting library.

Norms are of the tokens the feature pass and the loaders read by default (every segment,
padding never read; in a text store whose labels mark token kinds, BOS, special and template
tokens are left out) of up to `max_examples` examples spread evenly over the store (all of
them when the store is smaller).
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

import numpy as np

from actstore.read.api import ReaderLike, as_reader
from actstore.storage.files import atomic_write_bytes

W, H, PAD = 560, 200, 34
N_BINS = 60
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def norm_stats(
    store: ReaderLike, *, layers: Any = None, max_examples: int = 1000, progress: Any = None
) -> dict[int, dict[str, np.ndarray]]:
    """Per layer: `norms` (every real token's L2 norm over the examples read), `position_mean`
    and `position_count` (by token position in `store[ex, layer]`). `store`: a Reader, or
    a store's path or URL; `progress`: True for a bar on stderr, or a callable taking the
    examples read."""
    from actstore.features.views.windows import left_out, token_labels
    from actstore.progress import updater

    store = as_reader(store)
    labels = token_labels(store)
    n = len(store)
    exs = (
        np.unique(np.linspace(0, n - 1, num=min(n, max_examples)).round().astype(np.int64))
        if n
        else np.zeros(0, np.int64)
    )
    out = {}
    layers = list(store.layers if layers is None else layers)
    bar = updater(progress, len(exs) * len(layers), "plots", "example")
    for layer in layers:
        norms, sums, counts = [], np.zeros(0), np.zeros(0, np.int64)
        for ex in exs:
            x = np.asarray(store[int(ex), layer], np.float32)
            v = np.linalg.norm(x, axis=1)
            keep = ~left_out(store, labels, int(ex), len(v))
            norms.append(v[keep])
            if len(v) > len(sums):
                sums = np.pad(sums, (0, len(v) - len(sums)))
                counts = np.pad(counts, (0, len(v) - len(counts)))
            sums[: len(v)] += np.where(keep, v, 0.0)
            counts[: len(v)] += keep
            if bar is not None:
                bar(1)
        allv = np.concatenate(norms) if norms else np.zeros(0, np.float32)
        out[int(layer)] = {
            "norms": allv,
            "position_mean": np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0),
            "position_count": counts,
        }
    return out


def _axes(title: str, xlab: str, x0: float, x1: float, y1: float) -> list[str]:
    return [
        f'<text x="{W / 2}" y="14" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 8}" y2="{H - PAD}" stroke="#333"/>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{PAD}" y2="22" stroke="#333"/>',
        f'<text x="{PAD}" y="{H - PAD + 14}" font-size="10">{x0:.3g}</text>',
        f'<text x="{W - 8}" y="{H - PAD + 14}" font-size="10" text-anchor="end">{x1:.3g}</text>',
        f'<text x="{W / 2}" y="{H - 6}" font-size="11" text-anchor="middle">{xlab}</text>',
        f'<text x="2" y="26" font-size="10">{y1:.3g}</text>',
    ]


def _svg(parts: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">'
        + "".join(parts)
        + "</svg>\n"
    )


def norms_svg(stats: dict[int, dict[str, np.ndarray]]) -> str:
    """Histograms (outlines, one colour a layer) of the token norms, on shared bins."""
    allv = [s["norms"] for s in stats.values() if len(s["norms"])]
    hi = float(max(v.max() for v in allv)) if allv else 1.0
    edges = np.linspace(0, hi if hi > 0 else 1.0, N_BINS + 1)
    hists = {layer: np.histogram(s["norms"], bins=edges)[0] for layer, s in stats.items()}
    top = max((int(h.max()) for h in hists.values() if len(h)), default=1) or 1
    parts = _axes("token L2 norm, per layer", "norm", 0, edges[-1], top)
    xs = PAD + (np.arange(N_BINS) + 0.5) / N_BINS * (W - PAD - 8)
    for i, (layer, h) in enumerate(hists.items()):
        _line(parts, i, layer, xs, H - PAD - h / top * (H - PAD - 22))
    return _svg(parts)


def positions_svg(stats: dict[int, dict[str, np.ndarray]]) -> str:
    """Mean token norm by position, one line a layer."""
    n_pos = max((len(s["position_mean"]) for s in stats.values()), default=1) or 1
    top = max((float(s["position_mean"].max()) for s in stats.values() if len(s["position_mean"])), default=1.0) or 1.0
    parts = _axes("mean token L2 norm by position", "token position", 0, n_pos - 1, top)
    for i, (layer, s) in enumerate(stats.items()):
        m = s["position_mean"]
        xs = PAD + np.arange(len(m)) / max(n_pos - 1, 1) * (W - PAD - 8)
        _line(parts, i, layer, xs, H - PAD - m / top * (H - PAD - 22))
    return _svg(parts)


def _line(parts: list[str], i: int, layer: Any, xs: np.ndarray, ys: np.ndarray) -> None:
    """Layer `layer`'s polyline (the i-th colour, its name on hover) and its legend entry."""
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    c = COLOURS[i % len(COLOURS)]
    parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}"><title>layer {layer}</title></polyline>')
    parts.append(
        f'<text x="{W - 10}" y="{30 + 12 * i}" font-size="10" text-anchor="end" fill="{c}">layer {layer}</text>'
    )


def write_plots(
    store: ReaderLike, out: str | os.PathLike, *, layers: Any = None, max_examples: int = 1000, progress: Any = None
) -> list[Path]:
    """norms.svg, positions.svg and plots.html (both) in folder `out`; returns their paths
    (`progress` as norm_stats takes it)."""
    store = as_reader(store)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stats = norm_stats(store, layers=layers, max_examples=max_examples, progress=progress)
    files = {"norms.svg": norms_svg(stats), "positions.svg": positions_svg(stats)}
    n_read = min(len(store), max_examples)
    n_tokens = sum(len(s["norms"]) for s in stats.values()) // max(len(stats), 1)
    from actstore.read.masks import leaves_out_special

    which = (
        "content tokens (BOS, special and template tokens left out, as the feature pass and the loaders read them)"
        if leaves_out_special(store)
        else "every real token (padding never read)"
    )
    css = (Path(__file__).with_name("static") / "style.css").read_text()
    files["plots.html"] = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>store plots</title>'
        f"<style>{css} img {{ border: 1px solid var(--line); border-radius: 6px; background: #fff; }}</style></head>"
        f'<body><header><h1>Token norms</h1><p class="meta">{html.escape(str(store.path))}: {n_read:,} of '
        f"{len(store):,} examples, spread evenly; {n_tokens:,} {which}.</p></header><main>"
        '<div class="row2"><div><h2>Distribution of token norms</h2><img src="norms.svg" alt="norms"></div>'
        '<div><h2>Mean norm by position</h2><img src="positions.svg" alt="norm by position"></div></div>'
        "</main></body></html>\n"
    )
    paths = []
    for name, text in files.items():
        p = out / name
        atomic_write_bytes(p, text.encode("utf-8"))
        paths.append(p)
    return paths
