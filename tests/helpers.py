"""Small builders shared by the core tests."""

from __future__ import annotations

import numpy as np

from actstore.dtypes import bf16_bits_to_f32, f32_to_bf16_bits

# The store layouts the loader and remote-read tests run on (ShardWriter keyword arguments).
LAYOUTS = {"v2": {"zarr_format": 2}, "v3": {"zarr_format": 3}, "v3-sharded": {"zarr_format": 3, "shard_examples": 4}}


def random_acts(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random activations already representable in `dtype` (bf16 as float32 values)."""
    x = rng.standard_normal(shape).astype(np.float32) * 3
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    return x


def expected_view(x: np.ndarray, dtype: str) -> np.ndarray:
    """What ActStore returns for data logged as `x` in a `dtype` store."""
    if dtype == "float16":
        return x.astype(np.float16)
    return x.astype(np.float32)
