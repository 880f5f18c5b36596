"""Train SAELens SAEs from a store with no export: a data provider for `SAETrainer`.

`SAETrainer(cfg, sae, data_provider)` (sae_lens.training.sae_trainer) pulls `(batch, d_in)`
tensors from any iterator; this one draws them from a TokenStream (shuffled, real tokens
only, optionally without special tokens), epoch after epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from actstore.read.api import ReaderLike, as_reader


def saelens_data_provider(
    store: ReaderLike,
    *,
    layer: Any,
    batch_size: int = 4096,
    seed: int = 0,
    token_mask: Any = "default",
    device: str | None = None,
    **stream_kwargs: Any,
) -> Iterator[Any]:
    """An endless iterator of float32 (batch_size, d_model) tensors of layer `layer` (a number
    or a name), for `SAETrainer(..., data_provider=...)`. Each epoch reshuffles (seed + epoch)."""
    import torch

    from actstore.loaders import TokenStream

    store = as_reader(store)
    number = store.layer_number(layer)
    epoch = 0
    while True:
        ts = TokenStream(
            store,
            batch_size=batch_size,
            layers=[number],
            seed=seed + epoch,
            token_mask=token_mask,
            dtype=torch.float32,
            drop_last=True,
            **stream_kwargs,
        )
        if len(ts) == 0:
            raise ValueError(f"layer {number} of {store.path} holds fewer than {batch_size} tokens: lower batch_size")
        for batch in ts:
            yield batch if device is None else batch.to(device, non_blocking=True)
        epoch += 1
