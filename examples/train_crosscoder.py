"""Train a small crosscoder in a plain PyTorch loop on two stores captured from two models
on the same tokens, streamed in step: row i of both tensors is the same token.

Run: python examples/train_crosscoder.py [STORE_A STORE_B] [--layer L] [--steps 200]
     [--stop-after N --checkpoint CKPT] [--resume CKPT]

Without stores it writes two synthetic ones (out/crosscoder-a, out/crosscoder-b): two
"models" of different widths whose vectors at each token are sparse sums of shared hidden
features seen through each model's own directions, with the same token ids. The batches come
from `TokenStream.aligned([a, b])`: one shuffle for both stores (refused if their
token ids differ), each normalised with its own statistics, resumable mid-epoch: stop with
--stop-after and --checkpoint, continue with --resume, and the run goes on with exactly the
batches it would have seen.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import actstore
from actstore.torch import TokenStream


def make_stores(
    a: Path, b: Path, *, n: int = 256, tokens: int = 24, widths=(32, 48), n_feats: int = 96, active: int = 4
) -> None:
    rng = np.random.default_rng(0)
    feats = rng.integers(0, n_feats, (n, tokens, active))
    coef = rng.exponential(2.0, (n, tokens, active)).astype(np.float32)
    ids = rng.integers(0, 30_000, (n, tokens))
    for path, d in zip((a, b), widths):
        dirs = rng.standard_normal((n_feats, d)).astype(np.float32)
        dirs /= np.linalg.norm(dirs, axis=-1, keepdims=True)
        acts = np.einsum("ntk,ntkd->ntd", coef, dirs[feats])[:, None] + 0.01 * rng.standard_normal((n, 1, tokens, d))
        with actstore.ShardWriter(
            path,
            layers=[6],
            d_model=d,
            tokens=tokens,
            token_ids=True,
            stats=True,
            overwrite=True,
            model_id=f"synthetic/model-d{d}",
        ) as w:
            w.append(acts.astype(np.float32), token_ids=ids)
        actstore.finalize(path)


class CrossCoder(torch.nn.Module):
    """Shared latents z = topk(ReLU(sum_s W_enc[s] x_s + b)); each source decoded by its own W_dec[s]."""

    def __init__(self, widths: list[int], d_sae: int, k: int):
        super().__init__()
        self.k = k
        self.enc = torch.nn.ModuleList(torch.nn.Linear(d, d_sae, bias=False) for d in widths)
        self.b = torch.nn.Parameter(torch.zeros(d_sae))
        self.dec = torch.nn.ModuleList(torch.nn.Linear(d_sae, d) for d in widths)

    def forward(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        pre = torch.relu(sum(e(x) for e, x in zip(self.enc, xs)) + self.b)
        top = torch.topk(pre, self.k, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)
        return [d(z) for d in self.dec]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="*", help="two stores captured on the same tokens (default: write synthetic ones)")
    ap.add_argument("--layer", type=int, default=6)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--stop-after", type=int, help="stop after this many steps (save --checkpoint)")
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--resume", type=Path)
    args = ap.parse_args()

    if args.stores:
        a, b = (actstore.ActStore(p) for p in args.stores)
    else:
        pa, pb = Path("out/crosscoder-a"), Path("out/crosscoder-b")
        if not (pa / "manifest.json").exists():
            make_stores(pa, pb)
        a, b = actstore.ActStore(pa), actstore.ActStore(pb)
    stream = TokenStream.aligned(
        [a, b],
        layers=[args.layer],
        batch_size=args.batch_size,
        seed=0,
        normalize="standardize",
        drop_last=True,
    )
    torch.manual_seed(0)
    model = CrossCoder([a.d_model, b.d_model], 128, k=8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        stream.load_state_dict(ckpt["stream"])
        step = ckpt["step"]
    print(f"{len(stream)} batches of {args.batch_size} aligned tokens per epoch (widths {a.d_model}, {b.d_model})")
    while step < args.steps:
        for xs in stream:  # a tuple: one tensor per store, row i the same token
            outs = model(xs)
            loss = sum(
                ((o - x).pow(2).sum(-1).mean() / (x - x.mean(0)).pow(2).sum(-1).mean()) for o, x in zip(outs, xs)
            ) / len(xs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == 1 or step % 25 == 0 or step == args.steps:
                print(f"step {step:4d}  epoch {stream.epoch}  loss {loss.item():.4f}", flush=True)
            if step == args.steps or step == args.stop_after:
                break
        if step == args.stop_after:
            break
    if args.checkpoint:
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "stream": stream.state_dict(), "step": step},
            args.checkpoint,
        )
        print(f"saved {args.checkpoint} at step {step}")
    print(f"final loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
