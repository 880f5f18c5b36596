"""Feature-pass benchmark (issue 24): `top_activations` against the bare cost of the same
work in the same run.

- neurons: the pass over one layer against a TokenStream epoch over the same layer (store
  order, the stored dtype): ratio = epoch seconds / pass seconds (target >= 0.7);
- SAE with F = --expansion x d_model latents: against the bare cost, a TokenStream epoch plus
  one torch matmul of the same tokens by W_enc in float32 (the encode's dtype);
- peak memory (tracemalloc, numpy's allocations) of the neurons pass at two corpus sizes,
  to show it grows with features x k, not with tokens.
The store is synthetic: --examples x --tokens (one segment, float16, d_model --d-model).

Run: .venv/bin/python benchmarks/bench_features.py [--examples 1000] [--tokens 128] [--d-model 256] [--expansion 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save  # noqa: E402

import actstore  # noqa: E402
from actstore.features import Encoder, neurons, top_activations  # noqa: E402


def make_store(path: Path, n: int, t: int, d: int) -> actstore.ActStore:
    rng = np.random.default_rng(0)
    with actstore.ShardWriter(path, layers=[6], d_model=d, tokens=t) as w:
        for s in range(0, n, 64):
            b = min(64, n - s)
            w.append(rng.standard_normal((b, 1, t, d)).astype(np.float16))
    actstore.finalize(path)
    return actstore.open(path)


def stream_epoch(store, *, matmul=None) -> float:
    import torch

    from actstore.loaders import TokenStream

    t0 = time.perf_counter()
    for batch in TokenStream(store, layers=6, shuffle=False, batch_size=4096, threads=2):
        if matmul is not None:
            batch.float() @ matmul
    return time.perf_counter() - t0 if torch else 0.0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_bytes(store, k: int) -> int:
    tracemalloc.start()
    top_activations(store, 6, neurons(store.d_model), k=k)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--expansion", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    import torch

    root = Path(tempfile.mkdtemp(prefix="bench-features-", dir=args.dir))
    try:
        d = args.d_model
        store = make_store(root / "s", args.examples, args.tokens, d)
        small = make_store(root / "half", args.examples // 2, args.tokens, d)
        rng = np.random.default_rng(1)
        F = args.expansion * d
        W = (rng.standard_normal((d, F)) / np.sqrt(d)).astype(np.float32)
        sae = Encoder(kind="directions", d_in=d, n_features=F, W=W, b=np.full(F, -0.5, np.float32), activation="relu")
        W_t = torch.from_numpy(W)
        stream_epoch(store)  # warm: page cache, imports
        neuron_ratios, sae_ratios, rows = [], [], []
        for _ in range(args.repeats):
            t_stream = stream_epoch(store)
            t_neurons = timed(lambda: top_activations(store, 6, neurons(d), k=args.top_k))
            t_bare = stream_epoch(store, matmul=W_t)
            t_sae = timed(lambda: top_activations(store, 6, sae, k=args.top_k))
            neuron_ratios.append(t_stream / t_neurons)
            sae_ratios.append(t_bare / t_sae)
            rows.append({"stream_s": t_stream, "neurons_pass_s": t_neurons, "bare_sae_s": t_bare, "sae_pass_s": t_sae})
        peaks = {"half": peak_bytes(small, args.top_k), "full": peak_bytes(store, args.top_k)}
        tokens = args.examples * args.tokens
        result = {
            "tokens": tokens, "d_model": d, "features_sae": F, "top_k": args.top_k, "runs": rows,
            "neurons_ratio_median": statistics.median(neuron_ratios), "sae_ratio_median": statistics.median(sae_ratios),
            "neurons_tokens_per_s": tokens / statistics.median(r["neurons_pass_s"] for r in rows),
            "sae_tokens_per_s": tokens / statistics.median(r["sae_pass_s"] for r in rows),
            "peak_bytes": peaks, "peak_growth_2x_tokens": peaks["full"] / peaks["half"], "machine": machine(),
        }
        path = save("features", result)
        print(f"neurons pass / TokenStream epoch: {result['neurons_ratio_median']:.2f}x "
              f"({result['neurons_tokens_per_s'] / 1e6:.2f} M tokens/s, d_model {d})")
        print(f"SAE F={F} pass / (epoch + matmul): {result['sae_ratio_median']:.2f}x ({result['sae_tokens_per_s'] / 1e6:.2f} M tokens/s)")
        print(f"peak traced memory: {peaks['half'] / 2**20:.1f} MiB at {tokens // 2} tokens, {peaks['full'] / 2**20:.1f} MiB at {tokens} "
              f"({result['peak_growth_2x_tokens']:.2f}x for 2x tokens); {path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
