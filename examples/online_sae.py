"""Train two SAEs on two layers of SmolLM2-135M while capturing it into a spool that holds
a fraction of what is captured.

Run: python examples/online_sae.py [STORE] [--texts 32] [--tokens 64] [--budget 1.5MB]

A capture thread runs the embedded SmolLM2 (`embedded:smollm2-135m`, no download) over
texts shipped with Python (pydoc_data's topics), recording blocks 8 and 16 into a spool
(actstore.record(..., spool=BUDGET)): a committed block is deleted once both consumers
acknowledged it, and the capture waits while the spool is full. Two consumer threads,
"sae-l8" and "sae-l16", each train a TopK SAE on its layer from
TokenStream.follow(STORE, consumer=..., ack="yielded"): every captured token once. It
prints the disk high-water mark of the activation files against the budget, and each
consumer's token count against the tokens captured. Everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_while_capturing import TopKSAE  # noqa: E402

import actstore  # noqa: E402
from actstore.capture import load_model  # noqa: E402
from actstore.layout.spool import format_bytes, parse_budget  # noqa: E402
from actstore.torch import TokenStream  # noqa: E402

LAYERS, BATCH = (8, 16), 2


def texts(n: int) -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:n]]


def activation_bytes(store: Path) -> int:
    """Bytes of the store's activation files on disk now (what the spool's budget bounds)."""
    total = 0
    for folder, _, files in os.walk(store / "shards"):
        if "_activations" in folder:
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(folder, f))
                except FileNotFoundError:
                    pass  # removed meanwhile
    return total


def capture(lm, store: Path, a, budget: int, block: int) -> None:
    docs = texts(a.texts)

    def batches():
        for i in range(0, len(docs), BATCH):
            enc = lm.tokenizer(
                docs[i : i + BATCH], padding=True, truncation=True, max_length=a.tokens, return_tensors="pt"
            )
            yield {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    actstore.record(
        lm.model,
        batches(),
        store,
        layers=list(LAYERS),
        segments={"tokens": a.tokens},
        spool=budget,
        commit_bytes=block,
        zarr_format=2,  # a spool deletes files of single examples
    )
    actstore.finalize(store)


def train(store: Path, layer: int, out: dict) -> None:
    """One consumer: a TopK SAE on `layer`, every captured token of it once."""
    torch.manual_seed(layer)
    sae = TopKSAE(576, 1024, 16)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    stream = TokenStream.follow(
        store, consumer=f"sae-l{layer}", layers=[layer], batch_size=128, buffer_bytes=256 * 576 * 2,
        dtype=torch.float32, ack="yielded", idle_timeout_s=600,
    )  # fmt: skip
    losses, seen = [], 0
    for x in stream:
        loss = (sae(x) - x).pow(2).sum(-1).mean() / (x - x.mean(0)).pow(2).sum(-1).mean().clamp_min(1e-8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        seen += len(x)
    out[layer] = (len(losses), seen, losses[0], losses[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", nargs="?", default="out/online-sae.store")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per text (truncated)")
    ap.add_argument("--budget", default="1.5MB", help="the spool's budget (50GB, 512MiB, bytes)")
    a = ap.parse_args()
    store = Path(a.store)
    shutil.rmtree(store, ignore_errors=True)
    budget = parse_budget(a.budget)
    block = BATCH * a.tokens * len(LAYERS) * 576 * 2  # one batch of examples a block
    lm = load_model("embedded:smollm2-135m")
    trained: dict[int, tuple] = {}
    high, stop = [0], threading.Event()

    def watch():
        while not stop.wait(0.01):  # a sampling cadence
            high[0] = max(high[0], activation_bytes(store))

    threads = [threading.Thread(target=train, args=(store, layer, trained)) for layer in LAYERS]
    threads.append(threading.Thread(target=watch, daemon=True))
    for t in threads:
        t.start()  # the consumers register once the capture made the store
    capture(lm, store, a, budget, block)
    for t in threads[:-1]:
        t.join()
    stop.set()
    final = actstore.open(store)
    tokens = int(final.segment("tokens").lengths().sum())
    print(
        f"captured {tokens} tokens of layers {list(LAYERS)}: {format_bytes(tokens * len(LAYERS) * 576 * 2)} of activations"
    )
    print(f"disk high-water: {high[0]} bytes of activation files; budget {budget} bytes + one block of {block} bytes")
    for layer in LAYERS:
        steps, seen, first, last = trained[layer]
        print(f"sae-l{layer}: {seen} tokens in {steps} steps, loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
