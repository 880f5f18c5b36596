"""Conversions between users' arrays (numpy or torch) and the stored dtypes.

bfloat16 is stored as its raw 16 bits (uint16); reading it back widens exactly to float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.layout.spec import FLOAT16_MAX


def to_numpy(x: Any, name: str) -> tuple[np.ndarray, str]:
    """A numpy view/copy of `x` and its source dtype name ('bfloat16' for torch bf16 bits)."""
    if hasattr(x, "detach") and hasattr(x, "dtype") and type(x).__module__.startswith("torch"):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:  # (a view of the same bits: strided views stay views)
            return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        return t.numpy(), str(t.dtype).removeprefix("torch.")
    if isinstance(x, np.ndarray):
        return x, x.dtype.name
    try:
        arr = np.asarray(x)
    except Exception as e:
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}") from e
    return arr, arr.dtype.name


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even), returned as uint16 bits; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of bfloat16 bits (uint16) to float32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def count_nonfinite_16(bits_or_f16: np.ndarray) -> int:
    """Number of inf/NaN values in a float16 or bfloat16 (as uint16) array, by exponent bits.

    Screened with two reductions that need no temporary array: a positive inf/NaN is the
    only pattern whose int16 view is >= the all-ones exponent, a negative one the only
    pattern whose uint16 view is >= sign|exponent.
    """
    if bits_or_f16.size == 0:
        return 0
    exp = 0x7C00 if bits_or_f16.dtype == np.float16 else 0x7F80
    u = bits_or_f16.view(np.uint16)
    if int(bits_or_f16.view(np.int16).max()) < exp and int(u.max()) < (0x8000 | exp):
        return 0
    return int(np.count_nonzero((u & np.uint16(exp)) == np.uint16(exp)))


def convert(x: np.ndarray, src: str, dst: str) -> tuple[np.ndarray, int, int]:
    """Convert `x` (dtype name `src`) to stored dtype `dst`.

    Returns (converted array, non-finite count in the input, count of finite input values
    that overflow to infinity in `dst`). The array is `x` itself when src is dst (a view
    keeps its strides; ShardWriter copies it once, into its staging), else a C-contiguous copy.
    """
    if src not in ("float16", "float32", "float64", "bfloat16"):
        raise TypeError(f"activations must be float16, bfloat16, float32 or float64, got {src}")
    if src == "bfloat16":
        if dst == "bfloat16":
            return x, count_nonfinite_16(x), 0
        x = bf16_bits_to_f32(x)
        src = "float32"
    if dst == "bfloat16":
        f = np.asarray(x, dtype=np.float32) if src != "float64" else x
        nonfinite = _count_nonfinite(f)
        if src == "float64":
            over = int(np.count_nonzero(np.isfinite(f) & (np.abs(f) > np.finfo(np.float32).max)))
            f = f.astype(np.float32)
        else:
            over = 0
        out = f32_to_bf16_bits(f)
        if not nonfinite:
            over += count_nonfinite_16(out)
        return out, nonfinite, over
    target = np.float16 if dst == "float16" else np.float32
    if src == dst:
        if dst == "float16":
            return x, count_nonfinite_16(x), 0
        return x, _count_nonfinite(x), 0
    if src == "float32" and dst == "float16":
        out = f32_to_f16(x)
        if not count_nonfinite_16(out):
            return out, 0, 0  # a non-finite or overflowing input value would be inf or NaN here
        nonfinite = _count_nonfinite(x)
    else:
        nonfinite = _count_nonfinite(x)
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.ascontiguousarray(x, dtype=target)
    over = 0
    if np.dtype(target).itemsize < x.dtype.itemsize:
        out_bad = count_nonfinite_16(out) if dst == "float16" else _count_nonfinite(out)
        if out_bad > nonfinite:
            # Values just above the max round down to it; only |x| past the rounding edge overflow.
            over = int(np.count_nonzero(np.isfinite(x) & ~np.isfinite(out)))
    return out, nonfinite, over


# torch runs element-wise work under this many elements inline, on the calling thread
# (at::internal::GRAIN_SIZE); bigger calls wake its OpenMP pool, which competes with the
# model's (or the training loop's) own threads for the cores.
TORCH_GRAIN = 32768

_UNSET: Any = object()
_torch_module: Any = _UNSET


def _torch() -> Any:
    """torch, imported on first use, or None where it is not installed: torch is optional
    (`pip install 'actstore[torch]'`) and every cast here has a numpy path, bit for bit equal."""
    global _torch_module
    if _torch_module is _UNSET:
        try:
            import torch
        except ImportError:
            torch = None
        _torch_module = torch
    return _torch_module


def require_torch(what: str, extra: str = "torch") -> Any:
    """torch, or a ModuleNotFoundError that says how to install it: `what` (the loaders,
    capture) needs torch, which the core (writer, reader, exports) does not."""
    torch = _torch()
    if torch is None:
        raise ModuleNotFoundError(
            f"{what} needs torch, which is not installed: pip install 'actstore[{extra}]'", name="torch"
        )
    return torch


def _torch_cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """`x` cast to `dtype` by torch's vectorised conversion (F16C for float16), in blocks
    under torch's parallel grain, so on this thread only. None where torch is not installed
    or cannot take `x` as it is: not C-contiguous, or read-only (torch.from_numpy warns on a
    np.memmap opened "r", say); the caller then casts with numpy."""
    if not x.flags.c_contiguous or not x.flags.writeable:
        return None
    torch = _torch()
    if torch is None:
        return None
    out = np.empty(x.shape, dtype)
    src, dst = torch.from_numpy(x.reshape(-1)), torch.from_numpy(out.reshape(-1))
    for i in range(0, src.numel(), TORCH_GRAIN):
        dst[i : i + TORCH_GRAIN].copy_(src[i : i + TORCH_GRAIN])
    return out


def f32_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 (C-contiguous copy), rounded to nearest even like numpy's cast.

    numpy casts float32 to float16 one element at a time in software (about 3.5 ns per
    element here); torch uses the CPU's vector conversion (about 0.45 ns). Both round the
    same way, bit for bit (tests/test_dtypes.py checks every float16 and the rounding
    edges between them); without torch, numpy's cast.
    """
    out = _torch_cast(x, np.dtype(np.float16)) if x.dtype == np.float32 else None
    return _numpy_f16(x) if out is None else out


def _numpy_f16(x: np.ndarray) -> np.ndarray:
    """f32_to_f16's numpy path (no torch, or an array torch cannot take)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ascontiguousarray(x, dtype=np.float16)


def to_f64(x: np.ndarray) -> np.ndarray:
    """A float64 copy of `x`. float16 goes through float32 with torch's vector conversion
    (exact: every float16 is a float32), then numpy's float32 -> float64: about half the
    time of numpy's direct float16 -> float64 cast (its path without torch)."""
    x = np.asarray(x)
    mid = _torch_cast(x, np.dtype(np.float32)) if x.dtype == np.float16 else None
    return _numpy_f64(x) if mid is None else mid.astype(np.float64)


def _numpy_f64(x: np.ndarray) -> np.ndarray:
    """to_f64's numpy path (no torch, or an array torch cannot take)."""
    with np.errstate(invalid="ignore"):  # a signalling NaN pattern raises the flag as it is quieted
        return np.array(x, dtype=np.float64)


def _count_nonfinite(x: np.ndarray) -> int:
    if np.isfinite(x.max(initial=0)) and np.isfinite(x.min(initial=0)):
        return 0
    return int(np.count_nonzero(~np.isfinite(x)))


def count_nonfinite(x: np.ndarray) -> int:
    """Number of inf/NaN values in an array in a stored dtype (float16, float32, or
    bfloat16 as its uint16 bits): the one screen of a batch's values."""
    if x.dtype in (np.float16, np.uint16):
        return count_nonfinite_16(x)
    return _count_nonfinite(x)


def clip_to(x: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Saturate finite values to the target dtype's range (on_overflow='clip')."""
    if src == "bfloat16":
        x = bf16_bits_to_f32(x)
    hi = FLOAT16_MAX if dst == "float16" else float(np.finfo(np.float32).max)
    finite = np.isfinite(x)
    return np.where(finite, np.clip(x, -hi, hi), x)
