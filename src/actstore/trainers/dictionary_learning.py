"""dictionary_learning (saprmarks/dictionary_learning) from a store.

Its `trainSAE(data, trainer_configs, steps, ...)` pulls `act = next(data)`-style batches
((batch, d) float tensors, or (batch, n_layers, d) for its crosscoder trainer) by
iterating `data`, and saves `data.config` beside the SAE. `DictionaryLearningSource` is
such an iterable over a store: endless (one TokenStream epoch after another, each
reshuffled), float32, on the device asked for, resumable with state_dict().

`paired_source` replaces PairedActivationCache (whose two caches were each shuffled with
their own unseeded permutation at collection time): two stores captured on the same tokens
(or several layers of one), in step under one seeded shuffle, stacked (batch, k, d).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actstore.read.api import ReaderLike


class DictionaryLearningSource:
    """An endless iterable of activation batches for dictionary_learning's trainSAE.

    Args:
        store: an ActStore, a path or a URL; or a sequence of them for aligned stores.
        layer: one layer (number or name): (batch, d) batches.
        layers: several layers (aligned, one shuffle): (batch, len(layers), d) batches.
        batch_size: activations per batch (dictionary_learning's `out_batch_size`).
        device: where batches go (e.g. "cuda"); None keeps them on the CPU.
        **stream_kwargs: TokenStream options (seed, token_mask, normalize, buffer_bytes...).
    """

    def __init__(
        self,
        store: ReaderLike | Sequence[ReaderLike],
        *,
        layer: Any = None,
        layers: Sequence[Any] | None = None,
        batch_size: int = 8192,
        device: str | None = None,
        **stream_kwargs: Any,
    ):
        import torch

        from actstore.loaders import TokenStream
        from actstore.read.api import as_reader

        stores = [as_reader(s) for s in (store if isinstance(store, (list, tuple)) else [store])]
        if (layer is None) == (layers is None):
            raise ValueError("pass layer=N for an SAE, or layers=[...] for a crosscoder (one of them)")
        numbers = [stores[0].layer_number(x) for x in ([layer] if layer is not None else layers)]
        stream_kwargs.setdefault("dtype", torch.float32)
        stream_kwargs.setdefault("drop_last", True)
        if layer is not None and len(stores) == 1:
            self.stream = TokenStream(stores[0], batch_size=batch_size, layers=numbers, **stream_kwargs)
            self.stacked = False
        else:
            self.stream = TokenStream.aligned(
                stores if len(stores) > 1 else stores[0],
                batch_size=batch_size,
                layers=numbers,
                stack=True,
                **stream_kwargs,
            )
            self.stacked = True
        if len(self.stream) == 0:
            raise ValueError(f"the store holds fewer than {batch_size} tokens: lower batch_size")
        self.device = device
        self.config = {
            "actstore_stores": [str(s.path) for s in stores],
            "layers": numbers,
            "out_batch_size": batch_size,
            "seed": self.stream.seed if hasattr(self.stream, "seed") else stream_kwargs.get("seed", 0),
            "d_submodule": int(stores[0].d_model),
        }
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> DictionaryLearningSource:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._it = iter(self.stream)
            try:
                batch = next(self._it)
                break
            except StopIteration:
                self._it = None  # the epoch ended: the next one is reshuffled (its own epoch number)
        return batch if self.device is None else batch.to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch taken (see TokenStream.state_dict)."""
        return self.stream.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._it = None
        self.stream.load_state_dict(state)


def paired_source(
    store_a: Any, store_b: Any, *, layer: Any, batch_size: int = 8192, **kwargs: Any
) -> DictionaryLearningSource:
    """Two stores captured from two models on the same tokens, layer `layer` of each, as
    (batch, 2, d) batches under one seeded shuffle (refused when their token ids differ):
    what dictionary_learning's crosscoder trainer takes, in place of PairedActivationCache."""
    return DictionaryLearningSource([store_a, store_b], layers=[layer], batch_size=batch_size, **kwargs)
