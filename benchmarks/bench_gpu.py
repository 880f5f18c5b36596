"""Capture at the speed of the device (issue 32): record() against the forward pass alone and
against a raw write of the same bytes.

Two modes, one script:
- a model (default on CUDA): a random-init LlamaForCausalLM of a real model's shape
  (--shape 135m: SmolLM2-135M, 1.7b: SmolLM2-1.7B, tiny: for a CPU smoke run) in
  --model-dtype; "forward alone" is model.model over the same batches (the decoder,
  no LM head), "record" is actstore.record() of --layers into a fresh store;
- --replay: a module whose blocks hand over precomputed (B, T, D) tensors, so the forward
  costs nothing and the capture pipeline alone sets the pace: the GPU regime on any machine.

Each --dir (e.g. /dev/shm for tmpfs, a folder on the local disk) gets, per cell of
--model-dtype x --stats, --repeats pairs of (record, raw write of the same bytes: one
thread, 4 MiB writes, then fsync), alternating so that a pair shares the machine's load.
Headline per cell: the median of the pairs' ratios raw / record (1.0 = the medium's
bound), record / forward (model mode), and GB/s. Results: bench-results/gpu.json, written
after every cell (a run cut short keeps what it measured).

Run (CPU, replay):  python benchmarks/bench_gpu.py --replay --dir /dev/shm
Run (GPU):          python benchmarks/bench_gpu.py --shape 135m --batch-size 64 --seq-len 1024 --dir /dev/shm --dir /tmp
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `actstore write` sets it
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import save  # noqa: E402

import actstore  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "135m": (576, 30, 9, 3, 1536, 49152),
    "1.7b": (2048, 24, 32, 32, 8192, 49152),
    "tiny": (64, 4, 4, 2, 128, 256),
}


class ReplayBlock(torch.nn.Module):
    """A block that hands over a precomputed output (B, T, D): the forward costs nothing."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.register_buffer("out", out, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out


class ReplayModel(torch.nn.Module):
    """`layers` replay blocks (found at `layers`, as actstore's block lists are)."""

    def __init__(self, n_layers: int, b: int, t: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)
        outs = [(torch.randn(b, t, d, generator=g) * (1 + i)).to(dtype=dtype, device=device) for i in range(n_layers)]
        self.layers = torch.nn.ModuleList(ReplayBlock(o) for o in outs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = input_ids
        for blk in self.layers:
            h = blk(h)
        return h


def llama(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    d, n, heads, kv, inter, vocab = SHAPES[shape]
    cfg = LlamaConfig(
        hidden_size=d,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype=dtype, device=device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_alone(module: torch.nn.Module, batches: list, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids in batches:
            module(ids)
    sync(device)
    return time.perf_counter() - t0


def cpu_seconds() -> float:
    """CPU time of this process, every thread (user + system)."""
    t = os.times()
    return t.user + t.system


def raw_write(folder: Path, nbytes: int) -> float:
    """One thread writing `nbytes` to a new file in 4 MiB writes, then fsync: the medium's bound."""
    buf = memoryview(os.urandom(1 << 20) * 4)
    path = folder / "raw.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def capture(model, batches, folder: Path, layers: list[int], a, stats: bool):
    store = folder / f"s-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    res = actstore.record(
        model,
        batches,
        store,
        layers=layers,
        dtype=a.dtype,
        stats=stats,
        zarr_format=a.zarr_format,
        queue_size=a.queue_size,
        writer_threads=a.writer_threads,
        writer_nice=a.writer_nice,
    )
    dt = time.perf_counter() - t0
    shutil.rmtree(store)
    return dt, res


def run_cell(a, model_dtype: str, stats: bool, folder: Path, device: str) -> dict:
    dtype = getattr(torch, model_dtype)
    b, t = a.batch_size, a.seq_len
    g = torch.Generator().manual_seed(1)
    if a.replay:
        d = a.d_model
        model = ReplayModel(len(a.layers_list), b, t, d, dtype, device)
        layers = list(range(len(a.layers_list)))
        trunk = None
        vocab = 100
    else:
        model = llama(a.shape, dtype, device)
        d, n_blocks, vocab = SHAPES[a.shape][0], SHAPES[a.shape][1], SHAPES[a.shape][5]
        layers = [x if x >= 0 else n_blocks + x for x in a.layers_list]
        trunk = model.model
    batches = [torch.randint(0, vocab, (b, t), generator=g).to(device) for _ in range(a.batches)]
    capture(model, batches, folder, layers, a, stats)  # warm up: kernels, and the buffers a long capture reuses
    recs, raws, fwds, results, cpu_rec, cpu_raw = [], [], [], [], [], []
    for _ in range(a.repeats):
        if trunk is not None:
            fwds.append(forward_alone(trunk, batches, device))
        c0 = cpu_seconds()
        dt, res = capture(model, batches, folder, layers, a, stats)
        cpu_rec.append(cpu_seconds() - c0)
        recs.append(dt)
        results.append(res)
        c0 = cpu_seconds()
        raws.append(raw_write(folder, res.nbytes))
        cpu_raw.append(cpu_seconds() - c0)
    nbytes = results[0].nbytes
    tokens = a.batches * b * t
    cell = {
        "dir": str(folder),
        "model_dtype": model_dtype,
        "stored_dtype": a.dtype,
        "stats": stats,
        "layers": layers,
        "d_model": d,
        "bytes": nbytes,
        "record_s": recs,
        "raw_s": raws,
        "forward_s": fwds,
        "record_GBps": nbytes / statistics.median(recs) / 1e9,
        "raw_GBps": nbytes / statistics.median(raws) / 1e9,
        "ratio_raw_over_record": statistics.median(r / c for r, c in zip(raws, recs)),
        "record_cpu_s": cpu_rec,  # every thread of the process (a loaded machine's wall times vary more)
        "raw_cpu_s": cpu_raw,
        "cpu_ratio_raw_over_record": statistics.median(r / c for r, c in zip(cpu_raw, cpu_rec)),
        "record_tokens_per_s": tokens / statistics.median(recs),
        "writer_cpu_s": [r.writer_cpu_seconds for r in results],
        "wait_s": [r.wait_seconds for r in results],
        "load_average": os.getloadavg(),
    }
    if fwds:
        cell["forward_tokens_per_s"] = tokens / statistics.median(fwds)
        cell["record_over_forward"] = statistics.median(c / f for c, f in zip(recs, fwds))
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replay", action="store_true", help="Blocks that hand over precomputed tensors (no model).")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="135m", help="Llama shape (model mode).")
    ap.add_argument("--d-model", type=int, default=576, help="Replay: the width (SmolLM2-135M's by default).")
    ap.add_argument("--device", default=None, help="Default: cuda when available, else cpu.")
    ap.add_argument(
        "--model-dtype", default=None, help="Comma-separated (default: bfloat16 on CUDA; replay float16,bfloat16)."
    )
    ap.add_argument("--stats", default="on,off", help="Statistics on, off, or both (on,off).")
    ap.add_argument("--dtype", default="float16", help="Stored dtype.")
    ap.add_argument("--layers", default="7,14,21,-1", help="Recorded blocks (replay: their count).")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", action="append", default=None, help="Where the stores go (repeatable; default /dev/shm).")
    ap.add_argument("--zarr-format", type=int, default=3)
    ap.add_argument("--queue-size", type=int, default=2)
    ap.add_argument("--writer-threads", type=int, default=None)
    ap.add_argument(
        "--writer-nice",
        type=int,
        default=0,
        help="The writer threads' priority drop (record()'s default 10 yields to a model on the CPU; 0 here: "
        "the raw write it is compared with runs at normal priority, and on a shared machine nice threads wait)",
    )
    a = ap.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.layers_list = [int(x) for x in a.layers.split(",")]
    dtypes = (a.model_dtype or ("float16,bfloat16" if a.replay else "bfloat16")).split(",")
    stats_on = [s == "on" for s in a.stats.split(",")]
    dirs = [Path(x) for x in (a.dir or ["/dev/shm"])]
    card = torch.cuda.get_device_name() if device.startswith("cuda") else None
    result = {
        "command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:]),
        "mode": "replay" if a.replay else f"llama {a.shape}",
        "device": device,
        "card": card,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "batches": a.batches,
        "torch_threads": torch.get_num_threads(),
        "cells": [],
    }
    for base in dirs:
        folder = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=base))
        try:
            for md in dtypes:
                for st in stats_on:
                    cell = run_cell(a, md, st, folder, device)
                    result["cells"].append(cell)
                    path = save("gpu", result)
                    line = (
                        f"{base} {md}->{a.dtype} stats {'on ' if st else 'off'}: record {cell['record_GBps']:.2f} GB/s, "
                        f"raw {cell['raw_GBps']:.2f} GB/s, ratio {cell['ratio_raw_over_record']:.2f}x "
                        f"(CPU time {cell['cpu_ratio_raw_over_record']:.2f}x)"
                    )
                    if "record_over_forward" in cell:
                        line += (
                            f"; forward {cell['forward_tokens_per_s']:,.0f} tok/s, record {cell['record_tokens_per_s']:,.0f} "
                            f"tok/s ({cell['record_over_forward']:.2f}x the forward)"
                        )
                    print(line + f"  [load {cell['load_average'][0]:.1f}]", flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
