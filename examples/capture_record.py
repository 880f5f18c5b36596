"""Record a model's residual stream from your own batches with actstore.record.

Runs offline on the embedded MiniLM (BERT) installed by `bash scripts/setup.sh dev`:
    python examples/capture_record.py [STORE]
"""

from __future__ import annotations

import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import actstore  # noqa: E402
from actstore.capture import load_model, normalization  # noqa: E402

path = sys.argv[1] if len(sys.argv) > 1 else "out/capture-example.store"
shutil.rmtree(path, ignore_errors=True)

lm = load_model("embedded:minilm-l6")  # a transformers BertModel and its tokenizer
texts = ["The cat sat on the mat.", "Activations are stored as float16.", "Paris is the capital of France."]


def batches():
    for i in range(0, len(texts), 2):
        enc = lm.tokenizer(texts[i : i + 2], padding=True, return_tensors="pt")
        yield {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


# Layer N = output of block N = hidden_states[N + 1]. With segments, the attention mask
# says which tokens are stored (padding is not).
actstore.record(lm.model, batches(), path, layers=[2, 5], segments={"tokens": 32})
actstore.finalize(path)

store = actstore.ActStore(path)
print(store)
for ex in range(len(store)):
    print(f"example {ex}: {store.lengths(ex)['tokens']} tokens, layer 5 -> {store[ex, 5].shape} {store[ex, 5].dtype}")
n = normalization(store, layer=5)
print(f"layer 5 statistics over {n.count} token vectors: mean L2 norm {n.mean_norm:.2f}, mean std {n.std.mean():.3f}")
