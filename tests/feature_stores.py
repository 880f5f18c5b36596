"""The feature pass's test stores and their oracle: a store of random and tied values, and the tokens a correct pass ranks (tests/test_features_topk.py and the other feature tests)."""

from __future__ import annotations

import numpy as np

import actstore
from actstore.layout.spec import TOKEN_KIND_NAMES

D = 8


def make_store(path, *, zarr_format=2, n_shards=3, per_shard=7, dtype="float16", seed=0, ties=False):
    """Two padded segments of random lengths, token labels (0 content, 1 special), layers 0 and 2."""
    rng = np.random.default_rng(seed)
    for shard in range(n_shards):
        with actstore.ShardWriter(
            path,
            shard=shard,
            layers=[0, 2],
            d_model=D,
            segments={"prompt": 5, "response": 3},
            dtype=dtype,
            token_labels=True,
            token_label_names=TOKEN_KIND_NAMES,  # token kinds: the default mask keeps label 0
            zarr_format=zarr_format,
            world_size=n_shards,
            t_chunk={"prompt": 2, "response": 3},
        ) as w:
            n = per_shard
            p = rng.standard_normal((n, 2, 5, D)).astype(np.float32)
            r = rng.standard_normal((n, 2, 3, D)).astype(np.float32)
            if ties:  # many equal values: the tie-break must decide
                p, r = np.round(p), np.round(r)
            w.append(
                prompt=p.astype(dtype) if dtype != "bfloat16" else p,
                response=r.astype(dtype) if dtype != "bfloat16" else r,
                lengths={"prompt": rng.integers(0, 6, n), "response": rng.integers(0, 4, n)},
                token_labels={
                    "prompt": (rng.random((n, 5)) < 0.3).astype(np.uint8),
                    "response": np.zeros((n, 3), np.uint8),
                },
            )
    actstore.finalize(path)
    return actstore.open(path)


def oracle_tokens(store, layer, *, keep_special=False, segments=None):
    """Every kept (example, token, vector) in store order, the slow way."""
    rows = []
    labels = {s: store.field(s + "_token_labels") for s in store.segments}
    for ex in range(len(store)):
        off = 0
        for s in store.segments:
            x = np.asarray(store.segment(s)[ex, layer], np.float32)
            for t in range(len(x)):
                if (segments is None or s in segments) and (keep_special or labels[s][ex, t] == 0):
                    rows.append((ex, off + t, x[t]))
            off += len(x)
    ex = np.array([r[0] for r in rows], np.int64)
    tok = np.array([r[1] for r in rows], np.int32)
    X = np.stack([r[2] for r in rows]) if rows else np.zeros((0, D), np.float32)
    return ex, tok, X
