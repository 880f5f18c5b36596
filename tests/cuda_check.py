"""TokenStream's device path on a CUDA machine (not collected by pytest: the test suite
runs on CPU-only torch; run this where `torch.cuda.is_available()`):

    PYTHONPATH=src python tests/cuda_check.py

Checks that batches delivered on the GPU (pinned buffers, non_blocking copies on a side
stream, conversion and normalisation there) equal the CPU stream's, also when the loop
keeps many batches alive and works slowly (a pinned buffer must never be refilled while
its copy runs), through DataLoader workers, and prints the rate."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import actstore
from actstore.torch import TokenStream


def build(root: Path) -> actstore.ActStore:
    rng = np.random.default_rng(0)
    with actstore.ShardWriter(
        root, shard=0, layers=[3, 7], d_model=256, segments={"prompt": 40, "response": 24}, stats=True
    ) as w:
        for _ in range(4):
            w.append(
                prompt=rng.standard_normal((50, 2, 40, 256)).astype(np.float32),
                response=rng.standard_normal((50, 2, 24, 256)).astype(np.float32),
                lengths={"prompt": rng.integers(0, 41, 50), "response": rng.integers(1, 25, 50)},
            )
    actstore.finalize(root)
    return actstore.ActStore(root)


def compare(store: actstore.ActStore, slow: bool = False, **kw) -> int:
    want = [b if isinstance(b, torch.Tensor) else b["acts"] for b in TokenStream(store, **kw)]
    want = [w.clone() for w in want]
    ts = TokenStream(store, device="cuda", **kw)
    kept = []
    for i, b in enumerate(ts):
        acts = b if isinstance(b, torch.Tensor) else b["acts"]
        assert acts.is_cuda and acts.dtype == want[i].dtype, (acts.device, acts.dtype)
        if slow:
            torch.cuda._sleep(2_000_000)  # a long kernel on the loop's stream before it reads the batch
            kept.append(acts)  # keep every batch alive: no buffer of a live batch may be reused
        got = acts.cpu()
        assert torch.allclose(got.float(), want[i].float(), rtol=1e-6, atol=1e-6), f"batch {i} differs ({kw})"
    for i, acts in enumerate(kept):
        assert torch.allclose(acts.cpu().float(), want[i].float(), rtol=1e-6, atol=1e-6), f"kept batch {i} changed"
    return len(want)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a machine with one")
    with tempfile.TemporaryDirectory() as d:
        store = build(Path(d) / "s")
        n = compare(store, batch_size=512, seed=1)
        compare(store, batch_size=512, seed=1, dtype=torch.float32)
        compare(store, batch_size=512, seed=2, normalize="standardize")  # per (layer, segment) keys on the device
        compare(store, batch_size=512, seed=3, normalize="scale", return_index=True, mmap=False)
        compare(store, batch_size=256, seed=4, slow=True, buffer_bytes=256 * 256 * 2 * 2)
        dl = TokenStream(store, batch_size=512, seed=1, device="cuda").loader(
            num_workers=2, multiprocessing_context="spawn"
        )
        cpu = [
            b.clone()
            for b in TokenStream(store, batch_size=512, seed=1).loader(num_workers=2, multiprocessing_context="spawn")
        ]
        got = list(dl)
        assert len(got) == len(cpu) and all(g.is_cuda and torch.equal(g.cpu(), c) for g, c in zip(got, cpu))
        ts = TokenStream(store, batch_size=4096, seed=0, device="cuda")
        for _ in ts:
            pass
        t0 = time.perf_counter()
        tokens = sum(len(b) for b in ts)
        torch.cuda.synchronize()
        print(
            f"cuda_check: OK ({n} batches compared per case); warm epoch to the GPU {tokens / (time.perf_counter() - t0) / 1e6:.2f}M tokens/s"
        )


if __name__ == "__main__":
    main()
