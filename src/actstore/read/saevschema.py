"""Checks of metadata.json and shards.json against their protocol: every problem collected.

Each problem is one line starting with the file it concerns, so `verify-saev` can list
them all and tests can compare exact strings.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from actstore.errors import ActstoreError, SaevFormatError
from actstore.layout import jsonio
from actstore.layout import saevspec as P
from actstore.storage.files import read_regular
from actstore.storage.regular import describe

HINT = "a saev shard directory holds only regular files (run `actstore verify-saev`)"


def read_json(path: Path) -> tuple[Any, str | None]:
    """(document, None) or (None, the problem) for a JSON file: a regular file (a FIFO there
    would block, a folder fail) within the JSON size and depth limits."""
    try:
        data = read_regular(path, error=SaevFormatError, hint=HINT, max_bytes=jsonio.MAX_JSON_BYTES)
    except FileNotFoundError:
        return None, f"{path.name}: missing"
    except ActstoreError as e:
        return None, f"{path.name}: {str(e).removeprefix(str(path) + ' ')}"
    try:
        return jsonio.parse(data), None
    except ValueError as e:
        return None, f"{path.name}: not valid UTF-8 JSON ({e})"


def regular_size(path: Path) -> int | str | None:
    """The size of the regular file `path`; None when nothing is there; else what stands
    there, in words (a folder, a FIFO, a symbolic link, ...). Never follows a link."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else describe(st.st_mode)


def trailing_empty_shard(geom: P.ShardGeometry, counts: list[int], n_entries: int) -> bool:
    """Whether shards.json ends in the empty shard saev's writer makes when n_examples is a
    multiple of examples_per_shard (it opens, imports and verifies like the others)."""
    s = geom.examples_per_shard
    return bool(s) and geom.n_examples % s == 0 and n_entries == geom.n_shards + 1 and bool(counts) and counts[-1] == 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_metadata(md: Any) -> tuple[str | None, P.ShardGeometry | None, list[str]]:
    """(protocol, geometry, problems) of a metadata document.

    Protocol is None when it is not one this module knows (nothing else is checked then);
    geometry is None when the fields it needs are unusable.
    """
    f = P.METADATA_FILE
    if not isinstance(md, dict):
        return None, None, [f"{f}: must be a JSON object, got {type(md).__name__}"]
    proto = md.get("protocol")
    if proto not in P.PROTOCOLS:
        return None, None, [f"{f}: protocol must be one of {list(P.PROTOCOLS)}. Got {proto!r}."]
    fields = P.FIELDS[proto]
    problems = []
    missing = [k for k in fields if k not in md]
    unknown = [k for k in md if k not in fields]
    if missing:
        problems.append(f"{f}: missing fields {missing} (protocol {proto} has exactly: {', '.join(fields)})")
    if unknown:
        problems.append(f"{f}: unknown fields {unknown} (protocol {proto} has exactly: {', '.join(fields)})")
    if proto == "2.1" and not missing and not unknown and tuple(md) != fields:
        problems.append(f"{f}: fields are out of order; protocol 2.1 requires the order {', '.join(fields)}")
    problems += [f"{f}: {p}" for p in _field_problems(md, proto)]
    geom = None
    needed = ("layers", "cls_token", "d_model", P.CONTENT_KEY[proto], P.N_KEY[proto], P.BUDGET_KEY[proto])
    if not any(p.startswith(f"{f}: {k} ") for p in problems for k in needed) and all(k in md for k in needed):
        geom = P.geometry(md, proto)
        if geom.examples_per_shard < 1:
            problems.append(
                f"{f}: {P.BUDGET_KEY[proto]} {geom.budget} is smaller than one example "
                f"({geom.tokens_per_example} tokens x {geom.n_layers} layers): no example fits in a shard"
            )
            geom = None
    return proto, geom, problems


def _field_problems(md: dict[str, Any], proto: str) -> list[str]:
    out = []

    def bad(key: str, want: str) -> None:
        out.append(f"{key} must be {want}. Got {md[key]!r}.")

    if "family" in md and md["family"] not in P.FAMILIES[proto]:
        bad("family", f"one of {list(P.FAMILIES[proto])}")
    if "ckpt" in md and (not isinstance(md["ckpt"], str) or not md["ckpt"]):
        bad("ckpt", "a non-empty string")
    if "layers" in md:
        v = md["layers"]
        if not isinstance(v, list) or not v or not all(_is_int(x) and x >= 0 for x in v) or len(set(v)) != len(v):
            bad("layers", "a non-empty list of distinct non-negative ints")
    for key in (P.CONTENT_KEY[proto], "d_model", P.BUDGET_KEY[proto]):
        if key in md and not (_is_int(md[key]) and md[key] > 0):
            bad(key, "a positive int")
    n_key = P.N_KEY[proto]
    if n_key in md and not (_is_int(md[n_key]) and md[n_key] >= 0):
        bad(n_key, "a non-negative int")
    if "cls_token" in md and not isinstance(md["cls_token"], bool):
        bad("cls_token", "true or false")
    if "data" in md:
        v = md["data"]
        if proto == "2.0" and not (isinstance(v, dict) and isinstance(v.get("__class__"), str)):
            bad("data", "an object with a string __class__ field")
        if proto == "2.1" and not isinstance(v, str):
            bad("data", "a string")
    if "dataset" in md and not (isinstance(md["dataset"], str) and os.path.isabs(md["dataset"])):
        bad("dataset", "an absolute path (string)")
    if proto == "2.1" and "pixel_agg" in md and md["pixel_agg"] not in P.PIXEL_AGGS:
        bad("pixel_agg", f"one of {list(P.PIXEL_AGGS)}")
    if "dtype" in md and md["dtype"] != P.DTYPE:
        bad("dtype", f"{P.DTYPE!r}")
    return out


def check_shards_json(entries: Any, geom: P.ShardGeometry | None, proto: str) -> tuple[list[str], list[str]]:
    """(shard file names listed, problems) of a shards.json document."""
    f = P.SHARDS_FILE
    key = P.SHARD_COUNT_KEY[proto]
    if not isinstance(entries, list):
        return [], [f"{f}: must be a JSON array of {{name, {key}}} objects, got {type(entries).__name__}"]
    names, counts, problems = [], [], []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or set(e) != {"name", key}:
            got = sorted(e) if isinstance(e, dict) else type(e).__name__
            problems.append(
                f"{f}: entry {i} must have exactly the keys ['name', '{key}'] (protocol {proto}); got {got}"
            )
            continue
        want = P.SHARD_NAME_FORMAT.format(i)
        if e["name"] != want:
            problems.append(f"{f}: entry {i} is named {e['name']!r}, expected {want!r}")
        else:
            names.append(want)
        if not _is_int(e[key]) or e[key] < 0:
            problems.append(f"{f}: entry {i} has {key} {e[key]!r}, expected a non-negative int")
        else:
            counts.append((i, e[key]))
    if geom is None:
        return names, problems
    if geom.n_shards > len(entries) + 1:  # counted before listing them: metadata may claim any number
        problems.append(
            f"{f}: lists {len(entries)} shards; {geom.n_examples} examples at "
            f"{geom.examples_per_shard} per shard make {geom.n_shards}"
        )
        return names, problems
    want_counts = geom.shard_counts()
    if trailing_empty_shard(geom, [n for _, n in counts], len(entries)):
        want_counts = [*want_counts, 0]  # saev's own writer adds one when n_examples fills every shard
    if len(entries) != len(want_counts):
        problems.append(
            f"{f}: lists {len(entries)} shards; {geom.n_examples} examples at "
            f"{geom.examples_per_shard} per shard make {len(want_counts)}"
        )
    for i, n in counts:
        if i < len(want_counts) and n != want_counts[i]:
            problems.append(
                f"{f}: {P.SHARD_NAME_FORMAT.format(i)} holds {n} examples, expected {want_counts[i]} "
                f"(examples_per_shard {geom.examples_per_shard}; the last shard holds the remainder)"
            )
    return names, problems
