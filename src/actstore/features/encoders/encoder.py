"""Encoders: a layer's activations (n, d_in) -> feature activations (n, F).

One class covers every direction source: `f(x) = act(norm(x) - b_pre) @ W + b)`, with
`act` one of identity, relu, jumprelu (per-feature or scalar threshold), topk (per token,
over all F features, then ReLU: SAELens's and dictionary_learning's TopK) and an optional
per-feature scale after the matmul (SAELens's `rescale_acts_by_decoder_norm`). Neurons are
the stored dimensions themselves (no matmul). The readers of each checkpoint format are in
actstore.features.encoders.sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.errors import EncoderError

ACTIVATIONS = ("identity", "relu", "jumprelu", "topk")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
LAYER_NORM_EPS = 1e-5  # SAELens's run_time_activation_ln_in default


@dataclass(frozen=True, eq=False)
class Encoder:
    """Directions and how a source turns activations into feature values.

    Args:
        kind: "neurons", "directions", "saelens", "saev" or "dictionary_learning".
        d_in: the activation width it takes (the layer's d_model).
        n_features: F.
        W: (d_in, F) float32 encoder matrix; None for neurons.
        b: (F,) bias added after the matmul, or None.
        b_pre: (d_in,) subtracted from the input first (b_dec for SAEs that say so), or None.
        activation: one of ACTIVATIONS.
        threshold: JumpReLU threshold (F,) or a scalar; feature values <= it become 0.
        k: TopK's k (topk only).
        topk_relu: TopK takes the ReLU of the values it keeps (SAELens, dictionary_learning);
            False keeps them signed (saev).
        normalize: one of NORMALIZATIONS, applied to each token before b_pre.
        post_scale: (F,) multiplied into the pre-activations (before the activation), or None.
        W_dec: (F, d_in) decoder directions when the source has them (logit tables).
        b_dec: (d_in,) the decoder's bias when the source is an SAE: `decode` then gives its
            reconstruction (actstore.features.topk.quality); None for probes and neurons.
        source: where it came from (path) and its checksum, for meta.json.
    """

    kind: str
    d_in: int
    n_features: int
    W: np.ndarray | None = None
    b: np.ndarray | None = None
    b_pre: np.ndarray | None = None
    activation: str = "identity"
    threshold: Any = None
    k: int | None = None
    normalize: str = "none"
    post_scale: np.ndarray | None = None
    topk_relu: bool = True
    W_dec: np.ndarray | None = None
    b_dec: np.ndarray | None = None
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise EncoderError(f"activation must be one of {list(ACTIVATIONS)}. Got {self.activation!r}.")
        if self.normalize not in NORMALIZATIONS:
            raise EncoderError(f"input normalisation must be one of {list(NORMALIZATIONS)}. Got {self.normalize!r}.")
        if self.kind != "neurons":
            if self.W is None or self.W.shape != (self.d_in, self.n_features):
                got = None if self.W is None else self.W.shape
                raise EncoderError(
                    f"{self.kind} encoder: W must be (d_in, F) = ({self.d_in}, {self.n_features}), got {got}"
                )
        for name, v, n in (
            ("b", self.b, self.n_features),
            ("b_pre", self.b_pre, self.d_in),
            ("post_scale", self.post_scale, self.n_features),
            ("b_dec", self.b_dec, self.d_in),
        ):
            if v is not None and np.shape(v) != (n,):
                raise EncoderError(f"{self.kind} encoder: {name} must have shape ({n},), got {np.shape(v)}")
        if self.activation == "topk" and not (isinstance(self.k, int) and 0 < self.k):
            raise EncoderError(f"a TopK encoder needs k >= 1, got {self.k!r}")

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (meta.json)."""
        return {
            "kind": self.kind,
            "d_in": self.d_in,
            "n_features": self.n_features,
            "activation": self.activation,
            "k": self.k,
            "normalize": self.normalize,
            "b_pre": self.b_pre is not None,
            **self.source,
        }

    def check_input(self, d_model: int, where: str = "the layer") -> None:
        """Raise before any pass when the encoder does not take vectors of width d_model."""
        if d_model != self.d_in:
            raise EncoderError(
                f"the {self.kind} encoder takes d_in={self.d_in} but {where} has d_model={d_model}: "
                "use directions trained on this layer's activations (or a store of that model)"
            )

    def encode(
        self,
        x: np.ndarray,
        features: np.ndarray | None = None,
        *,
        feature_major: bool = False,
        device: str | None = None,
        relu_later: bool = False,
    ) -> np.ndarray:
        """(n, d_in) float activations -> (n, F') float32 feature values, F' = len(features)
        (all F when None); with feature_major, the (F', n) C-contiguous array instead (what
        the pass consumes: one row per feature, no transpose copy). TopK selects over all F
        before the subset is taken. `device` ("cpu", "cuda", "cuda:1"): compute with torch
        there (actstore.features.encoders.torchenc); None: numpy. relu_later: a ReLU encoder returns its
        pre-activations (the positive values are the output; the caller treats the rest as 0)."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise EncoderError(f"encode takes (n, {self.d_in}) activations, got {x.shape}")
        if device is not None and self.kind != "neurons":
            from actstore.features.encoders.torchenc import encode_torch

            h = encode_torch(self, x, features, device, LAYER_NORM_EPS, relu_later)
            return h if feature_major else h.T
        if self.kind == "neurons":
            sel = x if features is None else x[:, features]
            if not feature_major:
                return np.asarray(sel, np.float32)
            return np.array(sel.T, dtype=np.float32, order="C")  # the one copy: converted, feature-major
        x = self._normalized(x.astype(np.float32, copy=False))
        if self.b_pre is not None:
            x = x - self.b_pre  # one copy: the centred input
        cols = features if self.activation != "topk" else None
        W = self.W if cols is None else self.W[:, cols]
        h = W.T @ x.T  # (F', n), computed feature-major by BLAS from the transposed views
        if self.b is not None:
            h += (self.b if cols is None else self.b[cols])[:, None]
        if self.post_scale is not None:
            h *= (self.post_scale if cols is None else self.post_scale[cols])[:, None]
        if not (relu_later and self.activation == "relu"):
            h = self._activate(h, cols)
        if features is not None and cols is None:
            h = h[features]  # copy: the subset's rows
        return h if feature_major else h.T

    @property
    def decodes(self) -> bool:
        """An SAE: it has a decoder (W_dec and b_dec), so it reconstructs its input."""
        return self.W_dec is not None and self.b_dec is not None

    def decode(self, h_fn: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The reconstruction (n, d_in) float32 of the inputs x (n, d_in) from their encoded
        values h_fn (F, n) (all features, feature-major): `(h / post_scale) @ W_dec + b_dec`,
        then the input normalisation undone per token (as SAELens's decode does)."""
        h = h_fn if self.post_scale is None else h_fn / self.post_scale[:, None]
        x_hat = h.T @ self.W_dec  # (n, d_in), BLAS on the transposed view
        x_hat += self.b_dec
        if self.normalize == "constant_norm_rescale":
            x_hat *= np.linalg.norm(x, axis=1, keepdims=True) / np.float32(self.d_in**0.5)
        elif self.normalize == "layer_norm":
            x_hat *= x.std(axis=1, ddof=1, keepdims=True)
            x_hat += x.mean(axis=1, keepdims=True)
        return x_hat

    def _normalized(self, x: np.ndarray) -> np.ndarray:
        if self.normalize == "constant_norm_rescale":
            return x * (np.float32(self.d_in**0.5) / np.linalg.norm(x, axis=1, keepdims=True))
        if self.normalize == "layer_norm":
            x = x - x.mean(axis=1, keepdims=True)
            return x / (x.std(axis=1, ddof=1, keepdims=True) + np.float32(LAYER_NORM_EPS))
        return x

    def _activate(self, h: np.ndarray, cols: np.ndarray | None) -> np.ndarray:
        """The activation on feature-major pre-activations h (F', n), in place."""
        if self.activation == "identity":
            return h
        if self.activation == "relu":
            return np.maximum(h, 0, out=h)
        if self.activation == "jumprelu":
            t = self.threshold
            if np.ndim(t):
                t = np.asarray(t)[cols] if cols is not None else np.asarray(t)
                t = t[:, None]
            keep = h > t
            np.maximum(h, 0, out=h)
            h *= keep
            return h
        # topk: keep the k largest of each token (column), zero the rest
        F = h.shape[0]
        k = min(self.k, F)
        if k == F:
            return np.maximum(h, 0, out=h) if self.topk_relu else h
        idx = np.argpartition(h, F - k, axis=0)[F - k :]
        cols_n = np.arange(h.shape[1])[None, :]
        kept = h[idx, cols_n]
        out = np.zeros_like(h)
        out[idx, cols_n] = np.maximum(kept, 0) if self.topk_relu else kept
        return out


def neurons(d_model: int) -> Encoder:
    """The stored dimensions themselves: feature j is dimension j of the layer."""
    return Encoder(kind="neurons", d_in=int(d_model), n_features=int(d_model), source={"path": None, "sha256": None})
