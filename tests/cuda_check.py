"""The device paths on a CUDA machine, against the CPU paths (not collected by pytest: the
test suite runs on CPU-only torch; run this where `torch.cuda.is_available()`):

    PYTHONPATH=src python tests/cuda_check.py

Checks, each against the same thing computed on the CPU:
- TokenStream batches delivered on the GPU (pinned buffers, non_blocking copies on a side
  stream, conversion and normalisation there), also when the loop keeps many batches alive
  and works slowly (a pinned buffer must never be refilled while its copy runs);
- actstore.hostmem on the device: a pinned pool's slots, DeviceCopy both ways (side stream,
  event, record_stream) and hand_over;
- TokenLoader with workers and device="cuda" (the DeviceFeeder), over two epochs of
  persistent workers; with normalize=, the workers' float16 rows cast and normalised on the
  device equal the in-process stream's;
- PairDataset.loader(device="cuda"), with workers and without;
- TokenStream.follow(path, device="cuda") over a store written meanwhile;
- the feature pass on the GPU (device="cuda": encode, top-k, statistics, histograms,
  intervals there) against the numba pass on the CPU: the same tables, both tails, for
  neurons of float16 and bfloat16 stores and a directions encoder with small integer
  weights (exact in any summation order);
- capture (actstore.record) of a model on the GPU whose blocks hand over known tensors:
  the same store as on the CPU, bit for bit (gather, cast, the pinned ring's copies), with
  statistics within 1e-6, also with a slow writer (a ring slot must never be refilled while
  it is written), padded segments (gathered on the device), clipped overflows and batches
  given on the CPU (moved to the model's device); and a real Llama within float tolerance;
then prints the rates. `--cpu` runs the same script with the CPU stand-ins (a check of
the script itself on a machine without a GPU)."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import actstore
from actstore.torch import TokenStream


def build(root: Path, commit: bool = False) -> actstore.ActStore:
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
            if commit:
                w.commit()
                time.sleep(0.2)
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


def on_device(make, dev: str):
    """A loader of `make()` on `dev`; "cpu" stands for the device (the same steps, host copies)."""
    if dev == "cuda":
        return make("cuda")
    obj = make(None)
    obj.device = torch.device("cpu")
    return obj


def check_loaders(store, root: Path, dev: str) -> None:
    """TokenLoader with workers, PairDataset and the follow stream on the device, against the CPU."""
    from actstore.torch import PairDataset

    ctx = dict(num_workers=2, multiprocessing_context="spawn")
    ctx_1 = dict(multiprocessing_context="spawn")
    cpu_loader = TokenStream(store, batch_size=512, seed=1).loader(**ctx)
    want = [[b.clone() for b in cpu_loader] for _ in range(2)]
    loader = on_device(lambda d: TokenStream(store, batch_size=512, seed=1, device=d), dev).loader(**ctx)
    for epoch in range(2):  # persistent workers, their slots reused
        got = list(loader)
        assert len(got) == len(want[epoch]) and all(
            g.device.type == dev and torch.equal(g.cpu(), c) for g, c in zip(got, want[epoch])
        ), f"TokenLoader epoch {epoch} differs"
    kw = dict(batch_size=512, seed=2, normalize="standardize")  # workers ship float16 and the keys
    in_process = [b.clone() for b in TokenStream(store, **kw)]
    one = on_device(lambda d: TokenStream(store, device=d, **kw), dev).loader(num_workers=1, **ctx_1)
    got = list(one)
    assert len(got) == len(in_process) and all(
        g.dtype == torch.float32 and torch.allclose(g.cpu(), c, rtol=1e-6, atol=1e-6) for g, c in zip(got, in_process)
    ), "TokenLoader with normalize= differs from the in-process stream"
    ds = PairDataset(store, return_mask=True)
    for kw in ({}, ctx):
        cpu = [{k: v.clone() for k, v in b.items()} for b in ds.loader(batch_size=16, k=2, seed=3, **kw)]
        if dev == "cuda":
            got = list(ds.loader(batch_size=16, k=2, seed=3, device="cuda", **kw))
        else:
            from actstore.loaders.feed import DeviceLoader

            got = list(DeviceLoader(ds.loader(batch_size=16, k=2, seed=3, **kw), torch.device("cpu")))
        assert len(got) == len(cpu) and all(
            g["acts"].device.type == dev and all(torch.equal(g[k].cpu(), c[k]) for k in c) for g, c in zip(got, cpu)
        ), f"PairDataset {kw} differs"
    path = root / "follow"
    writer = threading.Thread(target=build, args=(path,), kwargs={"commit": True})
    writer.start()
    fs = TokenStream.follow(path, batch_size=256, buffer_bytes=64 * 256 * 2, device=dev if dev == "cuda" else None)
    got = torch.cat([b.cpu() for b in fs])
    writer.join()
    want = torch.cat(list(TokenStream(actstore.open(path), batch_size=512, shuffle=False)))
    assert torch.equal(got.sort(dim=0).values, want.sort(dim=0).values), "the follow stream differs"


def check_hostmem(dev: str) -> None:
    """A pinned pool's slot and DeviceCopy both ways: the bytes come back as they went."""
    from actstore.hostmem import DeviceCopy, SlotPool, hand_over

    pool = SlotPool(1, "pinned")
    slot = pool.take(4096 * 4)
    assert slot.kind == ("pinned" if dev == "cuda" else "plain") and slot.tensor.is_pinned() == (dev == "cuda")
    (x,) = slot.carve([((64, 16), torch.float32)])
    x.copy_(torch.arange(64 * 16, dtype=torch.float32).view(64, 16))
    copy = DeviceCopy(torch.device(dev))
    (on_dev,), event = copy.to_device([x], then=lambda ts: [ts[0] * 2])
    hand_over([on_dev], event)
    assert on_dev.device.type == dev
    back = torch.empty_like(x)
    copy.to_host(on_dev, back)
    copy.record().synchronize()
    assert torch.equal(back, x * 2), "DeviceCopy changed the bytes"
    pool.give_back(slot)
    pool.close()


def check_features(root: Path, dev: str) -> None:
    """The feature pass on the device against the numba pass: the same tables."""
    from actstore.features import Encoder, neurons, top_activations

    rng = np.random.default_rng(5)
    for dtype in ("float16", "bfloat16"):
        path = root / f"feat-{dtype}"
        with actstore.ShardWriter(path, layers=[2], d_model=64, segments={"t": 48}, dtype=dtype) as w:
            x = np.round(rng.standard_normal((300, 1, 48, 64)) * 4) / 4  # many ties
            w.append(
                t=x.astype(np.float32) if dtype == "bfloat16" else x.astype(np.float16),
                lengths={"t": rng.integers(1, 49, 300)},
            )
        actstore.finalize(path)
        store = actstore.open(path)
        W = rng.integers(-2, 3, (64, 700)).astype(np.float32)
        encs = [neurons(64), Encoder(kind="directions", d_in=64, n_features=700, W=W, b=np.full(700, -1.0, np.float32))]
        for enc in encs:
            kw = dict(k=16, sign="both", n_intervals=4, per_interval=3, seed=2)
            a = top_activations(store, 2, enc, device=dev, kernel="torch", **kw)
            b = top_activations(store, 2, enc, device="cpu", kernel="numba", **kw)
            for table in ("top", "features", "intervals"):
                ta, tb = getattr(a, table), getattr(b, table)
                for c in ta:
                    if c.startswith("mean"):
                        assert np.allclose(ta[c], tb[c], rtol=1e-6), f"{dtype} {enc.kind} {table}.{c}"
                    else:
                        assert np.array_equal(ta[c], tb[c]), f"{dtype} {enc.kind} {table}.{c} differs"


def main() -> None:
    dev = "cpu" if "--cpu" in sys.argv else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a machine with one (or --cpu to check the script itself)")
    with tempfile.TemporaryDirectory() as d:
        check_hostmem(dev)
        print("cuda_check: the pinned pool and DeviceCopy carry the bytes both ways", flush=True)
        check_features(Path(d), dev)
        print("cuda_check: the feature pass on the device gives the CPU pass's tables", flush=True)
        store = build(Path(d) / "s")
        check_loaders(store, Path(d), dev)
        print("cuda_check: TokenLoader, PairDataset and the follow stream on the device match the CPU", flush=True)
        check_capture(Path(d) / "capture", dev)
        if dev == "cpu":
            return
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


def check_capture(root: Path, dev: str = "cuda") -> None:
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
            gpu = _capture(dev, out, batches, root / f"gpu-{dtype}-{len(kw)}", **common)
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
    actstore.record(model.to(dev), ids, root / "llama-gpu", layers=[0, 1], dtype="float32")
    for p in ("llama-cpu", "llama-gpu"):
        actstore.finalize(root / p)
    a, c = actstore.ActStore(root / "llama-gpu"), actstore.ActStore(root / "llama-cpu")
    for i in range(len(a)):
        np.testing.assert_allclose(a[i, 1], c[i, 1], rtol=1e-4, atol=1e-4)
    print(f"cuda_check: capture on {dev} stores what the CPU stores (bit for bit; statistics within 1e-6)", flush=True)


if __name__ == "__main__":
    main()
