"""Helpers of the consumer tests (tests/test_spool_consumers*.py): tiny stores written in
many small blocks whose token vectors are all distinct, and token vectors counted as
multisets of their bytes (a checksum of every vector, compared as a whole)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

import actstore
from actstore.torch import TokenStream

D = 8
T = 6
LAYERS = [1, 3]
PER_BLOCK = 3


def writer(path: Any, shard: int = 0, world_size: int = 1, **kw: Any) -> actstore.ShardWriter:
    return actstore.ShardWriter(
        path, shard=shard, world_size=world_size, layers=LAYERS, d_model=D, segments={"tokens": T}, **kw
    )


def block(shard: int, index: int, per_block: int = PER_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block `index` of shard `shard`: (per_block, 2, T, D) float16 activations (distinct
    vectors: a random base plus the block's own offset) and lengths 1..T."""
    rng = np.random.default_rng([shard, index])
    acts = rng.standard_normal((per_block, len(LAYERS), T, D)).astype(np.float16)
    return acts, rng.integers(1, T + 1, per_block)


def write_blocks(
    path: Any, shard: int, blocks: Iterable[int], w: actstore.ShardWriter | None = None, **kw: Any
) -> None:
    """Append and commit the given blocks (one commit each) to shard `shard`."""
    own = w is None
    w = writer(path, shard, **kw) if own else w
    for i in blocks:
        acts, lengths = block(shard, i)
        w.append(tokens=acts, lengths={"tokens": lengths})
        w.commit()
    if own:
        w.close()


def rows(batches: Iterable[torch.Tensor]) -> Counter:
    """The multiset of token vectors (as bytes) in `batches`."""
    out: Counter = Counter()
    for b in batches:
        a = np.ascontiguousarray(b.to(torch.float16).cpu().numpy())
        out.update(r.tobytes() for r in a)
    return out


def kept(path: Any, layers: Any = None) -> Counter:
    """Every kept token vector of the finalized store at `path` (of `layers`)."""
    return rows(TokenStream(actstore.open(path), batch_size=256, shuffle=False, layers=layers, token_mask="all"))


def block_rows(shard: int, index: int, layers: Iterable[int] = (1,)) -> Counter:
    """The kept token vectors of block `index` of shard `shard` (from its generator)."""
    acts, lengths = block(shard, index)
    out: Counter = Counter()
    for e, n_tok in enumerate(lengths):
        for layer in layers:
            out.update(r.tobytes() for r in acts[e, LAYERS.index(layer), :n_tok])
    return out


def expected(shards: dict[int, int], layers: list[int]) -> Counter:
    """The kept token vectors of blocks 0..n-1 of each shard (from their generator, not the store)."""
    return sum((block_rows(shard, i, layers) for shard, n in shards.items() for i in range(n)), Counter())
