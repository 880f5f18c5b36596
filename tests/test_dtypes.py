"""Stored-dtype conversions: exhaustive over 16-bit patterns, property-tested for float32."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from actstore.dtypes import bf16_bits_to_f32, convert, count_nonfinite_16, f32_to_bf16_bits

ALL16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


def test_nonfinite_screen_is_exact_for_every_float16_and_bfloat16_pattern():
    f16 = ALL16.view(np.float16)
    assert count_nonfinite_16(f16) == int((~np.isfinite(f16)).sum()) == 2 * 1024
    bf = bf16_bits_to_f32(ALL16)
    assert count_nonfinite_16(ALL16) == int((~np.isfinite(bf)).sum()) == 2 * 128
    for bits in ALL16[::97]:  # one value at a time: the screen alone must decide
        one = np.array([bits], np.uint16)
        assert count_nonfinite_16(one.view(np.float16)) == int(not np.isfinite(one.view(np.float16)[0]))
        assert count_nonfinite_16(one) == int(not np.isfinite(bf16_bits_to_f32(one)[0]))


@given(arrays(np.float32, st.integers(0, 64), elements=st.floats(-3.0000000054977558e+38, 3.0000000054977558e+38, width=32, allow_nan=False, allow_subnormal=False)))
def test_bfloat16_rounding_matches_torch(x):
    bits = f32_to_bf16_bits(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits, want)


@given(arrays(np.float32, st.integers(0, 64), elements=st.floats(-1e5, 1e5, width=32, allow_subnormal=False)))
def test_float16_conversion_counts_overflow_exactly(x):
    out, nonfinite, over = convert(x, "float32", "float16")
    assert out.dtype == np.float16 and nonfinite == 0
    assert over == int((~np.isfinite(x.astype(np.float16))).sum())
    finite = np.isfinite(out)
    assert np.array_equal(out[finite], x[finite].astype(np.float16))
