"""crc32c combination (actstore/layout/checksum.py): the writer checksums each row once and
derives the block's chained checksum from the rows' (the format's block crc is unchanged:
the golden stores in tests/test_store_golden.py still match byte for byte)."""

from __future__ import annotations

from factory import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.layout.checksum import combine, combine_all, crc32c


@settings(deadline=None, derandomize=True)
@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 2**32 - 1))
def test_combine_equals_the_checksum_of_the_concatenation(a, b, seed):
    start = crc32c(seed.to_bytes(4, "little"))
    assert combine(crc32c(a, start), crc32c(b), len(b)) == crc32c(b, crc32c(a, start)) == crc32c(a + b, start)


@settings(max_examples=examples(50), deadline=None, derandomize=True)
@given(st.lists(st.binary(min_size=37, max_size=37), max_size=20), st.integers(0, 2**32 - 1))
def test_combine_all_chains_equal_length_rows(rows, crc):
    assert combine_all(crc, [crc32c(r) for r in rows], 37) == crc32c(b"".join(rows), crc)


def test_long_rows():
    row = bytes(range(256)) * 1543  # 395,008 bytes: one (example, layer) of a ViT-B in float16
    rows = [row[i:] + row[:i] for i in range(0, 40, 7)]
    assert combine_all(0, [crc32c(r) for r in rows], len(row)) == crc32c(b"".join(rows))
