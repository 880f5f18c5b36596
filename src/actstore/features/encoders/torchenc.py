"""Encoder.encode in torch, on the CPU or an accelerator: the matmul with its bias in one
call (addmm), the activation in place, the same semantics as the numpy path (the tests
compare both with the source libraries). Weights are moved to the device once."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.devices import parse_device
from actstore.errors import FeatureError

_CACHE: dict[tuple[int, str], dict[str, Any]] = {}


def torch_device(device: str) -> Any:
    device = parse_device(device, name="--device")
    try:
        import torch
    except ImportError:
        raise FeatureError(f"--device {device} needs torch: pip install 'actstore[torch]'") from None
    return torch.device(device)


def _weights(enc: Any, dev: Any) -> dict[str, Any]:
    import torch

    key = (id(enc), str(dev))
    w = _CACHE.get(key)
    if w is None or w["enc"] is not enc:
        t = lambda a: None if a is None else torch.as_tensor(np.asarray(a, np.float32), device=dev)  # noqa: E731
        w = {
            "enc": enc,
            "W": t(enc.W),
            "b": t(enc.b),
            "b_pre": t(enc.b_pre),
            "post": t(enc.post_scale),
            "thr": t(enc.threshold) if enc.threshold is not None else None,
        }
        _CACHE.clear()  # one encoder's weights on the device at a time
        _CACHE[key] = w
    return w


def encode_torch(
    enc: Any, x: np.ndarray, features: np.ndarray | None, device: str, layer_norm_eps: float, relu_later: bool = False
) -> np.ndarray:
    """(n, d_in) -> (F', n) float32 feature-major values of Encoder `enc`, computed with torch
    on `device` (relu_later: a ReLU encoder's pre-activations, as Encoder.encode)."""
    import torch

    dev = torch_device(device)
    h = encode_tensor(enc, torch.as_tensor(np.ascontiguousarray(x), device=dev), features, layer_norm_eps, relu_later)
    return h.cpu().numpy() if h.device.type != "cpu" else h.numpy()


def encode_tensor(
    enc: Any, x: Any, features: np.ndarray | None, layer_norm_eps: float, relu_later: bool = False
) -> Any:
    """(n, d_in) tensor (any float dtype, on its device) -> (F', n) float32 C-contiguous
    feature values on the same device: Encoder.encode's semantics, neurons included."""
    import torch

    dev = x.device
    if enc.kind == "neurons":
        sel = x if features is None else x[:, torch.as_tensor(features, device=dev)]
        return sel.T.float().contiguous()  # the one copy: converted, feature-major
    w = _weights(enc, dev)
    xt = x.float()
    if enc.normalize == "constant_norm_rescale":
        xt = xt * (enc.d_in**0.5 / xt.norm(dim=1, keepdim=True))
    elif enc.normalize == "layer_norm":
        xt = xt - xt.mean(dim=1, keepdim=True)
        xt = xt / (xt.std(dim=1, keepdim=True) + layer_norm_eps)
    if w["b_pre"] is not None:
        xt = xt - w["b_pre"]
    cols = None if features is None or enc.activation == "topk" else torch.as_tensor(features, device=dev)
    W = w["W"] if cols is None else w["W"][:, cols]
    b = w["b"] if cols is None or w["b"] is None else w["b"][cols]
    h = torch.addmm(b[:, None], W.T, xt.T) if b is not None else W.T @ xt.T  # (F', n), the bias fused into the matmul
    if w["post"] is not None:
        h *= (w["post"] if cols is None else w["post"][cols])[:, None]
    if enc.activation == "relu" and not relu_later:
        h.relu_()
    elif enc.activation == "jumprelu":
        t = w["thr"]
        if t.ndim:
            t = (t if cols is None else t[cols])[:, None]
        h = torch.where(h > t, h.relu(), torch.zeros((), device=dev))
    elif enc.activation == "topk":
        k = min(enc.k, h.shape[0])
        vals, idx = torch.topk(h, k, dim=0)
        out = torch.zeros_like(h)
        h = out.scatter_(0, idx, vals.relu() if enc.topk_relu else vals)
    if features is not None and cols is None:
        h = h[torch.as_tensor(features, device=dev)]
    return h.contiguous()


def decode_tensor(enc: Any, h_fn: Any, x: Any) -> Any:
    """The reconstruction (n, d_in) float32 of x (n, d_in) from its encoding h_fn (F, n), on
    their device: Encoder.decode's semantics."""
    import torch

    w = _weights(enc, x.device)
    if "W_dec" not in w:
        w["W_dec"] = torch.as_tensor(enc.W_dec, device=x.device)
        w["b_dec"] = torch.as_tensor(enc.b_dec, device=x.device)
    h = h_fn if w["post"] is None else h_fn / w["post"][:, None]
    x_hat = torch.addmm(w["b_dec"][None, :], h.T, w["W_dec"])
    if enc.normalize == "constant_norm_rescale":
        x_hat = x_hat * (x.norm(dim=1, keepdim=True) / enc.d_in**0.5)
    elif enc.normalize == "layer_norm":
        x_hat = x_hat * x.std(dim=1, keepdim=True) + x.mean(dim=1, keepdim=True)
    return x_hat
