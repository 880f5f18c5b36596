"""crc32c (Castagnoli), the format's checksum, and the combination of checksums of pieces.

`combine(crc_a, crc_b, len_b)` is the crc32c of the bytes A then B from the crc32c of each
(zlib's crc32_combine, for the Castagnoli polynomial): the writer checksums every
(example, layer) row once and derives the block's chained checksum from the rows'.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from crc32c import crc32c as _crc32c

_POLY = 0x82F63B78  # Castagnoli, reflected


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from `value`."""
    return _crc32c(data, value)


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@lru_cache(maxsize=64)
def _shift(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator that appends `nbytes` zero bytes to a crc (32 columns)."""
    odd = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    op = tuple(1 << n for n in range(32))  # identity
    n = nbytes
    while n:
        even = _square(odd)  # first pass: one zero byte
        if n & 1:
            op = tuple(_times(even, c) for c in op)
        n >>= 1
        if not n:
            break
        odd = _square(even)
        if n & 1:
            op = tuple(_times(odd, c) for c in op)
        n >>= 1
    return op


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B)."""
    if len_b <= 0:
        return crc_a
    return _times(_shift(len_b), crc_a) ^ crc_b


def extend_zeros(crc: int, nbytes: int) -> int:
    """crc32c(A + `nbytes` zero bytes) from crc32c(A), in O(log nbytes): a sparse hole's
    checksum without reading (or making) its zeros."""
    if nbytes <= 0:
        return crc
    return _times(_shift(nbytes), crc ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def combine_all(crc: int, crcs: Iterable[int], length: int) -> int:
    """Chain `crc` with pieces of `length` bytes each, given their own crcs, in order."""
    op = _shift(length)
    for c in crcs:
        crc = _times(op, crc) ^ int(c)
    return crc


def per_sample_crc32c(values: Any, dtype: str) -> int:
    """crc32c of per-sample rows as an array of `dtype` stores them: C order, little endian
    (the bytes of its chunks, without their padding), whatever type they were given in."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt.itemsize > 1 and dt.kind in "iuf":
        dt = dt.newbyteorder("<")
    return crc32c(np.ascontiguousarray(values, dtype=dt).tobytes())  # a copy: per-sample rows are small
