"""Stored-dtype conversions: exhaustive over 16-bit patterns, property-tested for float32."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from actstore.dtypes import bf16_bits_to_f32, convert, count_nonfinite_16, f32_to_bf16_bits, f32_to_f16, to_f64

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


def _float16_edges() -> np.ndarray:
    """Every finite float16 as float32, the midpoints between neighbours (ties: round to
    even), the float32 neighbours of each midpoint, and the specials: inf, NaN, -0.0, the
    overflow edge (65520 rounds to inf, its float32 predecessor to 65504), float32
    subnormals."""
    f16 = ALL16.view(np.float16)
    v = np.unique(f16[np.isfinite(f16)].astype(np.float64))
    mid = ((v[:-1] + v[1:]) / 2).astype(np.float32)  # exact: 12 significant bits
    edge = np.float32(65520.0)
    specials = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-45, -1e-45, 3e38, -3e38, edge, -edge,
                         np.nextafter(edge, np.float32(0)), np.nextafter(-edge, np.float32(0))], np.float32)
    parts = [v.astype(np.float32), mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)), specials]
    return np.concatenate(parts)


def test_fast_float32_to_float16_cast_equals_numpy_bit_for_bit():
    x = _float16_edges()
    assert x.size > 4 * 32768  # several of the blocks the cast runs in
    ro = x.copy()
    ro.flags.writeable = False  # read-only (a np.memmap opened "r"): the numpy path, no torch warning
    for arr in (x, x[::-1][: x.size // 7 * 7].reshape(-1, 7)[:, :5].copy(), x.reshape(1, -1)[:, ::3], ro):  # contiguous, 2-D, strided
        with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("error")  # torch.from_numpy would warn on the read-only one
            got, want = f32_to_f16(arr), arr.astype(np.float16)
        assert got.shape == arr.shape and got.flags.c_contiguous
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_fast_float16_to_float64_is_exact_for_every_pattern():
    f16 = ALL16.view(np.float16).reshape(256, 256)
    got, want = to_f64(f16), f16.astype(np.float64)
    assert got.shape == (256, 256) and got.dtype == np.float64
    ro = f16.copy()
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(to_f64(ro), got, equal_nan=True)
    f32 = f16.astype(np.float32)[:, ::2]  # other dtypes and layouts: numpy's cast
    assert np.array_equal(to_f64(f32), f32.astype(np.float64), equal_nan=True)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023 and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint64)[~nan], want.view(np.uint64)[~nan])


@given(arrays(np.float32, st.integers(0, 40000), elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)))
def test_float16_conversion_counts_every_nonfinite_and_overflow(x):
    out, nonfinite, over = convert(x, "float32", "float16")
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    assert nonfinite == int((~np.isfinite(x)).sum())
    assert over == int((np.isfinite(x) & ~np.isfinite(want)).sum())
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan) and np.array_equal(out.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
