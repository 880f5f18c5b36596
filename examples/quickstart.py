"""Quick start: log activations from your own loop, finalize, read them back.

Run: python examples/quickstart.py [STORE]   (default: out/quickstart-store)
"""

import sys

import numpy as np

import actstore

path = sys.argv[1] if len(sys.argv) > 1 else "out/quickstart-store"
rng = np.random.default_rng(0)
layers, d_model = [2, 6, 11], 64

# An LLM question-answer store: prompt and response segments, zero-padded, with lengths.
with actstore.ShardWriter(
    path,
    shard=0,
    layers=layers,
    d_model=d_model,
    segments={"prompt": 32, "response": 16},
    texts=["prompt", "response"],
    fields={"label": "int8"},
    model_id="demo/random",
    overwrite=True,
) as writer:
    for step in range(10):
        b = 8
        p_len = rng.integers(4, 40, size=b)  # some prompts are longer than P_max=32
        r_len = rng.integers(1, 16, size=b)
        prompt = rng.standard_normal((b, len(layers), 32, d_model)).astype(np.float16)
        response = rng.standard_normal((b, len(layers), 16, d_model)).astype(np.float16)
        writer.append(
            prompt=prompt,
            response=response,
            lengths={"prompt": np.minimum(p_len, 32), "response": r_len},
            source_lengths={"prompt": p_len},
            texts={
                "prompt": [f"question {step}-{i}" for i in range(b)],
                "response": [f"answer {step}-{i}" for i in range(b)],
            },
            fields={"label": rng.integers(0, 2, size=b)},
        )

actstore.finalize(path)
store = actstore.ActStore(path)
x = store[5, 6]  # example 5, model layer 6: prompt[:p] then response[:r]
print(store)
print("store[5, 6]:", x.shape, x.dtype, "lengths", store.lengths(5))
print("sample 5:", store.sample(5))
print("response only:", store.segment("response")[5, 6].shape)

# Many examples and layers at once, and the whole store as a lazy xarray Dataset.
many = store[0:4, [6, 11]]  # padded segments: a list of 4 arrays (2 layers, T_i, D)
print("store[0:4, [6, 11]]:", [a.shape for a in many])
ds = store.to_xarray()  # nothing is read until indexed
print("to_xarray:", dict(ds.sizes), "example 5, layer 6:", ds.activations.isel(example=5).sel(layer=6).values.shape)
