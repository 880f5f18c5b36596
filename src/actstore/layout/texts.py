"""Text lines of a writer shard (`text/<name>.jsonl`, docs/format.md): one JSON object per
example, in example order, `{"i": <local index>, "sample_key": <key>, <name>: <value>}`."""

from __future__ import annotations

import json
from typing import Any

from actstore.errors import CorruptStoreError
from actstore.layout import jsonio, spec

INDEX = "i"  # the line's local example index


def dump_line(i: int, sample_key: str, name: str, value: Any) -> bytes:
    """The line of text `name` of local example `i` (UTF-8, not ASCII-escaped, newline-ended,
    standard JSON). A value that is not JSON-serialisable (NaN and infinity included: they
    have no standard JSON form) raises TypeError or ValueError."""
    return (
        json.dumps({INDEX: i, spec.SAMPLE_KEY: sample_key, name: value}, ensure_ascii=False, allow_nan=False) + "\n"
    ).encode("utf-8")


def parse_line(line: bytes, where: str, name: str) -> tuple[Any, Any]:
    """(index, value) of one line of text `name`; a line that is not a JSON object holding
    both raises CorruptStoreError naming `where`. The caller compares the index with the
    line's position."""
    rec = jsonio.loads(line, where, what="text line")
    if not isinstance(rec, dict) or INDEX not in rec or name not in rec:
        raise CorruptStoreError(f'{where}: a line is not of the form {{"{INDEX}": int, ..., "{name}": value}}')
    return rec[INDEX], rec[name]
