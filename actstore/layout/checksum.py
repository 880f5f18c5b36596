"""crc32c (Castagnoli), the format's checksum."""

from __future__ import annotations

from typing import Any

from crc32c import crc32c as _crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from `value`."""
    return _crc32c(data, value)
