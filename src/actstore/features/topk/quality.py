"""An SAE's reconstruction quality over the feature pass's tokens, accumulated as the pass
encodes them (no second read): per token x, its encoding f (all latents) and its
reconstruction x_hat = decode(f) (actstore.features.encoders.encoder.Encoder.decode):

- fraction of variance explained: 1 - E||x - x_hat||^2 / (E||x||^2 - ||E x||^2), SAELens's
  `explained_variance` (sae_lens/evals.py ExplainedVarianceCalculator);
- mse: E||x - x_hat||^2, the squared error summed over dimensions, averaged over tokens
  (SAELens's `mse`);
- l0: the mean count of non-zero latents a token (SAELens's `l0`);
- dead: latents that are zero on every token of the pass; dense: latents non-zero on more
  than DENSE_FRACTION of them.

Sums are float64 (the variance is a difference of two near-equal numbers); the per-token
products are float32, as the encode's. The host update takes numpy arrays, the device
update torch tensors on the encode's device (only the sums come back).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.features.encoders.encoder import LAYER_NORM_EPS, Encoder

DENSE_FRACTION = 0.1  # a latent non-zero on more than this fraction of the tokens is dense


class Reconstruction:
    """Sums for the quality figures of `encoder` (an SAE: encoder.decodes)."""

    def __init__(self, encoder: Encoder):
        self.encoder = encoder
        self.n = 0
        self.sum_x = np.zeros(encoder.d_in, np.float64)
        self.sum_sq_x = 0.0
        self.sum_sq_err = 0.0
        self.l0_sum = 0
        self.fires = np.zeros(encoder.n_features, np.int64)
        self._dev: dict[str, Any] | None = None  # the device update's sums, on the device

    def update(self, x: np.ndarray, h_fn: np.ndarray | None, *, relu: bool = False) -> None:
        """Tokens x (n, d_in) and their encoding h_fn (F, n) of all latents (None: encode them
        here); relu: h_fn holds a ReLU encoder's pre-activations (the output is their positive part)."""
        if not len(x):
            return
        x = np.asarray(x, np.float32)  # float16 rows: one converted copy
        if h_fn is None:
            h_fn = self.encoder.encode(x, feature_major=True)
        elif relu:
            h_fn = np.maximum(h_fn, 0)  # copy: the pre-activations stay the pass's
        err = x - self.encoder.decode(h_fn, x)
        self.n += len(x)
        self.sum_x += x.sum(axis=0, dtype=np.float64)
        self.sum_sq_x += float(np.einsum("nd,nd->", x, x, dtype=np.float64))
        self.sum_sq_err += float(np.einsum("nd,nd->", err, err, dtype=np.float64))
        nz = np.count_nonzero(h_fn, axis=1)
        self.fires += nz
        self.l0_sum += int(nz.sum())

    def update_tensor(self, x: Any, h_fn: Any | None) -> None:
        """As update, with torch tensors on the encode's device (h_fn (F, n) float32)."""
        import torch

        from actstore.features.encoders.torchenc import decode_tensor, encode_tensor

        if not len(x):
            return
        x = x.float()
        if h_fn is None:
            h_fn = encode_tensor(self.encoder, x, None, LAYER_NORM_EPS)
        err = x - decode_tensor(self.encoder, h_fn, x)
        d = self._dev
        if d is None:
            f64 = dict(dtype=torch.float64, device=x.device)
            d = self._dev = {
                "sum_x": torch.zeros(self.encoder.d_in, **f64),
                "sq_x": torch.zeros((), **f64),
                "sq_err": torch.zeros((), **f64),
                "fires": torch.zeros(self.encoder.n_features, dtype=torch.int64, device=x.device),
            }
        self.n += len(x)
        d["sum_x"] += x.sum(0, dtype=torch.float64)
        d["sq_x"] += (x * x).sum(dtype=torch.float64)
        d["sq_err"] += (err * err).sum(dtype=torch.float64)
        d["fires"] += (h_fn != 0).sum(1)

    def result(self) -> dict[str, Any]:
        """The figures (meta.json's `quality`); None where no token was seen."""
        if self._dev is not None:
            d = {k: v.cpu().numpy() for k, v in self._dev.items()}
            self.sum_x += d["sum_x"]
            self.sum_sq_x += float(d["sq_x"])
            self.sum_sq_err += float(d["sq_err"])
            self.fires += d["fires"]
            self.l0_sum += int(d["fires"].sum())
            self._dev = None
        n = self.n
        sizes = {"dense_fraction": DENSE_FRACTION, "n_latents": self.encoder.n_features}
        if not n:
            return {"n_tokens": 0, "fve": None, "mse": None, "l0": None, "dead": None, "dense": None} | sizes
        mean = self.sum_x / n
        variance = self.sum_sq_x / n - float(mean @ mean)
        mse = self.sum_sq_err / n
        return {
            "n_tokens": n,
            "fve": 1.0 - mse / variance if variance > 0 else None,
            "mse": mse,
            "l0": self.l0_sum / n,
            "dead": int(np.count_nonzero(self.fires == 0)),
            "dense": int(np.count_nonzero(self.fires > DENSE_FRACTION * n)),
        } | sizes


def reconstruct_tensor(encoder: Encoder, x: Any) -> Any:
    """An SAE's reconstruction (n, d_in) float32 of x (n, d_in), a tensor on its device
    (what actstore.capture.splice writes into the model)."""
    from actstore.features.encoders.torchenc import decode_tensor, encode_tensor

    xf = x.float()
    return decode_tensor(encoder, encode_tensor(encoder, xf, None, LAYER_NORM_EPS), xf)
