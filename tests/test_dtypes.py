"""Stored-dtype conversions: exhaustive over 16-bit patterns, property-tested for float32.

Runs with and without torch (scripts/test_core.sh): roundings are checked against a
table-lookup reference, the fast torch casts and their numpy fallbacks alike; against
torch itself too where it is installed.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from actstore.dtypes import (
    _numpy_f16,
    _numpy_f64,
    _torch_cast,
    bf16_bits_to_f32,
    convert,
    count_nonfinite_16,
    f32_to_bf16_bits,
    f32_to_f16,
    to_f64,
)

ALL16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
TORCH_INSTALLED = importlib.util.find_spec("torch") is not None
torch = importlib.import_module("torch") if TORCH_INSTALLED else None  # imported here: not inside a timed example


def _round16_reference(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 `x` rounded to float16 or bfloat16 bits by looking up the neighbouring values
    in float64 (no cast of numpy's or torch's): nearest, ties to the even bit pattern,
    overflow to inf at the midpoint past the largest finite value; NaN's bits are unspecified."""
    inf_bits = 0x7C00 if fmt == "float16" else 0x7F80
    bits = ALL16[: inf_bits + 1]  # the non-negative finite patterns (ascending in value), then inf
    if fmt == "float16":
        vals = bits[:-1].view(np.float16).astype(np.float64)
    else:
        vals = (bits[:-1].astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    vals = np.append(vals, 2.0 ** (16 if fmt == "float16" else 128))  # where inf's rounding interval starts
    a = np.abs(np.asarray(x, np.float64)).reshape(-1)
    hi = np.minimum(np.searchsorted(vals, a), len(vals) - 1)  # vals[hi - 1] < a <= vals[hi]
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (bits[hi] % 2 == 0))
    out = np.where(up, bits[hi], bits[lo]) | np.where(np.signbit(x).reshape(-1), np.uint16(0x8000), np.uint16(0))
    return out.astype(np.uint16).reshape(np.shape(x))


def test_nonfinite_screen_is_exact_for_every_float16_and_bfloat16_pattern():
    f16 = ALL16.view(np.float16)
    assert count_nonfinite_16(f16) == int((~np.isfinite(f16)).sum()) == 2 * 1024
    bf = bf16_bits_to_f32(ALL16)
    assert count_nonfinite_16(ALL16) == int((~np.isfinite(bf)).sum()) == 2 * 128
    for bits in ALL16[::97]:  # one value at a time: the screen alone must decide
        one = np.array([bits], np.uint16)
        assert count_nonfinite_16(one.view(np.float16)) == int(not np.isfinite(one.view(np.float16)[0]))
        assert count_nonfinite_16(one) == int(not np.isfinite(bf16_bits_to_f32(one)[0]))


@given(
    arrays(
        np.float32,
        st.integers(0, 64),
        elements=st.floats(
            -3.0000000054977558e38, 3.0000000054977558e38, width=32, allow_nan=False, allow_subnormal=False
        ),
    )
)
def test_bfloat16_rounding_is_nearest_even_like_torch(x):
    bits = f32_to_bf16_bits(x)
    assert np.array_equal(bits, _round16_reference(x, "bfloat16"))
    if torch is not None:  # and torch's own cast, where there is one to compare with
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
    specials = np.array(
        [
            np.inf,
            -np.inf,
            np.nan,
            -0.0,
            0.0,
            1e-45,
            -1e-45,
            3e38,
            -3e38,
            edge,
            -edge,
            np.nextafter(edge, np.float32(0)),
            np.nextafter(-edge, np.float32(0)),
        ],
        np.float32,
    )
    parts = [
        v.astype(np.float32),
        mid,
        np.nextafter(mid, np.float32(np.inf)),
        np.nextafter(mid, np.float32(-np.inf)),
        specials,
    ]
    return np.concatenate(parts)


def test_torch_casts_exactly_where_torch_is_installed():
    x = np.ones(10, np.float32)
    assert (_torch_cast(x, np.dtype(np.float16)) is not None) == TORCH_INSTALLED


@pytest.mark.parametrize("cast", [f32_to_f16, _numpy_f16], ids=["fast", "numpy-fallback"])
def test_float32_to_float16_casts_round_to_nearest_even_bit_for_bit(cast):
    x = _float16_edges()
    assert x.size > 4 * 32768  # several of the blocks the torch cast runs in
    ref = _round16_reference(x, "float16")
    ro = x.copy()
    ro.flags.writeable = False  # read-only (a np.memmap opened "r"): the numpy path, no torch warning
    for arr in (
        x,
        x[::-1][: x.size // 7 * 7].reshape(-1, 7)[:, :5].copy(),
        x.reshape(1, -1)[:, ::3],
        ro,
    ):  # contiguous, 2-D, strided
        with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("error")  # torch.from_numpy would warn on the read-only one
            got, want = cast(arr), arr.astype(np.float16)
        assert got.shape == arr.shape and got.flags.c_contiguous
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        assert np.array_equal(got.view(np.uint16)[~nan], _round16_reference(arr, "float16")[~nan])
    assert (
        np.count_nonzero(ref == 0x7C00) > 0 and np.count_nonzero((ref & 0x7C00) == 0) > 0
    )  # overflow and subnormals were tried


@pytest.mark.parametrize("cast", [to_f64, _numpy_f64], ids=["fast", "numpy-fallback"])
def test_float16_to_float64_is_exact_for_every_pattern(cast):
    f16 = ALL16.view(np.float16).reshape(256, 256)
    got, want = cast(f16), f16.astype(np.float64)
    assert got.shape == (256, 256) and got.dtype == np.float64
    ro = f16.copy()
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(cast(ro), got, equal_nan=True)
    f32 = f16.astype(np.float32)[:, ::2]  # other dtypes and layouts: numpy's cast
    assert np.array_equal(cast(f32), f32.astype(np.float64), equal_nan=True)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023 and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint64)[~nan], want.view(np.uint64)[~nan])


@given(
    arrays(
        np.float32,
        st.integers(0, 40000),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    )
)
def test_float16_conversion_counts_every_nonfinite_and_overflow(x):
    out, nonfinite, over = convert(x, "float32", "float16")
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    assert nonfinite == int((~np.isfinite(x)).sum())
    assert over == int((np.isfinite(x) & ~np.isfinite(want)).sum())
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan) and np.array_equal(out.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
