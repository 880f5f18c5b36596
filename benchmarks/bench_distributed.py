"""Distributed capture benchmark (issue 14): the same store written by 1, 2 and 4 writers.

A tiny ViT built from a config (so that the writers, not the model, are measured) runs over
--examples random images; `actstore write` (actstore.capture.write) writes the store with
--workers 1, 2 and 4 (local processes; `--runner ray` for Ray actors). Each configuration
reports its throughput (examples/s over the writers' capture time, model loading excluded,
and over the wall time, everything included) and the throughput per writer against one
writer in the same run. The configurations alternate --repeats times; medians are reported.

Run: .venv/bin/python benchmarks/bench_distributed.py [--examples N] [--workers 1,2,4]
     [--runner local|ray] [--repeats R] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402


def make_model(folder: Path, d_model: int, layers: int) -> Path:
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    cfg = Dinov2Config(
        hidden_size=d_model,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * d_model,
        image_size=56,
        patch_size=14,
    )
    Dinov2Model(cfg).eval().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        '{"image_processor_type": "BitImageProcessor", "do_resize": true, "size": {"shortest_edge": 56}, '
        '"do_center_crop": true, "crop_size": {"height": 56, "width": 56}, "do_normalize": true, '
        '"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "do_rescale": true, "rescale_factor": 0.00392156862745098}'
    )
    return folder


def make_images(folder: Path, n: int) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(folder / f"img{i:05d}.png")
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=1200)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--runner", choices=["local", "ray"], default="local")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--model-layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="Scratch folder (default: a temporary folder).")
    args = ap.parse_args()
    from actstore.capture import CaptureOptions, write

    scratch = Path(tempfile.mkdtemp(prefix="bench-dist-", dir=args.dir))
    try:
        model = make_model(scratch / "vit", args.d_model, args.model_layers)
        data = make_images(scratch / "images", args.examples)
        counts = [int(x) for x in args.workers.split(",")]
        runs: dict[int, list[dict]] = {k: [] for k in counts}
        for rep in range(args.repeats):
            for k in counts:
                out = scratch / f"s-{k}-{rep}.store"
                s = write(
                    CaptureOptions(
                        store=str(out),
                        model=str(model),
                        data=str(data),
                        layers=tuple(range(args.model_layers)),
                        batch_size=16,
                        workers=k,
                        runner=args.runner,
                        progress=False,
                        threads=max(1, (os.cpu_count() or 1) // k),
                    )
                )
                runs[k].append({"capture_s": s["capture_seconds"], "wall_s": s["seconds"], "bytes": s["bytes"]})
                print(
                    f"  {k} writer(s), run {rep}: {s['written'] / s['capture_seconds']:.0f} ex/s capturing, "
                    f"{s['written'] / s['seconds']:.0f} ex/s wall",
                    flush=True,
                )
                shutil.rmtree(out)
        n = args.examples
        one = statistics.median(n / r["capture_s"] for r in runs[counts[0]])
        rows = []
        for k in counts:
            rate = statistics.median(n / r["capture_s"] for r in runs[k])
            wall = statistics.median(n / r["wall_s"] for r in runs[k])
            rows.append(
                {
                    "writers": k,
                    "examples_per_s": rate,
                    "examples_per_s_wall": wall,
                    "per_writer_vs_one": rate / k / one,
                    "speedup_vs_one": rate / one,
                    "mb_per_s": rate * runs[k][0]["bytes"] / n / 2**20,
                }
            )
        print(
            f"\ndistributed capture ({args.runner}), {n} examples, d_model {args.d_model}, {args.model_layers} layers stored, "
            f"{os.cpu_count()} CPUs:"
        )
        print(f"{'writers':>8}{'ex/s':>10}{'ex/s wall':>11}{'MB/s':>8}{'speedup':>9}{'per writer':>12}")
        for r in rows:
            print(
                f"{r['writers']:>8}{r['examples_per_s']:>10.0f}{r['examples_per_s_wall']:>11.0f}{r['mb_per_s']:>8.1f}"
                f"{r['speedup_vs_one']:>8.2f}x{r['per_writer_vs_one']:>11.2f}x"
            )
        print(f"results: {save('distributed', {'runner': args.runner, 'examples': n, 'rows': rows, 'runs': runs})}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
