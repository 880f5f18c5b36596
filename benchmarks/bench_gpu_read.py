"""Reading at the speed of the GPU (issue 33): one prepared command for a CUDA machine, whose
CPU parts also run here (CI runs them at a tiny size).

- train: a TopK SAE (F = --expansion x d_model latents, k = --k, batches of --batch) for one
  epoch of a store of --tokens tokens, fed by `TokenStream(..., device=DEV).loader(W)`
  against the same steps on batches already on the device (sliced from one resident
  tensor), interleaved, per d_model in --d-models: ratio = loader-fed / resident time
  (target <= 1.03 on a GPU);
- loader alone: a warm epoch of `TokenStream(...).loader(num_workers=W)` per W in --workers
  (CPU batches; tokens/s and GB/s of the stored float16; target: W = 8 at least W = 0's rate,
  >= 2 GB/s on the GPU machine);
- features: `top_activations` over the store's layer for a sparse ReLU encoder of F in
  --features (bias -2: about 2 % active), with the update on the GPU (kernel "torch") over
  all tokens, and on the CPU (numba) over --cpu-feature-tokens tokens (tokens/s;
  target on a GPU: 1M tokens x 9,216 <= 2.5 s, x 32,768 <= 10 s);
- follow: a writer thread commits --follow-blocks blocks while a `TokenStream.follow()`
  reads them: seconds from each commit to the block being read (target <= 1 s);
- worker bytes (`--worker-bytes`, this part alone): `TokenStream(..., normalize="standardize")
  .loader(num_workers=1)` over two layers of a float16 store with statistics: the bytes
  per batch that cross shared memory from the worker (the tensors the main process
  receives), warm-epoch tokens/s, and the largest difference from the same epoch read in
  the main process (W = 0). Runs against any actstore on PYTHONPATH (before/after).
Each part's results are saved as they come (bench-results/gpu_read.json).

On the GPU machine (see ../shared/notes/gpu-facts.md for the wheels to carry):
    PYTHONPATH=WHEELS:src python benchmarks/bench_gpu_read.py --dir /dev/shm
Here (CPU only): python benchmarks/bench_gpu_read.py --tokens 65536 --d-models 64 --features 512 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

import actstore  # noqa: E402
from actstore.features import Encoder, top_activations  # noqa: E402
from actstore.torch import TokenStream  # noqa: E402

SEQ = 128  # tokens per example


def make_store(path: Path, n_tokens: int, d: int) -> actstore.ActStore:
    rng = np.random.default_rng(0)
    n = max(1, n_tokens // SEQ)
    block = rng.standard_normal((64, 1, SEQ, d)).astype(np.float16)
    with actstore.ShardWriter(path, layers=[6], d_model=d, tokens=SEQ, stats=False) as w:
        for s in range(0, n, 64):
            b = min(64, n - s)
            w.append(np.roll(block[:b], s % 7, axis=-1))  # cheap to make, different per block
    actstore.finalize(path)
    return actstore.open(path)


class TopKSAE(torch.nn.Module):
    def __init__(self, d: int, f: int, k: int):
        super().__init__()
        self.k = k
        self.W_enc = torch.nn.Parameter(torch.randn(d, f) / d**0.5)
        self.b_enc = torch.nn.Parameter(torch.zeros(f))
        self.W_dec = torch.nn.Parameter(self.W_enc.detach().t().clone())
        self.b_dec = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
        top = torch.topk(pre, self.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, top.indices, top.values) @ self.W_dec + self.b_dec


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train_epoch(batches, sae: TopKSAE, opt: torch.optim.Optimizer, dev: torch.device) -> tuple[float, int]:
    sync(dev)
    t0, n = time.perf_counter(), 0
    for x in batches:
        x = x.float()
        loss = (sae(x) - x).pow(2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += len(x)
    sync(dev)
    return time.perf_counter() - t0, n


def bench_train(store, dev: torch.device, args, workers: int) -> dict:
    d = int(store.d_model)
    torch.manual_seed(0)
    sae = TopKSAE(d, args.expansion * d, args.k).to(dev)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
    stream = TokenStream(store, batch_size=args.batch, seed=0, device=dev if dev.type == "cuda" else None)
    loader = stream.loader(num_workers=workers, **({"multiprocessing_context": "fork"} if workers else {}))
    resident = torch.cat([x.to(dev) for x in TokenStream(store, batch_size=args.batch, seed=0)])  # on the device
    slices = lambda: (resident[i : i + args.batch] for i in range(0, len(resident), args.batch))  # noqa: E731
    train_epoch(loader, sae, opt, dev)  # warm: kernels, page cache, the loader's workers
    train_epoch(slices(), sae, opt, dev)
    fed, res = [], []
    for _ in range(args.repeats):
        fed.append(train_epoch(loader, sae, opt, dev)[0])
        res.append(train_epoch(slices(), sae, opt, dev)[0])
    ratios = [f / r for f, r in zip(fed, res)]
    return {
        "d_model": d,
        "features": args.expansion * d,
        "workers": workers,
        "tokens": len(resident),
        "loader_fed_s": fed,
        "resident_s": res,
        "ratio_median": statistics.median(ratios),
    }


def bench_loader_alone(store, workers: list[int], args) -> list[dict]:
    out = []
    row_bytes = int(store.d_model) * 2
    for w in workers:
        loader = TokenStream(store, batch_size=args.batch, seed=0).loader(
            num_workers=w, **({"multiprocessing_context": "fork"} if w else {})
        )
        for _ in loader:  # warm: the workers start, the store's files are mapped
            pass
        times, main_cpu = [], []
        for _ in range(args.repeats):
            c0, t0, n = time.process_time(), time.perf_counter(), 0
            for x in loader:
                n += len(x)
            times.append(time.perf_counter() - t0)
            main_cpu.append(time.process_time() - c0)  # this process's threads (the workers are others)
        t = statistics.median(times)
        out.append(
            {
                "workers": w,
                "tokens_per_s": n / t,
                "GB_per_s": n * row_bytes / t / 1e9,
                "epoch_s": times,
                "main_cpu_s": main_cpu,
            }
        )
        print(f"  loader alone W={w}: {n / t / 1e6:.2f}M tokens/s ({n * row_bytes / t / 1e9:.2f} GB/s)", flush=True)
    return out


def bench_features(store, dev: torch.device, args) -> list[dict]:
    d = int(store.d_model)
    out = []
    for F in args.features:
        rng = np.random.default_rng(2)
        W = (rng.standard_normal((d, F)) / np.sqrt(d)).astype(np.float32)
        enc = Encoder(kind="directions", d_in=d, n_features=F, W=W, b=np.full(F, -2.0, np.float32), activation="relu")
        row = {"features": F}
        if dev.type == "cuda":
            top_activations(store, 6, enc, k=20, device=str(dev), features=f"0-{min(F, 64) - 1}")  # warm
            sync(dev)
            t0 = time.perf_counter()
            top_activations(store, 6, enc, k=20, device=str(dev))
            sync(dev)
            row["gpu_s"] = time.perf_counter() - t0
            row["gpu_tokens"] = len(store) * SEQ
            print(f"  features F={F} on {dev}: {row['gpu_s']:.2f} s for {row['gpu_tokens']} tokens", flush=True)
        n_ex = max(1, min(len(store), args.cpu_feature_tokens // SEQ))
        sub = _head(store, n_ex)
        top_activations(sub, 6, enc, k=20, device="cpu", features="0-63")  # warm the compiled kernels
        t0 = time.perf_counter()
        top_activations(sub, 6, enc, k=20, device="cpu")
        row["cpu_s"], row["cpu_tokens"] = time.perf_counter() - t0, n_ex * SEQ
        row["cpu_tokens_per_s"] = row["cpu_tokens"] / row["cpu_s"]
        print(f"  features F={F} on the CPU: {row['cpu_tokens_per_s']:,.0f} tokens/s", flush=True)
        out.append(row)
    return out


def _head(store, n: int):
    """The first n examples of a store as a store (a copy: the CPU pass runs on a part)."""
    if n >= len(store):
        return store
    path = Path(tempfile.mkdtemp(prefix="head-", dir=Path(store.path).parent)) / "s"
    with actstore.ShardWriter(path, layers=[6], d_model=int(store.d_model), tokens=SEQ, stats=False) as w:
        for s in range(0, n, 64):
            w.append(np.stack([store[e, 6] for e in range(s, min(n, s + 64))])[:, None])
    actstore.finalize(path)
    return actstore.open(path)


def bench_follow(root: Path, d: int, blocks: int, gap_s: float) -> dict:
    """Seconds from each commit of a writer thread to the block being read by a follow stream."""
    path = root / "follow"
    commits: list[float] = []

    def writer():
        rng = np.random.default_rng(0)
        with actstore.ShardWriter(path, layers=[6], d_model=d, tokens=SEQ, stats=False) as w:
            for _ in range(blocks):
                w.append(rng.standard_normal((8, 1, SEQ, d)).astype(np.float16))
                w.commit()
                commits.append(time.monotonic())
                time.sleep(gap_s)
        actstore.finalize(path)

    t = threading.Thread(target=writer)
    t.start()
    fs = TokenStream.follow(path, batch_size=256, buffer_bytes=8 * SEQ * d * 2, poll_s=0.1)
    n = sum(len(x) for x in fs)
    t.join()
    first_read = {}
    for shard, lo, hi, when in fs.blocks_read:
        first_read.setdefault(lo // 8, when)
    lat = [first_read[i] - commits[i] for i in range(blocks) if i in first_read]
    return {"blocks": blocks, "tokens": n, "latency_s": lat, "max_s": max(lat), "median_s": statistics.median(lat)}


def bench_worker_bytes(root: Path, d: int, args) -> dict:
    """Bytes per batch a TokenLoader worker sends with normalize= (see the docstring)."""
    path = root / "wb"
    rng = np.random.default_rng(0)
    n = max(1, args.tokens // SEQ)
    with actstore.ShardWriter(path, layers=[3, 6], d_model=d, tokens=SEQ, stats=True) as w:
        for s in range(0, n, 64):
            b = min(64, n - s)
            w.append((rng.standard_normal((b, 2, SEQ, d)) * 2 + 1).astype(np.float16))
    actstore.finalize(path)
    store = actstore.open(path)

    def stream():
        return TokenStream(store, batch_size=args.batch, seed=0, normalize="standardize")

    ref = torch.cat(list(stream()))  # the main process's own epoch (W = 0)
    loader = stream().loader(num_workers=1, multiprocessing_context="fork")
    sent: list[int] = []
    received = loader._received

    def measure(item):  # what came through shared memory, before the main process's copy
        sent.append(sum(t.nbytes for t in _tensors_of(item)))
        return received(item)

    loader._received = measure
    got = torch.cat(list(loader))  # warm: the worker starts, the files are mapped
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        k = sum(len(x) for x in loader)
        times.append(time.perf_counter() - t0)
    out = {
        "d_model": d,
        "tokens": len(ref),
        "batch": args.batch,
        "bytes_per_batch": statistics.median(sent),
        "bytes_per_token": statistics.median(sent) / args.batch,
        "tokens_per_s": k / statistics.median(times),
        "epoch_s": times,
        "out_dtype": str(got.dtype),
        "max_abs_diff_vs_w0": float((got - ref).abs().max()),
    }
    print(
        f"  worker bytes d={d}: {out['bytes_per_batch']:,.0f} B per batch of {args.batch} "
        f"({out['bytes_per_token']:.1f} B/token), {out['tokens_per_s'] / 1e6:.2f}M tokens/s, "
        f"max |W1 - W0| {out['max_abs_diff_vs_w0']:.2e}",
        flush=True,
    )
    return out


def _tensors_of(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors_of(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--d-models", default="576,2048")
    ap.add_argument("--expansion", type=int, default=16)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--workers", default="0,4,8,12")
    ap.add_argument("--train-workers", default="0,8", help="loader workers of the loader-fed training ('': none)")
    ap.add_argument("--features", default="9216,32768")
    ap.add_argument("--cpu-feature-tokens", type=int, default=32768)
    ap.add_argument("--follow-blocks", type=int, default=8)
    ap.add_argument("--follow-gap", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker-bytes", action="store_true", help="only the worker-bytes part (per --d-models)")
    args = ap.parse_args()
    args.features = [int(x) for x in args.features.split(",") if x]
    dev = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    result: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "args": vars(args)}
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-read-", dir=args.dir))
    if args.worker_bytes:
        try:
            result["worker_bytes"] = [bench_worker_bytes(root, int(d), args) for d in args.d_models.split(",")]
            print(f"wrote {save('gpu_read_worker_bytes', result)}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    try:
        result["follow"] = bench_follow(root, 64, args.follow_blocks, args.follow_gap)
        print(f"follow: a block read {result['follow']['max_s']:.3f} s after its commit at most", flush=True)
        save("gpu_read", result)
        for d in (int(x) for x in args.d_models.split(",")):
            store = make_store(root / f"d{d}", args.tokens, d)
            part: dict = {"train": []}
            for w in (int(x) for x in args.train_workers.split(",") if x):
                r = bench_train(store, dev, args, w)
                part["train"].append(r)
                print(f"d_model {d}, W={w}: loader-fed / resident {r['ratio_median']:.3f}x", flush=True)
                save("gpu_read", result | {f"d{d}": part})
            part["loader_alone"] = bench_loader_alone(store, [int(x) for x in args.workers.split(",") if x], args)
            save("gpu_read", result | {f"d{d}": part})
            part["features"] = bench_features(store, dev, args)
            result[f"d{d}"] = part
            path = save("gpu_read", result)
            shutil.rmtree(root / f"d{d}", ignore_errors=True)
        print(f"wrote {path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
