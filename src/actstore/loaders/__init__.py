"""Training loaders over an ActStore (needs torch); see docs/loaders.md.

- PairDataset + PairBatchSampler: b random examples x k random layers -> (b, k, T, D).
- TokenStream (+ TokenLoader): shuffled, resumable (batch_size, D) token vectors; its
  options one StreamSpec, where it stands one StreamPosition; TokenStream.aligned(...) and
  TokenStream.follow(...) make the other kinds (every kind is a BaseTokenStream);
  TokenStream.follow(..., consumer="name") a durable, resumable ConsumerStream.
"""

from actstore.dtypes import require_torch

require_torch(
    "actstore.loaders (the training loaders behind actstore.torch)"
)  # a clear error, not "No module named 'torch'"

from actstore.loaders.aligned import AlignedTokenStream  # noqa: E402
from actstore.loaders.base import BaseTokenStream  # noqa: E402
from actstore.loaders.consumer import ConsumerStream  # noqa: E402
from actstore.loaders.follow import FollowStream  # noqa: E402
from actstore.loaders.pairs import PairBatchSampler, PairDataset, PairIndex  # noqa: E402
from actstore.loaders.position import StreamPosition  # noqa: E402
from actstore.loaders.spec import StreamSpec  # noqa: E402
from actstore.loaders.tokenloader import TokenLoader  # noqa: E402
from actstore.loaders.tokens import TokenStream  # noqa: E402

__all__ = [
    "AlignedTokenStream",
    "BaseTokenStream",
    "ConsumerStream",
    "FollowStream",
    "PairBatchSampler",
    "PairDataset",
    "PairIndex",
    "StreamPosition",
    "StreamSpec",
    "TokenLoader",
    "TokenStream",
]
