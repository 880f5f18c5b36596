"""The device paths on a CUDA machine, against the CPU paths (not collected by pytest: the
test suite runs on CPU-only torch; run this where `torch.cuda.is_available()`):

    PYTHONPATH=src python tests/cuda_check.py

Checks, each against the same thing computed on the CPU:
- TokenStream batches delivered on the GPU (pinned buffers, non_blocking copies on a side
  stream, conversion and normalisation there), also when the loop keeps many batches alive
  and works slowly (a pinned buffer must never be refilled while its copy runs);
- TokenLoader with workers and device="cuda" (the DeviceFeeder), over two epochs of
  persistent workers;
- PairDataset.loader(device="cuda"), with workers and without;
- TokenStream(path, follow=True, device="cuda") over a store written meanwhile;
- the feature pass on the GPU (device="cuda": encode, top-k, statistics, histograms,
  intervals there) against the numba pass on the CPU: the same tables, both tails, for
  neurons of float16 and bfloat16 stores and a directions encoder with small integer
  weights (exact in any summation order);
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
    cpu_loader = TokenStream(store, batch_size=512, seed=1).loader(**ctx)
    want = [[b.clone() for b in cpu_loader] for _ in range(2)]
    loader = on_device(lambda d: TokenStream(store, batch_size=512, seed=1, device=d), dev).loader(**ctx)
    for epoch in range(2):  # persistent workers, their slots reused
        got = list(loader)
        assert len(got) == len(want[epoch]) and all(
            g.device.type == dev and torch.equal(g.cpu(), c) for g, c in zip(got, want[epoch])
        ), f"TokenLoader epoch {epoch} differs"
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
    fs = TokenStream(
        path, follow=True, batch_size=256, buffer_bytes=64 * 256 * 2, device=dev if dev == "cuda" else None
    )
    got = torch.cat([b.cpu() for b in fs])
    writer.join()
    want = torch.cat(list(TokenStream(actstore.open(path), batch_size=512, shuffle=False)))
    assert torch.equal(got.sort(dim=0).values, want.sort(dim=0).values), "the follow stream differs"


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
        check_features(Path(d), dev)
        print("cuda_check: the feature pass on the device gives the CPU pass's tables", flush=True)
        store = build(Path(d) / "s")
        check_loaders(store, Path(d), dev)
        print("cuda_check: TokenLoader, PairDataset and the follow stream on the device match the CPU", flush=True)
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


if __name__ == "__main__":
    main()
