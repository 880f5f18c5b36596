"""Training loaders over an ActStore (needs torch); see docs/loaders.md.

- PairDataset + PairBatchSampler: b random examples x k random layers -> (b, k, T, D).
- TokenStream (+ TokenLoader): shuffled, resumable (batch_size, D) token vectors.
"""

from actstore.dtypes import require_torch

require_torch(
    "actstore.loaders (the training loaders behind actstore.torch)"
)  # a clear error, not "No module named 'torch'"

from actstore.loaders.pairs import PairBatchSampler, PairDataset, PairIndex  # noqa: E402
from actstore.loaders.tokenloader import TokenLoader  # noqa: E402
from actstore.loaders.tokens import TokenStream  # noqa: E402

__all__ = ["PairBatchSampler", "PairDataset", "PairIndex", "TokenLoader", "TokenStream"]
