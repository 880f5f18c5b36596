"""The pass's per-batch update in torch, on the device the encode ran on (a GPU, or the
CPU in tests): the same state as actstore.features.topk.accum's FeatureAccumulator, kept as
tensors there, so that only the (features x k) results and the statistics come back.

Each batch is a (F, n) float32 tensor of feature values with order keys `ords` (n,),
increasing along the pass. Per batch, without a host round trip:

- statistics: max (NaN kept), count and float64 sum of the positive values, and the
  histogram (the float32 bits' exponent and top two mantissa bits, as accum's bins) by
  one bincount over (feature, bin);
- top k: each value > 0 as one int64 key, `bits << 31 | (2**31 - 1 - position)`
  (positive float32 bits order as the values; an earlier position wins a tie), the batch's
  own top k by torch.topk, then merged with the kept k the same way (the kept entries
  first: they came earlier, and rank order puts equal values in ord order). So ties go by
  (example, token) exactly as the numpy reference's;
- the sample pool: the smallest (key, ord) of the positive tokens, key the token's seeded
  hash (accum.hash_keys, computed on the host: it is per token, not per value), as
  `key << 31 | position`, the smallest by torch.topk(largest=False), merged likewise.

`to_host()` returns a FeatureAccumulator holding the same numbers (rank order), from
which the tables are built as on the CPU path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.features.topk.accum import _LO_CODE, _SHIFT, N_BINS, NO_ORD, FeatureAccumulator, hash_keys, sort_code

_LOW = (1 << 31) - 1  # the position field of a key


class TorchAccumulator:
    """FeatureAccumulator's state as tensors on `device`.

    Args:
        n_features, k, pool, seed: as FeatureAccumulator.
        device: a torch.device (where the batches are).
    """

    def __init__(self, n_features: int, k: int, pool: int, seed: int, device: Any):
        import torch

        self.torch, self.device = torch, device
        self.F, self.k, self.pool, self.seed = n_features, k, pool, seed
        z = lambda *shape, dtype, fill=0: torch.full(shape, fill, dtype=dtype, device=device)  # noqa: E731
        self.top_val = z(n_features, k, dtype=torch.float32)  # rank order; 0 = empty
        self.top_ord = z(n_features, k, dtype=torch.int64, fill=NO_ORD)
        self.max = z(n_features, dtype=torch.float32, fill=float("-inf"))
        self.n_pos = z(n_features, dtype=torch.int64)
        self.sum_pos = z(n_features, dtype=torch.float64)
        self.hist = z(n_features * (N_BINS + 1), dtype=torch.int64)  # a last bin per feature for values <= 0
        self.pool_key = z(n_features, pool, dtype=torch.int64, fill=NO_ORD)  # (key << 31 | 0): NO_ORD = empty
        self.pool_val = z(n_features, pool, dtype=torch.float32)
        self.pool_ord = z(n_features, pool, dtype=torch.int64, fill=NO_ORD)
        self.n_tokens = 0

    def update(self, h: Any, ords: np.ndarray) -> None:
        """Add a batch: h (F, n) float32 on the device, ords (n,) int64 on the host."""
        torch = self.torch
        n = h.shape[1]
        if not n:
            return
        self.n_tokens += n
        o = torch.from_numpy(np.ascontiguousarray(ords, np.int64)).to(self.device, non_blocking=True)
        pos = h > 0
        self.max = torch.maximum(self.max, h.amax(dim=1))  # NaN propagates, as numpy's max
        self.n_pos += pos.sum(dim=1)
        self.sum_pos += torch.where(pos, h, 0).sum(dim=1, dtype=torch.float64)
        bits = h.view(torch.int32)
        code = ((bits >> _SHIFT) - (_LO_CODE - 1)).clamp_(0, N_BINS - 1)
        code = torch.where(pos, code, N_BINS)
        code += torch.arange(self.F, device=self.device)[:, None] * (N_BINS + 1)
        self.hist += torch.bincount(code.view(-1), minlength=self.hist.numel())
        del code
        position = torch.arange(n, device=self.device)
        key = torch.where(pos, (bits.long() << 31) | (_LOW - position), -1)
        self._merge_top(h, key, o)
        del key
        if self.pool:
            tok_key = torch.from_numpy(hash_keys(ords, self.seed).astype(np.int64)).to(self.device, non_blocking=True)
            pkey = torch.where(pos, (tok_key << 31) | position, NO_ORD)
            self._merge_pool(h, pkey, o)

    def _merge_top(self, h: Any, key: Any, o: Any) -> None:
        torch = self.torch
        kb = min(self.k, h.shape[1])
        bk, bi = torch.topk(key, kb, dim=1)  # the batch's top k, largest key first
        cand_val = torch.cat([self.top_val, torch.where(bk >= 0, h.gather(1, bi), 0)], dim=1)
        cand_ord = torch.cat([self.top_ord, torch.where(bk >= 0, o[bi], NO_ORD)], dim=1)
        bits = cand_val.view(torch.int32).long()
        place = torch.arange(cand_val.shape[1], device=self.device)
        ckey = torch.where(cand_val > 0, (bits << 31) | (_LOW - place), -1)
        _, take = torch.topk(ckey, self.k, dim=1)
        self.top_val = cand_val.gather(1, take)
        self.top_ord = cand_ord.gather(1, take)

    def _merge_pool(self, h: Any, pkey: Any, o: Any) -> None:
        torch = self.torch
        mb = min(self.pool, h.shape[1])
        bk, bi = torch.topk(pkey, mb, dim=1, largest=False)  # the batch's smallest (key, position)
        full = bk != NO_ORD
        cand_key = torch.cat([self.pool_key, torch.where(full, (bk >> 31) << 31, NO_ORD)], dim=1)
        cand_val = torch.cat([self.pool_val, torch.where(full, h.gather(1, bi), 0)], dim=1)
        cand_ord = torch.cat([self.pool_ord, torch.where(full, o[bi], NO_ORD)], dim=1)
        place = torch.arange(cand_key.shape[1], device=self.device)
        ckey = torch.where(cand_key != NO_ORD, cand_key | place, NO_ORD)
        _, take = torch.topk(ckey, self.pool, dim=1, largest=False)
        self.pool_key = cand_key.gather(1, take)
        self.pool_val = cand_val.gather(1, take)
        self.pool_ord = cand_ord.gather(1, take)

    def to_host(self) -> FeatureAccumulator:
        """The state as a FeatureAccumulator (rank order), for the tables."""
        acc = FeatureAccumulator(self.F, self.k, self.pool, self.seed, kernel="numpy")
        host = lambda t: t.cpu().numpy()  # noqa: E731
        acc.top_val, acc.top_ord = host(self.top_val), host(self.top_ord)
        filled = acc.top_ord != NO_ORD
        acc.top_code = np.where(filled, sort_code(-acc.top_val), np.iinfo(np.uint32).max).astype(np.uint32)
        acc.max, acc.n_pos, acc.sum_pos = host(self.max), host(self.n_pos), host(self.sum_pos)
        acc.hist = np.ascontiguousarray(host(self.hist).reshape(self.F, N_BINS + 1)[:, :N_BINS])
        pk = host(self.pool_key)
        acc.pool_key = np.where(pk != NO_ORD, pk >> 31, np.iinfo(np.uint32).max).astype(np.uint32)
        acc.pool_val, acc.pool_ord = host(self.pool_val), host(self.pool_ord)
        acc.n_tokens = self.n_tokens
        return acc
