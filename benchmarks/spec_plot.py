"""The figure and tables of bench_spec.py's matrix: per (H, layout) a row of latency
heatmaps over R_max x T_chunk_prompt (prompt read, response read, batch assembly without
workers; p50, with the ratio to the memmap limit) and the write scaling curve (MB/s
against writer processes, actstore and raw files, median over the cells).

Run: .venv/bin/python benchmarks/spec_plot.py bench-results/spec.json  (figure + markdown tables)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _grid(rows: list[dict], metric: str, key: str, r_maxes: list[int], t_chunks: list[int]) -> np.ndarray:
    g = np.full((len(r_maxes), len(t_chunks)), np.nan)
    for x in rows:
        if x["metric"] == metric and (metric != "batch" or x["workers"] == 0):
            g[r_maxes.index(x["r_max"]), t_chunks.index(x["t_chunk"])] = x[key]
    return g


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(x["d_model"], x["layout"]) for x in rows})
    r_maxes = sorted({x["r_max"] for x in rows})
    t_chunks = sorted({x["t_chunk"] for x in rows})
    panels = (
        ("read_prompt", "p50_us", "ratio_p50", "prompt read p50 (us)"),
        ("read_response", "p50_us", "ratio_p50", "response read p50 (us)"),
        ("batch", "p50_us", "ratio_mean", "batch b x 2 layers, 0 workers, p50 (ms)"),
    )
    fig, axes = plt.subplots(len(groups), 4, figsize=(18, 3.6 * len(groups)), squeeze=False)
    for gi, (d, layout) in enumerate(groups):
        sub = [x for x in rows if x["d_model"] == d and x["layout"] == layout]
        for pi, (metric, key, ratio, title) in enumerate(panels):
            ax = axes[gi, pi]
            g = _grid(sub, metric, key, r_maxes, t_chunks)
            rg = _grid(sub, metric, ratio, r_maxes, t_chunks)
            scale = 1e-3 if metric == "batch" else 1.0
            im = ax.imshow(g * scale, cmap="viridis", aspect="auto")
            for i in range(len(r_maxes)):
                for j in range(len(t_chunks)):
                    if not np.isnan(g[i, j]):
                        ax.text(
                            j,
                            i,
                            f"{g[i, j] * scale:.3g}\n{rg[i, j]:.2f}x",
                            ha="center",
                            va="center",
                            color="w",
                            fontsize=9,
                        )
            ax.set_xticks(range(len(t_chunks)), [str(t) for t in t_chunks])
            ax.set_yticks(range(len(r_maxes)), [str(r) for r in r_maxes])
            ax.set_xlabel("T_chunk_prompt")
            ax.set_ylabel("R_max")
            ax.set_title(f"H={d} {layout}: {title}", fontsize=9)
            fig.colorbar(im, ax=ax)
        ax = axes[gi, 3]
        writes = [x for x in sub if x["metric"] == "write"]
        ws = sorted({x["writers"] for x in writes})
        for key, label in (("MBps", "actstore"), ("limit_MBps", "raw files")):
            ax.plot(ws, [np.median([x[key] for x in writes if x["writers"] == w]) for w in ws], marker="o", label=label)
        ax.set_xticks(ws)
        ax.set_xlabel("writer processes W")
        ax.set_ylabel("MB/s (median over cells)")
        ax.set_title(f"H={d} {layout}: write scaling", fontsize=9)
        ax.legend()
    fig.suptitle("bench_spec: p50 latency (ratio to np.memmap of the same bytes below each figure)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


def tables(rows: list[dict]) -> str:
    """Markdown: reads per T_chunk (prompt) and R_max (response), batches per workers,
    writes per W; medians over the other axis of the matrix."""
    med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    out = []
    for d, layout in sorted({(x["d_model"], x["layout"]) for x in rows}):
        sub = [x for x in rows if x["d_model"] == d and x["layout"] == layout]
        out.append(
            f"\n**H={d}, {layout}**\n\n| read | param | mean us | p50 us | p95 us | memmap p50 us | x memmap p50 | zarr-python p50 us |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
        )
        for metric, key in (("read_prompt", "t_chunk"), ("read_response", "r_max")):
            for v in sorted({x[key] for x in sub}):
                c = [x for x in sub if x["metric"] == metric and x[key] == v]
                out.append(
                    f"| {metric[5:]} | {key}={v} | {med([x['mean_us'] for x in c]):.0f} | {med([x['p50_us'] for x in c]):.0f} | "
                    f"{med([x['p95_us'] for x in c]):.0f} | {med([x['limit_p50_us'] for x in c]):.0f} | {med([x['ratio_p50'] for x in c]):.2f} | "
                    f"{med([x['zarr_python_p50_us'] for x in c]):.0f} |"
                )
        out.append(
            "\n| batch b x 2 layers | mean ms | p50 ms | p95 ms | batches/s | memmap, 1 process, mean ms |\n| --- | --- | --- | --- | --- | --- |"
        )
        for w in sorted({x["workers"] for x in sub if x["metric"] == "batch"}):
            c = [x for x in sub if x["metric"] == "batch" and x["workers"] == w]
            out.append(
                f"| {w} workers | {med([x['mean_us'] for x in c]) / 1e3:.2f} | {med([x['p50_us'] for x in c]) / 1e3:.2f} | "
                f"{med([x['p95_us'] for x in c]) / 1e3:.2f} | {med([x['batches_per_s'] for x in c]):.0f} | {med([x['limit_mean_us'] for x in c]) / 1e3:.2f} |"
            )
        out.append(
            "\n| writers W | actstore MB/s | raw MB/s | ratio (median of cells) | ratios per cell |\n| --- | --- | --- | --- | --- |"
        )
        for w in sorted({x["writers"] for x in sub if x["metric"] == "write"}):
            c = [x for x in sub if x["metric"] == "write" and x["writers"] == w]
            out.append(
                f"| {w} | {med([x['MBps'] for x in c]):.0f} | {med([x['limit_MBps'] for x in c]):.0f} | {med([x['ratio'] for x in c]):.2f} | "
                + ", ".join(f"{x['ratio']:.2f}" for x in c)
                + " |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    res = json.loads(Path(sys.argv[1]).read_text())
    print(f"figure: {plot(res['rows'], Path(sys.argv[1]).with_suffix('.png'))}")
    print(tables(res["rows"]))
