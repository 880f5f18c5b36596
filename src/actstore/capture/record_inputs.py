"""What record() takes in: its batches as CaptureBatch objects, the model's device and forward
arguments, and whether to keep token ids."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from actstore import catalog
from actstore.inputs.prepare import CaptureBatch
from actstore.errors import CaptureError
from actstore.storage import open_storage


def auto_token_ids(store: str | os.PathLike, batch: CaptureBatch) -> bool:
    """Keep token ids when the batches carry input_ids, unless the store (resumed) has none."""
    storage = open_storage(store)
    if catalog.has_identity(storage):
        return catalog.read_identity(storage).token_ids
    return "input_ids" in batch.inputs


def as_batch(raw: Any, module: Any) -> CaptureBatch:
    if isinstance(raw, CaptureBatch):
        return raw
    if isinstance(raw, Mapping):
        return CaptureBatch(inputs=dict(raw), keys=[])
    if hasattr(raw, "dtype") and hasattr(raw, "is_floating_point"):
        name = "pixel_values" if raw.is_floating_point() else "input_ids"
        if accepts(module, name):
            return CaptureBatch(inputs={name: raw}, keys=[])
        return CaptureBatch(inputs={}, keys=[], args=(raw,))  # a plain module: positional input
    raise CaptureError(
        f"a batch must be a CaptureBatch, a dict of forward arguments or a tensor; got {type(raw).__name__}"
    )


def device_of(module: Any) -> Any:
    import torch

    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def accepts(module: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
