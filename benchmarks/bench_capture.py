"""Capture benchmark (issue 3): forward-with-capture vs forward-alone on the same batches.

The batches (default: the embedded DINOv2-S/14 over the embedded images, repeated to
--examples) are prepared once into memory, so both runs see identical inputs:
- forward alone: the model's forward over every batch, no hooks (the whole model);
- forward with capture: actstore.record() of --layers (default every block, 0-11: the most
  bytes, and the last block, so stopping early saves only the final layer norm) into a
  fresh store, fp16, statistics on, including the writer's last commit and close.
The two alternate --repeats times; the headline is the median of the adjacent pairs'
ratios (capture / forward), which share the machine's background load.

Figures that show whether storage is the bottleneck, from the same capture runs: the time
the forward loop waited on the writer's queue, the writer thread's busy time per batch
against the forward time per batch, the bytes written and the write rate needed, and a
raw sequential write (+ fsync) of the same number of bytes for the disk's capacity.
Also reported: early stop (recording only the first half of the blocks).

Run: .venv/bin/python benchmarks/bench_capture.py [--model M] [--data D] [--examples N]
     [--batch-size B] [--layers 0-11] [--repeats R] [--dir DIR] [--zarr-format 3 --shard-examples S] [--pack N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `actstore write` sets it (see docs/capture.md)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import save  # noqa: E402

from actstore.capture import load_model, record  # noqa: E402
from actstore.inputs.budgets import text_plan  # noqa: E402
from actstore.inputs.data import load_source  # noqa: E402
from actstore.inputs.prepare import (  # noqa: E402
    TextPlan,  # noqa: E402
    image_batches,
    text_batches,
)


def parse_layers(s: str) -> list[int]:
    out: list[int] = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def prepare(args) -> tuple[object, list, int]:
    lm = load_model(args.model)
    src = load_source(args.data)
    idx = [i % len(src) for i in range(args.examples)]  # repeat the data to --examples
    from actstore.inputs.data import Source

    src = Source(kind=src.kind, name=src.name, n=len(idx), get=lambda i, g=src.get: g(idx[i]))
    if lm.modality == "image":
        batches = list(image_batches(src, 0, len(src), lm.image, args.batch_size, "cpu"))
    elif args.pack:  # a packed corpus: windows of exactly --pack tokens (actstore write --pack --context N)
        from actstore.inputs.packing import plan_windows, window_batches

        windows = plan_windows(src, lm.tokenizer, args.pack, "pack", window_bos=True)  # as actstore write --pack does
        batches = list(window_batches(src, windows, 0, len(windows), lm.tokenizer, args.batch_size, "cpu"))
        return lm, batches, len(windows)
    else:
        plan = text_plan(lm, src, TextPlan(kind=src.kind, p_max=args.p_max), p_max=args.p_max)
        batches = list(text_batches(src, 0, len(src), lm.tokenizer, plan, args.batch_size, "cpu", model=lm.model))
    return lm, batches, len(src)


def cpu_seconds() -> float:
    """CPU time of this process, every thread (user + system)."""
    t = os.times()
    return t.user + t.system


def forward_alone(lm, batches, module=None) -> tuple[float, float]:
    module = module or lm.forward
    c0, t0 = cpu_seconds(), time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            module(**b.inputs)
    return time.perf_counter() - t0, cpu_seconds() - c0


def trunk_of(lm):
    """The model without its head (a causal LM's decoder: every block and the final norm,
    no LM head), or None when the forward is already that. Capture of the last block stops
    before the head, so this is the stricter baseline for LLMs."""
    base = getattr(lm.forward, "base_model", None)
    return base if base is not None and base is not lm.forward else None


def capture(lm, batches, layers, root: Path | str, segments, layout: dict) -> tuple[float, float, object]:
    """One capture into a fresh store under `root` (a folder, or an s3:// URL)."""
    store = f"{root}/s-{time.monotonic_ns()}" if isinstance(root, str) else root / f"s-{time.monotonic_ns()}"
    c0, t0 = cpu_seconds(), time.perf_counter()
    res = record(lm, batches, store, layers=layers, segments=segments, stats=True, **layout)
    dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
    if isinstance(store, str):
        from actstore.storage import open_storage

        open_storage(store).delete_prefix("")
    else:
        shutil.rmtree(store)
    return dt, dc, res


def raw_write(root: Path, nbytes: int) -> float:
    buf = os.urandom(1 << 20) * 4
    path = root / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, len(buf))
            f.write(memoryview(buf)[:n])
            left -= n
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded:dinov2-s14")
    ap.add_argument("--data", default="embedded:images")
    ap.add_argument("--examples", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--layers", default="0-11")
    ap.add_argument("--p-max", type=int, default=128, help="token budget for text models")
    ap.add_argument(
        "--pack",
        type=int,
        default=None,
        metavar="N",
        help="text models: capture the data packed into windows of N tokens (as --pack --context N)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dir", default=None, help="where to put the temporary stores (default: a temp dir)")
    ap.add_argument(
        "--zarr-format", type=int, default=2, help="the stores' Zarr format (as actstore write --zarr-format)"
    )
    ap.add_argument(
        "--shard-examples", type=int, default=None, help="with --zarr-format 3: examples per Zarr shard file"
    )
    ap.add_argument(
        "--s3", action="store_true", help="capture to s3:// on moto's S3 server (its own process, 127.0.0.1)"
    )
    args = ap.parse_args()
    if args.s3:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import s3server

        with s3server.moto_process() as endpoint:
            s3server.apply_env(s3server.s3_env(endpoint))
            run(args, f"s3://{s3server.create_bucket(endpoint)}/bench")
        return
    run(args, None)


def run(args, url: str | None) -> None:
    """The benchmark, capturing into local folders or (url) stores under an s3:// URL."""
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = parse_layers(args.layers)
    layout = {"zarr_format": args.zarr_format, "shard_examples": args.shard_examples}
    lm, batches, n = prepare(args)
    segments = None
    if lm.modality == "text":
        segments = {"tokens": args.pack or args.p_max}
        if args.pack:
            layout.update(token_labels=True, texts=("runs",))  # what actstore write --pack stores
    root = Path(tempfile.mkdtemp(prefix="bench-capture-", dir=args.dir))
    target = url or root
    try:
        forward_alone(lm, batches[:1])  # warm up (allocator, kernels)
        trunk = trunk_of(lm)
        fwd, cap, fwd_cpu, cap_cpu, results, trk = [], [], [], [], [], []
        for _ in range(args.repeats):
            dt, dc = forward_alone(lm, batches)
            fwd.append(dt)
            fwd_cpu.append(dc)
            if trunk is not None:
                trk.append(forward_alone(lm, batches, trunk)[0])
            dt, dc, res = capture(lm, batches, layers, target, segments, layout)
            cap.append(dt)
            cap_cpu.append(dc)
            results.append(res)
        half = layers[: max(1, len(layers) // 2)]
        early = [capture(lm, batches, half, target, segments, layout)[0] for _ in range(args.repeats)]
        nbytes = results[0].nbytes
        t_raw = raw_write(root, nbytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    f_med, c_med = statistics.median(fwd), statistics.median(cap)
    n_batches = len(batches)
    result = {
        "command": "python benchmarks/bench_capture.py " + " ".join(sys.argv[1:]),
        "model": lm.model_id,
        "data": args.data,
        "examples": n,
        "batch_size": args.batch_size,
        "layers": layers,
        "layout": layout,
        "store": "s3 (moto, 127.0.0.1)" if url else "local folder",
        "load_average": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "forward_seconds": fwd,
        "capture_seconds": cap,
        "forward_median_s": f_med,
        "capture_median_s": c_med,
        "ratio_capture_over_forward": c_med / f_med,
        "ratio_min_over_min": min(cap) / min(fwd),
        "pair_ratios": [c / f for c, f in zip(cap, fwd)],
        "ratio_median_of_pairs": statistics.median(c / f for c, f in zip(cap, fwd)),
        "forward_cpu_seconds": fwd_cpu,
        "capture_cpu_seconds": cap_cpu,
        "cpu_ratio_capture_over_forward": statistics.median(cap_cpu) / statistics.median(fwd_cpu),
        "examples_per_s_capture": n / c_med,
        "tokens_per_layer": results[0].tokens,
        "bytes_written": nbytes,
        "write_rate_needed_MBps": nbytes / c_med / 1e6,
        "raw_sequential_write_MBps": nbytes / t_raw / 1e6,
        "queue_wait_seconds": [r.wait_seconds for r in results],
        "writer_busy_seconds": [r.writer_seconds for r in results],
        "writer_busy_ms_per_batch": statistics.median(r.writer_seconds for r in results) / n_batches * 1e3,
        "writer_cpu_ms_per_batch": statistics.median(r.writer_cpu_seconds for r in results) / n_batches * 1e3,
        "forward_ms_per_batch": f_med / n_batches * 1e3,
        "early_stop_layers": half,
        "early_stop_seconds": early,
        "early_stop_ratio_over_forward": statistics.median(early) / f_med,
        "trunk_forward_seconds": trk,
        "ratio_median_of_pairs_over_trunk": statistics.median(c / t for c, t in zip(cap, trk)) if trk else None,
    }
    path = save("capture", result)
    print(
        f"{lm.model_id}: {n} examples, batch {args.batch_size}, layers {args.layers}, layout {layout}, {result['store']}, {torch.get_num_threads()} torch threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}\n"
        f"  forward alone      {f_med:7.2f} s  (median of {[round(x, 2) for x in fwd]})\n"
        f"  forward + capture  {c_med:7.2f} s  (median of {[round(x, 2) for x in cap]})\n"
        f"  ratio: median of adjacent pairs {result['ratio_median_of_pairs']:.3f}, of medians {c_med / f_med:.3f}, "
        f"of best runs {min(cap) / min(fwd):.3f}; CPU time {result['cpu_ratio_capture_over_forward']:.3f}\n"
        f"  queue wait         {max(result['queue_wait_seconds']):.3f} s at most; writer busy "
        f"{result['writer_busy_ms_per_batch']:.0f} ms per batch ({result['writer_cpu_ms_per_batch']:.0f} ms of CPU) vs forward {result['forward_ms_per_batch']:.0f} ms per batch\n"
        f"  bytes {nbytes / 1e6:.1f} MB: needed {result['write_rate_needed_MBps']:.1f} MB/s, raw disk write {result['raw_sequential_write_MBps']:.0f} MB/s\n"
        f"  early stop (layers {half[0]}-{half[-1]}): ratio {result['early_stop_ratio_over_forward']:.3f}\n"
        + (
            f"  forward without the head {statistics.median(trk):7.2f} s: capture / it, median of pairs "
            f"{result['ratio_median_of_pairs_over_trunk']:.3f}\n"
            if trk
            else ""
        )
        + f"  -> {path}"
    )


if __name__ == "__main__":
    main()
