"""The one parser of a device option: `cpu`, `cuda` or `cuda:N` within the visible devices.

Every command's `--device` (cli/params.py DEVICE) and the library's `device=` arguments
(load_model, the feature encoders, the loaders) go through `parse_device`, so that a
device no command can use is one line naming the value and the allowed ones, raised
before any model or store is opened. torch is imported only for a `cuda` value.
"""

from __future__ import annotations

import re
from typing import Any

from actstore.errors import DeviceError

AUTO = "auto"
_CUDA = re.compile(r"cuda(?::(\d{1,4}))?")


def parse_device(value: Any, *, name: str = "device", auto: bool = False, visible: bool = True) -> str:
    """`value` checked: "cpu", "cuda" or "cuda:N" with N among the CUDA devices torch sees
    (CUDA_VISIBLE_DEVICES applies); "auto" too where `auto`. A torch.device is taken by its
    name. Returns the value as a string.

    Args:
        value: what the caller gave.
        name: how the caller spells the option in messages ("--device", "device").
        auto: whether "auto" (the caller picks) is allowed.
        visible: check that torch sees the CUDA device (False: the spelling only, for a
            device of another machine, such as a Ray worker's).

    Raises:
        DeviceError: the value is not one of those, or names a CUDA device torch cannot see.
    """
    text = str(value) if type(value).__name__ == "device" else value
    allowed = "'cpu', 'cuda', 'cuda:N'" + (" or 'auto'" if auto else "")
    if not isinstance(text, str):
        raise DeviceError(f"{name} must be one of {allowed}. Got {value!r}.")
    if text == "cpu" or (auto and text == AUTO):
        return text
    m = _CUDA.fullmatch(text)
    if m is None:
        raise DeviceError(f"{name} must be one of {allowed}. Got {text!r}.")
    if not visible:
        return text
    try:
        import torch
    except ImportError:
        raise DeviceError(f"{name} {text} needs torch: pip install 'actstore[torch]' (or use cpu)") from None
    if not torch.cuda.is_available():
        raise DeviceError(f"{name} {text}: torch {torch.__version__} sees no CUDA device here; use cpu")
    n = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise DeviceError(
            f"{name} {text}: torch sees {n} CUDA device{'s' if n != 1 else ''} (cuda:0..cuda:{n - 1}; "
            "CUDA_VISIBLE_DEVICES applies); pick one of them"
        )
    return text
