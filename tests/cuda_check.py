"""The CUDA paths, checked against the CPU paths on a CUDA machine (not collected by pytest:
the test suite runs on CPU-only torch; run this where `torch.cuda.is_available()`):

    PYTHONPATH=src python tests/cuda_check.py

TokenStream: batches delivered on the GPU (pinned buffers, non_blocking copies on a side
stream, conversion and normalisation there) equal the CPU stream's, also when the loop
keeps many batches alive and works slowly (a pinned buffer must never be refilled while
its copy runs), through DataLoader workers, and prints the rate.

Capture (actstore.record): a model on the GPU whose blocks hand over known tensors stores
exactly what the same model on the CPU stores (gather, cast, the pinned ring's copies),
with statistics within 1e-6 of the CPU's, also when the writer is slow (a ring slot must
never be refilled while it is being written), for padded segments (gather on the device),
clipped overflows, batches given on the CPU (moved to the model's device), and a real
Llama within float tolerance."""

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


class _Block(torch.nn.Module):
    """Hands over its precomputed output, for batch k the tensor k (a buffer on the device)."""

    def __init__(self, outs: torch.Tensor):
        super().__init__()
        self.register_buffer("outs", outs, persistent=False)
        self.k = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.outs[self.k % len(self.outs)]
        self.k += 1
        return out


class _Replay(torch.nn.Module):
    def __init__(self, outs: torch.Tensor):  # (layers, batches, b, t, d)
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(o) for o in outs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        assert input_ids.device == self.layers[0].outs.device, "record() did not move the batch"
        h = input_ids
        for blk in self.layers:
            h = blk(h)
        return h


def _capture(device: str, outs: torch.Tensor, batches: list, root: Path, **kw) -> actstore.ActStore:
    model = _Replay(outs.to(device))
    actstore.record(model, batches, root, layers=list(range(len(outs))), **kw)
    actstore.finalize(root)
    return actstore.ActStore(root)


def _same_stores(a: actstore.ActStore, b: actstore.ActStore, what: str) -> None:
    assert len(a) == len(b) and a.layers == b.layers, what
    for i in range(len(a)):
        for layer in a.layers:
            assert np.array_equal(a[i, layer], b[i, layer], equal_nan=True), f"{what}: example {i} layer {layer}"
    sa, sb = a.stats(), b.stats()
    if sa is not None:
        assert np.array_equal(sa.count, sb.count) and np.array_equal(sa.nonfinite, sb.nonfinite), what
        assert np.array_equal(sa.overflow, sb.overflow) and np.array_equal(sa.min, sb.min), what
        for f in ("mean", "m2"):
            x, y = getattr(sa, f), getattr(sb, f)
            assert np.linalg.norm(x - y) <= 1e-6 * np.linalg.norm(y), f"{what}: {f}"


def check_capture(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    n_batches, b, t, d = 6, 4, 24, 64
    outs = torch.randn(3, n_batches, b, t, d, generator=g) * 3 + 1
    outs[0, 2, 1, 3, 5] = 1e6  # beyond float16: clipped and counted with on_overflow="clip"
    ids = [torch.randint(0, 100, (b, t), generator=g) for _ in range(n_batches)]  # on the CPU: moved
    for dtype in ("float32", "bfloat16", "float16"):
        for kw in ({}, {"segments": {"tokens": 32}}, {"queue_size": 1, "progress": lambda *a: time.sleep(0.05)}):
            name = f"{dtype} {sorted(kw)}"
            masks = [torch.ones(b, t, dtype=torch.long) for _ in ids]
            if "segments" in kw:
                for m in masks:
                    m[:, t - int(torch.randint(1, t, (1,), generator=g)) :] = 0
            batches = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, masks)]
            out = outs.to(getattr(torch, dtype))  # the model's dtype; stored as float16 (cast on the device)
            common = dict(dtype="float16", on_overflow="clip", **kw)
            cpu = _capture("cpu", out, batches, root / f"cpu-{dtype}-{len(kw)}", **common)
            gpu = _capture("cuda", out, batches, root / f"gpu-{dtype}-{len(kw)}", **common)
            _same_stores(gpu, cpu, name)
    # A real model: float tolerance (the GPU's kernels differ), the statistics alike.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = LlamaForCausalLM(cfg).eval()
    actstore.record(model, ids, root / "llama-cpu", layers=[0, 1], dtype="float32")
    actstore.record(model.cuda(), ids, root / "llama-gpu", layers=[0, 1], dtype="float32")
    for p in ("llama-cpu", "llama-gpu"):
        actstore.finalize(root / p)
    a, c = actstore.ActStore(root / "llama-gpu"), actstore.ActStore(root / "llama-cpu")
    for i in range(len(a)):
        np.testing.assert_allclose(a[i, 1], c[i, 1], rtol=1e-4, atol=1e-4)
    print("cuda_check: capture OK (replayed stores bit-identical on GPU and CPU; statistics within 1e-6)")


if __name__ == "__main__":
    main()
    with tempfile.TemporaryDirectory() as d:
        check_capture(Path(d))
