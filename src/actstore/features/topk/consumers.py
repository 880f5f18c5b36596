"""Where the pass's tokens go once read: encoded and accumulated on the host (numba or
the numpy reference, actstore.features.topk.accum) or on a torch device (the encode and the
update there, actstore.features.topk.device). Each consumer takes a group of examples at a time
(the buffer of their stored rows, the kept rows and their order keys), batches the kept
tokens to `tok_batch`, and keeps one accumulator per tail: the positive values, and for
the negative tail the positive pass over the negated values.

With sign "negative" the positive side still runs, with k = 1 and no pool: its
statistics fill features.parquet's positive columns (docs/features.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.features.encoders.encoder import LAYER_NORM_EPS, Encoder
from actstore.features.topk.accum import FeatureAccumulator


def tail_sizes(sign: str, k: int, pool: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(k, pool) of the positive side's accumulator and of the negative side's (None: no negative tail)."""
    pos = (k, pool) if sign != "negative" else (1, 0)
    return pos, ((k, pool) if sign != "positive" else None)


class HostConsumer:
    """Encode on the host (numpy, or torch on `device`), accumulate with numba or numpy.

    Args:
        encoder, ids: the directions and the feature subset (None: all).
        k, pool, seed, sign: the tails' sizes and the sampling seed.
        kernel: FeatureAccumulator's ("auto", "numba", "numpy").
        device: where the encode runs ("cpu", "cuda", None: numpy).
        tok_batch: tokens encoded at once.
        quality: an SAE's reconstruction sums (actstore.features.topk.quality), fed every encoded batch.
    """

    def __init__(
        self,
        encoder: Encoder,
        ids: np.ndarray | None,
        *,
        k: int,
        pool: int,
        seed: int,
        sign: str,
        kernel: str,
        device: str | None,
        tok_batch: int,
        quality: Any = None,
    ):
        n_f = encoder.n_features if ids is None else len(ids)
        (kp, mp), neg = tail_sizes(sign, k, pool)
        self.pos = FeatureAccumulator(n_f, kp, mp, seed, kernel=kernel)
        self.neg = FeatureAccumulator(n_f, *neg, seed, kernel=kernel) if neg else None
        self.encoder, self.ids, self.device, self.tok_batch = encoder, ids, device, tok_batch
        self.quality = quality
        # the kernel reads the stored rows in place (float16: no conversion, no transpose)
        self.direct = self.pos.fused and encoder.kind == "neurons"
        # a ReLU encoder's pre-activations are enough for the positive side (values <= 0 read as 0)
        self.lazy = self.pos.fused and encoder.activation == "relu" and self.neg is None
        self.xs: list[np.ndarray] = []
        self.os: list[np.ndarray] = []
        self.n_pending = 0
        self._scratch: np.ndarray | None = None

    def group(self, flat: np.ndarray, rows: np.ndarray, ords: np.ndarray) -> None:
        """A group's stored rows flat (N, d) (float32 for bfloat16 stores), its kept rows and their ords."""
        if self.direct:  # flat may be a whole mapped region: only the rows `rows` are read
            if self.ids is None:
                self.pos.update(flat.T, ords, rows)  # the stored rows, in place
            else:
                x = flat[rows][:, self.ids]  # copy: the kept rows' chosen features
                self.pos.update(x.T, ords)
            if self.neg is not None:
                x = flat[rows] if self.ids is None else x  # copy: the kept rows
                self.neg.update(self._negated(x).T, ords)
            return
        if not len(rows):
            return
        self.xs.append(flat[rows])  # copy: the kept rows, out of the group's buffer
        self.os.append(ords)
        self.n_pending += len(rows)
        while self.n_pending >= self.tok_batch:
            self._flush()

    def finish(self) -> tuple[FeatureAccumulator, FeatureAccumulator | None]:
        while self.n_pending:
            self._flush()
        return self.pos, self.neg

    def _flush(self) -> None:
        """Encode the first tok_batch pending tokens (all if fewer) and feed them."""
        x, o = _take(self.xs, self.os, self.tok_batch)
        self.n_pending -= len(x)
        h = self.encoder.encode(x, self.ids, feature_major=True, device=self.device, relu_later=self.lazy)
        if self.quality is not None:  # a subset's values do not reconstruct: all latents encoded again
            self.quality.update(x, h if self.ids is None else None, relu=self.lazy)
        self.pos.update(h, o, clipped=self.lazy)
        if self.neg is not None:
            self.neg.update(self._negated(h), o)

    def _negated(self, a: np.ndarray) -> np.ndarray:
        return np.negative(a, out=self._scratch_like(a))

    def _scratch_like(self, a: np.ndarray) -> np.ndarray:
        """A reused scratch array of a's shape and dtype (written before: no page faults)."""
        if self._scratch is None or self._scratch.size < a.size or self._scratch.dtype != a.dtype:
            self._scratch = np.empty(a.size, a.dtype)
        return self._scratch[: a.size].reshape(a.shape)


class DeviceConsumer:
    """Encode and accumulate with torch on `device` (actstore.features.topk.device); only the
    (features x k) results and the statistics come back.

    Args: as HostConsumer, device a torch.device.
    """

    def __init__(
        self,
        encoder: Encoder,
        ids: np.ndarray | None,
        *,
        k: int,
        pool: int,
        seed: int,
        sign: str,
        device: Any,
        tok_batch: int,
        quality: Any = None,
    ):
        from actstore.features.topk.device import TorchAccumulator

        n_f = encoder.n_features if ids is None else len(ids)
        (kp, mp), neg = tail_sizes(sign, k, pool)
        self.pos = TorchAccumulator(n_f, kp, mp, seed, device)
        self.neg = TorchAccumulator(n_f, *neg, seed, device) if neg else None
        self.encoder, self.ids, self.device, self.tok_batch = encoder, ids, device, tok_batch
        self.quality = quality
        self.xs: list[Any] = []
        self.os: list[np.ndarray] = []
        self.n_pending = 0

    def group(self, flat: Any, rows: np.ndarray, ords: np.ndarray) -> None:
        """flat: the group's stored rows as a tensor on the device (N, d)."""
        import torch

        if not len(rows):
            return
        r = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.device, non_blocking=True)
        self.xs.append(flat.index_select(0, r))  # copy: the kept rows, on the device
        self.os.append(ords)
        self.n_pending += len(rows)
        while self.n_pending >= self.tok_batch:
            self._flush()

    def finish(self) -> tuple[FeatureAccumulator, FeatureAccumulator | None]:
        while self.n_pending:
            self._flush()
        return self.pos.to_host(), (self.neg.to_host() if self.neg is not None else None)

    def _flush(self) -> None:
        from actstore.features.encoders.torchenc import encode_tensor

        x, o = _take(self.xs, self.os, self.tok_batch)
        self.n_pending -= len(x)
        h = encode_tensor(self.encoder, x, self.ids, LAYER_NORM_EPS)
        if self.quality is not None:  # before the negative side negates h in place
            self.quality.update_tensor(x, h if self.ids is None else None)
        self.pos.update(h, o)
        if self.neg is not None:
            self.neg.update(h.neg_(), o)


def _take(xs: list[Any], os_: list[np.ndarray], n: int) -> tuple[Any, np.ndarray]:
    """The first n pending rows (all if fewer) and their ords; the rest stay pending."""
    if len(xs) == 1:
        x, o = xs[0], os_[0]
    elif isinstance(xs[0], np.ndarray):
        x, o = np.concatenate(xs), np.concatenate(os_)
    else:
        import torch

        x, o = torch.cat(xs), np.concatenate(os_)
    xs.clear()
    os_.clear()
    if len(x) > n:
        xs.append(x[n:])
        os_.append(o[n:])
        x, o = x[:n], o[:n]
    return x, o
