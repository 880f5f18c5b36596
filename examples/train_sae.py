"""Train a small TopK sparse autoencoder on token vectors streamed from an actstore store,
and save it as an SAELens checkpoint folder that `actstore features --sae` reads as it is.

Run: python examples/train_sae.py [STORE] [--layer L] [--steps 300] [--out out/train_sae-sae]
Then: actstore features STORE --layer L --sae out/train_sae-sae --out out/feats
      actstore view out/feats --out out/site

Without STORE it first writes a small synthetic store (out/train_sae-store): token vectors
that are sparse sums of hidden dictionary directions, which a TopK SAE can recover, so
the loss visibly falls. The batches come from actstore.torch.TokenStream: shuffled and
resumable (the checkpoint saves its state). The SAE trains on standardised vectors
((x - mean) / std per dimension, the store's statistics pooled over its segments); the
saved folder folds that standardisation into the weights, so it takes the raw vectors:
W_enc / std, W_dec * std, b_dec * std + mean give the same latents and the reconstruction
std * x_hat + mean (SAELens's layout: cfg.json with architecture "topk" and k,
normalize_activations "none"; sae_weights.safetensors with W_enc, b_enc, W_dec, b_dec).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import actstore
from actstore.torch import TokenStream


def make_store(
    path: Path, *, n: int = 384, tokens: int = 33, d_model: int = 64, n_atoms: int = 256, active: int = 6
) -> None:
    """A ViT-like store (fixed tokens, layers 3 and 7) of sparse combinations of atoms."""
    rng = np.random.default_rng(0)
    atoms = rng.standard_normal((2, n_atoms, d_model)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=-1, keepdims=True)
    with actstore.ShardWriter(
        path,
        shard=0,
        layers=[3, 7],
        d_model=d_model,
        tokens=tokens,
        stats=True,
        overwrite=True,
        model_id="synthetic/sparse-atoms",
    ) as w:
        for start in range(0, n, 64):
            b = min(64, n - start)
            acts = np.zeros((b, 2, tokens, d_model), np.float32)
            for layer in range(2):
                idx = rng.integers(0, n_atoms, (b, tokens, active))
                coef = rng.exponential(2.0, (b, tokens, active)).astype(np.float32)
                acts[:, layer] = np.einsum("btk,btkd->btd", coef, atoms[layer][idx]) + 0.3
            w.append(acts + 0.01 * rng.standard_normal(acts.shape).astype(np.float32))
    actstore.finalize(path)


class TopKSAE(torch.nn.Module):
    """x -> top-k(ReLU(W_enc (x - b_dec) + b_enc)) -> W_dec z + b_dec."""

    def __init__(self, d_model: int, d_sae: int, k: int):
        super().__init__()
        self.k = k
        self.W_enc = torch.nn.Parameter(torch.randn(d_model, d_sae) / d_model**0.5)
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.W_dec = torch.nn.Parameter(self.W_enc.detach().t().clone())
        self.b_dec = torch.nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
        top = torch.topk(pre, self.k, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)
        return z @ self.W_dec + self.b_dec


def standardization(store: actstore.ActStore, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(mean, 1 / std) per dimension of the layer's stored tokens, the store's statistics
    pooled over its segments (Chan's formula); None when the store kept no statistics."""
    st = store.stats()
    if st is None:
        return None
    pos = [st.keys.index(f"layer{layer}/{seg}") for seg in store.segments]
    count = st.count[pos].astype(np.float64)
    mean = (count[:, None] * st.mean[pos]).sum(0) / count.sum()
    m2 = (st.m2[pos] + count[:, None] * (st.mean[pos] - mean) ** 2).sum(0)
    return mean.astype(np.float32), (1.0 / np.sqrt(m2 / count.sum() + 1e-6)).astype(np.float32)


def save_saelens(
    sae: TopKSAE, folder: Path, std: tuple[np.ndarray, np.ndarray] | None, store: actstore.ActStore, layer: int
) -> None:
    """The SAE as an SAELens checkpoint folder (SAELens 6's cfg layout), the input
    standardisation folded into its weights."""
    from safetensors.torch import save_file

    w = {name: p.detach().float().cpu() for name, p in sae.state_dict().items()}
    if std is not None:
        mean, scale = (torch.from_numpy(a) for a in std)
        w["W_enc"] = w["W_enc"] * scale[:, None]  # (x - mean) * scale @ W_enc = x @ (scale * W_enc) - ...
        w["W_dec"] = w["W_dec"] / scale[None, :]  # ... and the reconstruction unscaled: x_hat / scale + mean
        w["b_dec"] = w["b_dec"] / scale + mean  # the centre subtracted first and added back after
    hook = [n for n, v in store.layer_names().items() if v == layer and n.startswith("blocks.")]
    cfg = {
        "architecture": "topk",
        "d_in": store.d_model,
        "d_sae": sae.W_enc.shape[1],
        "k": sae.k,
        "rescale_acts_by_decoder_norm": False,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",  # the standardisation is folded into the weights
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": "6.0.0",  # the cfg layout (SAELens 6's); not written by SAELens
            "model_name": store.meta.get("model_id"),
            "hook_name": hook[0] if hook else f"blocks.{layer}.hook_resid_post",  # TransformerLens's name
            "trained_with": "actstore examples/train_sae.py",
            "actstore_store": str(store.path),
            "actstore_layer": layer,
            "input_standardization": "folded into the weights" if std is not None else "none",
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", nargs="?", help="an actstore store (default: write a synthetic one)")
    ap.add_argument("--layer", type=int, help="model layer to train on (default: the store's first)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--expansion", type=int, default=4, help="d_sae = expansion * d_model")
    ap.add_argument("--k", type=int, default=8, help="active latents per token")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--checkpoint", type=Path, help="save model, optimiser and stream position here at the end")
    ap.add_argument(
        "--out", type=Path, default=Path("out/train_sae-sae"), help="the SAELens checkpoint folder written at the end"
    )
    args = ap.parse_args()

    path = Path(args.store) if args.store else Path("out/train_sae-store")
    if args.store is None:
        make_store(path)
    store = actstore.ActStore(path)
    layer = store.layers[0] if args.layer is None else args.layer
    std = standardization(store, layer)
    shift, scale = (
        (torch.zeros(store.d_model), torch.ones(store.d_model)) if std is None else map(torch.from_numpy, std)
    )
    stream = TokenStream(store, layers=[layer], batch_size=args.batch_size, seed=0, dtype=torch.float32)
    loader = stream.loader(num_workers=args.workers)
    print(
        f"{store}\ntraining on layer {layer}: {stream.n_tokens} token vectors, {len(stream)} batches per epoch, "
        f"normalize={'standardize' if std is not None else None}"
    )

    torch.manual_seed(0)
    sae = TopKSAE(store.d_model, args.expansion * store.d_model, args.k)
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr)
    step, t0, seen = 0, time.perf_counter(), 0
    while step < args.steps:
        for x in loader:  # iterating again continues with the next epoch
            x = (x - shift) * scale  # standardised (folded into the saved weights at the end)
            x_hat = sae(x)
            # Fraction of variance unexplained: 1.0 = predicting the batch mean.
            loss = (x_hat - x).pow(2).sum(-1).mean() / (x - x.mean(0)).pow(2).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                sae.W_dec.data /= sae.W_dec.data.norm(dim=-1, keepdim=True).clamp_min(1e-8)
            step += 1
            seen += len(x)
            if step == 1 or step % 25 == 0 or step == args.steps:
                rate = seen / (time.perf_counter() - t0)
                print(
                    f"step {step:5d}  epoch {stream.epoch}  loss {loss.item():.4f}  ({rate:,.0f} tokens/s)", flush=True
                )
            if step == args.steps:
                break
    if args.checkpoint:
        torch.save({"sae": sae.state_dict(), "opt": opt.state_dict(), "stream": loader.state_dict()}, args.checkpoint)
        print(f"saved {args.checkpoint} (resume: loader.load_state_dict(ckpt['stream']))")
    save_saelens(sae, args.out, std, store, layer)
    print(f"wrote {args.out} (SAELens layout): actstore features {path} --layer {layer} --sae {args.out} --out OUT")


if __name__ == "__main__":
    main()
