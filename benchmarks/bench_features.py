"""Feature-pass benchmark (issue 24): `top_activations` against the bare cost of the same
work in the same run.

- neurons: the pass over one layer against a TokenStream epoch over the same layer (store
  order, the stored dtype): ratio = epoch seconds / pass seconds (target >= 0.7);
- SAE with F = --expansion x d_model latents: against the bare cost, a TokenStream epoch plus
  one torch matmul of the same tokens by W_enc in float32 (the encode's dtype);
- peak memory (tracemalloc, numpy's allocations) of the neurons pass at two corpus sizes,
  to show it grows with features x k, not with tokens;
- with --smollm2: against recomputing as SAEDashboard does (a forward pass of the embedded
  SmolLM2 over the corpus for every 128 features) for an SAE of --dash-features latents on
  a store of the same tokens (d_model 576): speedup = (F / 128) x forward seconds / pass seconds.
The store is synthetic: --examples x --tokens (one segment, float16, d_model --d-model).

The pass's fixed costs (the compiled kernels' load, filling the top-k and sample heaps: they
grow with features x (k + pool) x log(tokens), not with tokens) are warmed once on the
half-size store or amortised by a corpus of 4,000 x 128 tokens by default.

Run: .venv/bin/python benchmarks/bench_features.py [--examples 4000] [--tokens 128] [--d-model 256] [--expansion 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
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


def kernel_ns_per_value(d: int, threads: int | None, rows: int = 32768, batches: int = 16) -> float:
    """The float16 neurons update alone, past the heaps' filling: wall ns per value (best
    of 3), at `threads` threads (None: every core), to show how it divides over cores."""
    from actstore.features.topk.accum import FeatureAccumulator

    old = os.environ.get("ACTSTORE_FEATURE_THREADS")
    if threads is not None:
        os.environ["ACTSTORE_FEATURE_THREADS"] = str(threads)
    try:
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal((rows, d)).astype(np.float16) for _ in range(4)]
        ords = np.arange(rows, dtype=np.int64)
        acc = FeatureAccumulator(d, 20, 100, 0, kernel="numba")
        for i in range(8):
            acc.update(xs[i % 4].T, ords + i * rows)
        best, i = float("inf"), 8
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(batches):
                acc.update(xs[i % 4].T, ords + i * rows)
                i += 1
            best = min(best, (time.perf_counter() - t0) / batches / (rows * d) * 1e9)
        return best
    finally:
        if old is None:
            os.environ.pop("ACTSTORE_FEATURE_THREADS", None)
        else:
            os.environ["ACTSTORE_FEATURE_THREADS"] = old


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


def dashboard_speedup(root: Path, windows: int, t: int, F: int, k: int) -> dict:
    """One SmolLM2 forward over `windows` x `t` tokens (what SAEDashboard repeats per 128
    features), against our pass over a store of as many tokens at its width."""
    import torch

    from actstore.inputs.models import load_model

    lm = load_model("embedded:smollm2-135m")
    ids = torch.randint(0, lm.tokenizer.vocab_size, (windows, t))
    with torch.inference_mode():
        lm.model(ids[:4])  # warm
        t0 = time.perf_counter()
        for b in range(0, windows, 8):
            lm.model(ids[b : b + 8], output_hidden_states=True)
        fwd = time.perf_counter() - t0
    d = lm.model.config.hidden_size
    store = make_store(root / "dash", windows, t, d)
    rng = np.random.default_rng(2)
    sae = Encoder(
        kind="directions",
        d_in=d,
        n_features=F,
        W=(rng.standard_normal((d, F)) / np.sqrt(d)).astype(np.float32),
        b=np.full(F, -2.0, np.float32),
        activation="relu",
    )
    t_pass = timed(lambda: top_activations(store, 6, sae, k=k))
    return {
        "features": F,
        "tokens": windows * t,
        "forward_s": fwd,
        "recompute_s": fwd * F / 128,
        "pass_s": t_pass,
        "speedup": fwd * F / 128 / t_pass,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--expansion", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--smollm2", action="store_true", help="also measure the SAEDashboard-style recompute on the embedded SmolLM2"
    )
    ap.add_argument("--dash-features", type=int, default=4096)
    ap.add_argument(
        "--dash-windows", type=int, default=32, help="windows of --tokens tokens for the SmolLM2 comparison"
    )
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
        # b = -2: about 2.3% of latents active per token (an L0 near 47 of 2,048), as trained SAEs are sparse
        sae = Encoder(kind="directions", d_in=d, n_features=F, W=W, b=np.full(F, -2.0, np.float32), activation="relu")
        W_t = torch.from_numpy(W)
        stream_epoch(store)  # warm: page cache, imports
        for enc in (neurons(d), sae):  # and the compiled kernels' one-time load (numba's cache: ~0.5 s)
            top_activations(small, 6, enc, k=args.top_k)
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
        kernel = {"1": kernel_ns_per_value(d, 1), "all": kernel_ns_per_value(d, None), "cores": os.cpu_count()}
        tokens = args.examples * args.tokens
        result = {
            "tokens": tokens,
            "d_model": d,
            "features_sae": F,
            "top_k": args.top_k,
            "runs": rows,
            "neurons_ratio_median": statistics.median(neuron_ratios),
            "sae_ratio_median": statistics.median(sae_ratios),
            "neurons_tokens_per_s": tokens / statistics.median(r["neurons_pass_s"] for r in rows),
            "sae_tokens_per_s": tokens / statistics.median(r["sae_pass_s"] for r in rows),
            "sae_density": float(top_activations(small, 6, sae, k=1).features["density"].mean()),
            "peak_bytes": peaks,
            "peak_growth_2x_tokens": peaks["full"] / peaks["half"],
            "neurons_kernel_ns_per_value": kernel,
            "machine": machine(),
        }
        if args.smollm2:
            result["saedashboard"] = dashboard_speedup(
                root, args.dash_windows, args.tokens, args.dash_features, args.top_k
            )
        path = save("features", result)
        print(
            f"neurons pass / TokenStream epoch: {result['neurons_ratio_median']:.2f}x "
            f"({result['neurons_tokens_per_s'] / 1e6:.2f} M tokens/s, d_model {d})"
        )
        print(
            f"SAE F={F} (density {result['sae_density']:.3f}) pass / (epoch + matmul): {result['sae_ratio_median']:.2f}x "
            f"({result['sae_tokens_per_s'] / 1e6:.3f} M tokens/s)"
        )
        print(
            f"neurons update alone: {kernel['1']:.2f} ns a value on 1 thread, {kernel['all']:.2f} on {kernel['cores']} cores"
        )
        print(
            f"peak traced memory: {peaks['half'] / 2**20:.1f} MiB at {tokens // 2} tokens, {peaks['full'] / 2**20:.1f} MiB at {tokens} "
            f"({result['peak_growth_2x_tokens']:.2f}x for 2x tokens); {path}"
        )
        if args.smollm2:
            dd = result["saedashboard"]
            print(
                f"SAEDashboard-style recompute, F={dd['features']}: {dd['recompute_s']:.1f} s vs pass {dd['pass_s']:.2f} s: {dd['speedup']:.0f}x"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
