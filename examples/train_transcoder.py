"""Train a small transcoder: predict an MLP's output from its input, streamed from one family.

Run: python examples/train_transcoder.py [FAMILY --site-in S --site-out S] [--steps 300]

Without a family it records one from a tiny random Llama built from a config (2 blocks,
d_model 32, d_mlp 64) over random token ids: block 1's MLP input (its normalised input,
`model.layers.1.post_attention_layernorm`), its output (`blocks.1.hook_mlp_out`) and its
hidden activations (`model.layers.1.mlp.act_fn`, width d_mlp), three sites of two widths in
one capture, so one aligned family (out/transcoder.family) of two members. The batches come
from `TokenStream.aligned(family, layers=[site_in, site_out])`: row i of both tensors
is the same token, so the script first checks that the model's own MLP maps the input rows
to the output rows, then trains the transcoder and prints its fraction of variance
unexplained (FVU) of the MLP's output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import actstore
from actstore.torch import TokenStream

SITE_IN = "model.layers.1.post_attention_layernorm"  # the MLP's normalised input (mlp_in)
SITE_OUT = "blocks.1.hook_mlp_out"
SITE_POST = "model.layers.1.mlp.act_fn"  # the MLP's hidden activations (d_mlp)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def make_family(path: Path, model) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (16, 16), generator=gen) for _ in range(8)]  # 2,048 tokens
    actstore.record(model, batches, path, layers=[SITE_IN, SITE_OUT, SITE_POST], dtype="float32")
    actstore.finalize(path)


class Transcoder(torch.nn.Module):
    """x_out ~ W_dec ReLU(W_enc x_in + b_enc) + b_dec: a sparse MLP standing in for the model's."""

    def __init__(self, d_in: int, d_out: int, d_sae: int):
        super().__init__()
        self.enc = torch.nn.Linear(d_in, d_sae)
        self.dec = torch.nn.Linear(d_sae, d_out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.relu(self.enc(x))
        return self.dec(z), z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", nargs="?", help="a family holding both sites (default: record one)")
    ap.add_argument("--site-in", default=SITE_IN)
    ap.add_argument("--site-out", default=SITE_OUT)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args()
    model = None
    if args.family:
        path = Path(args.family)
    else:
        path, model = Path("out/transcoder.family"), tiny_llama()
        if not (path / "family.json").exists():
            make_family(path, model)
    family = actstore.open(path)
    print(family)
    stream = TokenStream.aligned(family, layers=[args.site_in, args.site_out], batch_size=args.batch_size, seed=0)
    if model is not None:  # row i of both tensors is one token: the model's MLP maps one to the other
        x_in, x_out = next(iter(stream))
        with torch.no_grad():
            err = (model.model.layers[1].mlp(x_in) - x_out).abs().max().item()
        print(f"aligned: max |mlp(x_in) - x_out| = {err:.2e} over {len(x_in)} tokens")
    # One scale per site from the first batch, so the loss does not depend on the model's magnitudes.
    x_in, x_out = next(iter(stream))
    s_in, s_out = x_in.std().item(), x_out.std().item()
    torch.manual_seed(0)
    tc = Transcoder(x_in.shape[1], x_out.shape[1], 256)
    opt = torch.optim.Adam(tc.parameters(), lr=1e-2)
    step, fvu = 0, float("nan")
    while step < args.steps:
        for x_in, x_out in stream:
            x, y = x_in / s_in, x_out / s_out
            pred, z = tc(x)
            fvu_t = (pred - y).pow(2).sum(-1).mean() / (y - y.mean(0)).pow(2).sum(-1).mean()
            loss = fvu_t + 1e-3 * z.abs().sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step, fvu = step + 1, fvu_t.item()
            if step == 1 or step % 100 == 0 or step == args.steps:
                print(f"step {step:4d}  epoch {stream.epoch}  fvu {fvu:.4f}", flush=True)
            if step == args.steps:
                break
    print(f"final fvu {fvu:.4f}")


if __name__ == "__main__":
    main()
