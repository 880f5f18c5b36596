"""What record() takes in: its batches as CaptureBatch objects on the model's device, the
model's device and forward arguments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from actstore.errors import CaptureError
from actstore.inputs.prepare import CaptureBatch


def as_batch(raw: Any, module: Any, device: Any) -> CaptureBatch:
    """`raw` (a CaptureBatch, a dict of forward arguments or a tensor) as a CaptureBatch
    whose tensors are on `device` (a tensor already there is not copied)."""
    if isinstance(raw, CaptureBatch):
        batch = raw
    elif isinstance(raw, Mapping):
        batch = CaptureBatch(inputs=dict(raw), keys=[])
    elif hasattr(raw, "dtype") and hasattr(raw, "is_floating_point"):
        name = "pixel_values" if raw.is_floating_point() else "input_ids"
        if accepts(module, name):
            batch = CaptureBatch(inputs={name: raw}, keys=[])
        else:
            batch = CaptureBatch(inputs={}, keys=[], args=(raw,))  # a plain module: positional input
    else:
        raise CaptureError(
            f"a batch must be a CaptureBatch, a dict of forward arguments or a tensor; got {type(raw).__name__}"
        )
    moved = {k: _to(v, device) for k, v in batch.inputs.items()}
    args = tuple(_to(a, device) for a in batch.args)
    if any(moved[k] is not v for k, v in batch.inputs.items()) or any(a is not b for a, b in zip(args, batch.args)):
        batch = replace(batch, inputs=moved, args=args)
    return batch


def _to(x: Any, device: Any) -> Any:
    if hasattr(x, "to") and hasattr(x, "device") and x.device != device:
        return x.to(device)
    return x


def device_of(module: Any) -> Any:
    import torch

    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def accepts(module: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
