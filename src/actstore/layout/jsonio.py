"""JSON as the format reads and writes it: bounded on the way in, standard on the way out."""

from __future__ import annotations

import json
from typing import Any

from actstore.errors import CorruptStoreError

MAX_JSON_BYTES = 256 * 2**20  # a manifest of 100,000 shards takes about 25 MB
MAX_JSON_DEPTH = 64  # no document of the format nests deeper than 6 (free-form attrs: 64)


def loads(data: bytes | str, where: str, *, what: str = "file") -> Any:
    """Parse a JSON document; damage of any kind is a CorruptStoreError naming `where`."""
    try:
        return parse(data)
    except ValueError as e:
        raise CorruptStoreError(f"{where} is not valid JSON ({e}); the {what} is damaged") from None


def parse(data: bytes | str) -> Any:
    """Parse a JSON document within the size and depth limits; ValueError says what is wrong."""
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{len(data)} bytes, more than the {MAX_JSON_BYTES} allowed")
    try:
        doc = json.loads(data)
    except UnicodeDecodeError as e:
        raise ValueError(str(e)) from None
    except RecursionError:
        raise ValueError("nested deeper than JSON parsing allows") from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return doc


def dumps(doc: Any, *, indent: int | None = 1) -> bytes:
    """Standard JSON (NaN and infinity refused), UTF-8; documents end with a newline."""
    text = json.dumps(doc, indent=indent, allow_nan=False)
    return (text + "\n").encode("utf-8") if indent is not None else text.encode("utf-8")


def dump_line(doc: Any) -> bytes:
    """One JSONL line."""
    return (json.dumps(doc, allow_nan=False) + "\n").encode("utf-8")


def _depth(doc: Any) -> int:
    """How many containers nest in `doc` (0 for a scalar), counted up to MAX_JSON_DEPTH + 1."""
    depth, level = 0, [doc]
    while depth <= MAX_JSON_DEPTH:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth
