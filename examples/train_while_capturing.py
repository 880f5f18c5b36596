"""Train a sparse autoencoder on a store while another process is still capturing into it.

Run: python examples/train_while_capturing.py [STORE] [--examples 96] [--sleep 0.05]

One process captures: it records layer 1 of a small random-init Llama (built from a
config: no weights to download) over batches of token ids with actstore.record, committing
a block every few batches, then finalizes the store. This process trains a TopK SAE on the
same store at the same time: TokenStream.follow(STORE) streams each block as soon as
it is committed, mixed in a pool of buffer_bytes, and ends once the store is finalized.
Every token the capture stored is trained on exactly once; everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import actstore
from actstore.torch import TokenStream

LAYER, TOKENS, BATCH = 1, 32, 4


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=512)
    return LlamaForCausalLM(cfg).eval()


def capture(store: Path, examples: int, sleep: float) -> None:
    """The capturing process: record layer LAYER over `examples` random sequences, slowly."""

    def batches():
        g = torch.Generator().manual_seed(1)
        for _ in range(0, examples, BATCH):
            ids = torch.randint(1, 512, (BATCH, TOKENS), generator=g)
            mask = torch.ones_like(ids)
            mask[:, TOKENS - int(torch.randint(0, 8, (1,), generator=g)) :] = 0  # padded tails, as real batches have
            time.sleep(sleep)  # a model much larger than this one takes its time
            yield {"input_ids": ids, "attention_mask": mask}

    row = TOKENS * 64 * 2  # bytes of one example's layer in float16
    actstore.record(
        tiny_llama(), batches(), store, layers=[LAYER], segments={"tokens": TOKENS}, commit_bytes=2 * BATCH * row
    )
    actstore.finalize(store)


class TopKSAE(torch.nn.Module):
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
        return torch.zeros_like(pre).scatter_(-1, top.indices, top.values) @ self.W_dec + self.b_dec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", nargs="?", default="out/train-while-capturing.store")
    ap.add_argument("--examples", type=int, default=96)
    ap.add_argument("--sleep", type=float, default=0.05, help="seconds the capture waits before each batch")
    ap.add_argument("--capture", action="store_true", help=argparse.SUPPRESS)  # the capturing process
    args = ap.parse_args()
    store = Path(args.store)
    if args.capture:
        capture(store, args.examples, args.sleep)
        return
    shutil.rmtree(store, ignore_errors=True)
    capturing = subprocess.Popen(
        [
            sys.executable,
            __file__,
            str(store),
            "--capture",
            "--examples",
            str(args.examples),
            "--sleep",
            str(args.sleep),
        ]
    )
    # The store appears once the capture starts writing; the stream waits for it, then for each block.
    stream = TokenStream.follow(store, batch_size=64, buffer_bytes=256 * 64 * 2, dtype=torch.float32)
    torch.manual_seed(0)
    sae = TopKSAE(64, 256, 8)
    opt = torch.optim.Adam(sae.parameters(), lr=3e-3)
    step, seen, first_loss, before_finalize = 0, 0, None, 0
    for x in stream:
        x_hat = sae(x)
        loss = (x_hat - x).pow(2).sum(-1).mean() / (x - x.mean(0)).pow(2).sum(-1).mean().clamp_min(1e-8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step, seen = step + 1, seen + len(x)
        first_loss = loss.item() if first_loss is None else first_loss
        if not (store / "manifest.json").exists():
            before_finalize += 1
        if step % 10 == 0:
            print(
                f"step {step:4d}  loss {loss.item():.4f}  tokens {seen}  blocks read {len(stream.blocks_read)}",
                flush=True,
            )
    if capturing.wait() != 0:
        sys.exit(f"the capture failed (exit code {capturing.returncode})")
    final = actstore.open(store)
    stored = int(final.segment("tokens").lengths().sum())
    print(f"trained {step} steps on {seen} tokens, {before_finalize} steps before the store was finalized")
    print(
        f"the finalized store holds {len(final)} examples, {stored} tokens; loss {first_loss:.4f} -> {loss.item():.4f}"
    )


if __name__ == "__main__":
    main()
