"""torch datasets over an ActStore: `from actstore.torch import PairDataset, TokenStream`.

The implementation lives in actstore.loaders (docs/loaders.md).
"""

from actstore.loaders import PairBatchSampler, PairDataset, PairIndex, TokenLoader, TokenStream

__all__ = ["PairBatchSampler", "PairDataset", "PairIndex", "TokenLoader", "TokenStream"]
