"""The manifest: merge committed writer shards into manifest.json; parse and validate it."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actstore import __version__, spec
from actstore.chunkio import crc32c
from actstore.config import StoreConfig, check_format_header
from actstore.errors import CorruptStoreError, DiskFullError, NotFinalizedError, StoreNotFoundError
from actstore.fsutil import atomic_write_bytes, atomic_write_json, safe_child
from actstore.stats import RunningStats

_SHARD_RE = re.compile(r"^shard-(\d{5})\.zarr$")
MAX_EXAMPLES = 2**48  # a manifest claiming more is refused before anything is allocated


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    shard: int
    name: str
    start: int
    n_examples: int
    complete: bool
    n_blocks: int
    crc32c: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    config: StoreConfig
    n_examples: int
    shards: tuple[ShardEntry, ...]
    truncation: dict[str, dict[str, float]]
    nonfinite: dict[str, int]
    overflow: dict[str, int]
    stats: str | None
    created: str
    actstore_version: str


def read_blocks(shard_path: Path, n_blocks: int) -> list[dict[str, Any]]:
    """The first `n_blocks` block records of a shard (later lines are uncommitted)."""
    path = shard_path / spec.BLOCKS_FILE
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if len(lines) - 1 < n_blocks:
        raise CorruptStoreError(f"{path} holds {len(lines) - 1} block records; its commit record says {n_blocks}")
    try:
        blocks = [json.loads(line) for line in lines[:n_blocks]]
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise CorruptStoreError(f"{path} has a damaged block record ({e})") from None
    for i, b in enumerate(blocks):
        _check_block(b, path, i)
    return blocks


def _check_block(b: Any, path: Path, i: int) -> None:
    """A block record has the documented fields and types (it is untrusted JSON)."""
    ok = (
        isinstance(b, dict)
        and all(_is_count(b.get(k)) for k in ("start", "stop", "nbytes"))
        and b["start"] < b["stop"]
        and isinstance(b.get("crc32c"), dict)
        and all(isinstance(k, str) and _is_count(v) and v < 2**32 for k, v in b["crc32c"].items())
    )
    if not ok:
        raise CorruptStoreError(
            f"{path}: block record {i} must be {{\"start\": int, \"stop\": int > start, \"crc32c\": {{segment: uint32}}, "
            f"\"nbytes\": int}}, got {str(b)[:200]}"
        )


def blocks_checksum(blocks: list[dict[str, Any]]) -> int:
    """crc32c over every block's per-segment crc32c (sorted segment names), in block order."""
    crc = 0
    for b in blocks:
        for name in sorted(b["crc32c"]):
            crc = crc32c(struct.pack("<I", int(b["crc32c"][name]) & 0xFFFFFFFF), crc)
    return crc


def finalize(path: str | os.PathLike, *, allow_partial: bool = False) -> Manifest:
    """Merge the committed writer shards of a store into manifest.json (atomically).

    Args:
        path: the store root.
        allow_partial: include the committed prefix of shards whose writer never closed
            (crashed and not to be resumed); by default such a shard is an error.

    Returns:
        The manifest written. Examples are ordered shard-major: ascending shard number,
        then each shard's local order.
    """
    from actstore.writer import _read_commit, read_identity

    root = Path(path)
    if not (root / spec.IDENTITY_FILE).exists():
        raise StoreNotFoundError(f"{root} is not an actstore store (no {spec.IDENTITY_FILE}); nothing to finalize")
    cfg = read_identity(root)
    shards_dir = root / spec.SHARDS_DIR
    names = sorted(p.name for p in shards_dir.iterdir() if _SHARD_RE.match(p.name)) if shards_dir.exists() else []
    if not names:
        raise CorruptStoreError(f"{root} has no writer shards in {spec.SHARDS_DIR}/; write some before finalizing")
    entries, incomplete = [], []
    trunc = {s.name: 0 for s in cfg.segments}
    nonfinite = {s.name: 0 for s in cfg.segments}
    overflow = {s.name: 0 for s in cfg.segments}
    stats: RunningStats | None = None
    stats_ok = True
    start = 0
    for name in names:
        sdir = shards_dir / name
        rec = _read_commit(sdir)
        if not rec["complete"]:
            incomplete.append(f"shard {int(_SHARD_RE.match(name).group(1))} ({rec['n_committed']} examples committed)")
            if not allow_partial:
                continue
        blocks = read_blocks(sdir, rec["n_blocks"])
        n = rec["n_committed"]
        covered = 0
        for b in blocks:
            if b["start"] != covered:
                raise CorruptStoreError(f"{sdir}: block records are not contiguous at example {covered}")
            covered = b["stop"]
        if covered != n:
            raise CorruptStoreError(f"{sdir}: block records cover {covered} examples, the commit record says {n}")
        entries.append(
            ShardEntry(
                shard=int(_SHARD_RE.match(name).group(1)), name=name, start=start, n_examples=n,
                complete=bool(rec["complete"]), n_blocks=len(blocks), crc32c=blocks_checksum(blocks),
                nbytes=sum(int(b["nbytes"]) for b in blocks),
            )
        )
        start += n
        for d, k in ((trunc, "truncated"), (nonfinite, "nonfinite"), (overflow, "overflow")):
            for seg, v in rec[k].items():
                d[seg] = d.get(seg, 0) + int(v)
        if rec.get("stats_file") and n:
            try:
                st = RunningStats.load(safe_child(sdir, rec["stats_file"]))
            except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise CorruptStoreError(f"{sdir}: statistics file {rec['stats_file']!r} is unreadable ({e})") from None
            if stats is None:
                stats = st
            else:
                stats.merge(st)
        elif n:
            stats_ok = False
    if incomplete and not allow_partial:
        raise NotFinalizedError(
            f"cannot finalize {root}: {', '.join(incomplete)} not closed (a writer still running, or killed). "
            "Resume and close it (ShardWriter(..., resume=True) or `actstore write --resume`), "
            "or pass allow_partial=True (`actstore finalize --allow-partial`) to publish only what was committed."
        )
    stats_name = None
    if stats is not None and stats_ok:
        # Named by content, so that a finalize killed before it replaces manifest.json
        # leaves the old manifest with its own statistics (older files are kept for
        # readers still holding the previous manifest; `actstore verify` lists them).
        data = stats.to_bytes()
        stats_name = spec.STATS_FILE.format(crc32c(data))
        _publish(atomic_write_bytes, root / stats_name, data, root)
    n_total = start
    doc = {
        "format": spec.FORMAT_NAME,
        "format_version": spec.FORMAT_VERSION,
        "actstore_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": cfg.to_json(),
        "order": spec.ORDER_SHARD_MAJOR,
        "n_examples": n_total,
        "shards": [e.__dict__ for e in entries],
        "truncation": {
            s: {"count": c, "fraction": (c / n_total) if n_total else 0.0} for s, c in trunc.items()
        },
        "nonfinite": nonfinite,
        "overflow": overflow,
        "stats": stats_name,
    }
    _publish(atomic_write_json, root / spec.MANIFEST_FILE, doc, root)
    return parse_manifest(doc, root)


def _publish(write, path: Path, data: Any, root: Path) -> None:
    """An atomic write of finalize; a full disk leaves the previous manifest and says so."""
    try:
        write(path, data)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        err = DiskFullError(
            f"out of disk space while finalizing {root} ({os.strerror(e.errno)}); the previous manifest is unchanged. "
            f"Free space, then rerun `actstore finalize {root}`"
        )
        err.errno = e.errno
        raise err from e


def load_manifest(root: str | os.PathLike) -> Manifest:
    """Read and validate manifest.json of a store root."""
    root = Path(root)
    path = root / spec.MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if (root / spec.IDENTITY_FILE).exists() or (root / spec.SHARDS_DIR).exists():
            raise NotFinalizedError(
                f"{root} has writer shards but was never finalized (no {spec.MANIFEST_FILE}); "
                f"run `actstore finalize {root}` once every writer has closed"
            ) from None
        raise StoreNotFoundError(f"{root} is not an actstore store (no {spec.MANIFEST_FILE})") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptStoreError(f"{path} is not valid JSON ({e}); the manifest is damaged, rerun `actstore finalize`") from None
    return parse_manifest(doc, root)


def parse_manifest(doc: Any, root: Path) -> Manifest:
    """Validate a manifest document; every problem is a CorruptStoreError naming the field."""
    where = str(root / spec.MANIFEST_FILE)
    check_format_header(doc, where)
    missing = [k for k in spec.MANIFEST_FIELDS if k not in doc]
    if missing:
        raise CorruptStoreError(f"{where} lacks fields {missing}")
    if doc["order"] != spec.ORDER_SHARD_MAJOR:
        raise CorruptStoreError(f"{where}: order must be {spec.ORDER_SHARD_MAJOR!r}, got {doc['order']!r}")
    try:
        cfg = StoreConfig.from_json(doc["config"])
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # untrusted JSON: any shape
        raise CorruptStoreError(f"{where}: bad config ({e})") from None
    n_total = doc["n_examples"]
    if not _is_count(n_total) or n_total > MAX_EXAMPLES:
        raise CorruptStoreError(f"{where}: n_examples must be an int in 0..{MAX_EXAMPLES}, got {n_total!r}")
    if not isinstance(doc["shards"], list):
        raise CorruptStoreError(f"{where}: shards must be a list")
    entries = []
    start = 0
    seen = set()
    for s in doc["shards"]:
        if not isinstance(s, dict) or set(s) != set(spec.MANIFEST_SHARD_FIELDS):
            raise CorruptStoreError(f"{where}: shard entry {s!r} must have exactly the fields {list(spec.MANIFEST_SHARD_FIELDS)}")
        if not isinstance(s["name"], str) or not _SHARD_RE.match(s["name"]):
            raise CorruptStoreError(f"{where}: shard name {s['name']!r} is not of the form shard-NNNNN.zarr")
        safe_child(root, f"{spec.SHARDS_DIR}/{s['name']}")
        for k in ("shard", "start", "n_examples", "n_blocks", "crc32c", "nbytes"):
            if not _is_count(s[k]):
                raise CorruptStoreError(f"{where}: shard {s['name']} field {k} must be a non-negative int, got {s[k]!r}")
        if not isinstance(s["complete"], bool) or s["crc32c"] >= 2**32 or s["shard"] != int(s["name"][6:11]):
            raise CorruptStoreError(f"{where}: shard {s['name']} has a bad complete, crc32c or shard number: {s!r}")
        if s["n_blocks"] > s["n_examples"] or s["nbytes"] != s["n_examples"] * cfg.example_bytes():
            raise CorruptStoreError(
                f"{where}: shard {s['name']} claims {s['n_examples']} examples in {s['n_blocks']} blocks and {s['nbytes']} bytes; "
                f"{s['n_examples']} examples of this store take {s['n_examples'] * cfg.example_bytes()} bytes"
            )
        if s["start"] != start or s["name"] in seen:
            raise CorruptStoreError(f"{where}: shard {s['name']} starts at {s['start']}, expected {start} (shards must tile the examples)")
        seen.add(s["name"])
        start += s["n_examples"]
        entries.append(ShardEntry(**s))
    if start != n_total:
        raise CorruptStoreError(f"{where}: shards hold {start} examples but n_examples says {n_total}")
    stats = doc["stats"]
    if stats is not None:
        safe_child(root, stats)
    seg_names = {s.name for s in cfg.segments}
    for k in ("nonfinite", "overflow", "truncation"):
        v = doc[k]
        if not isinstance(v, dict) or set(v) != seg_names:
            raise CorruptStoreError(f"{where}: {k} must have one entry per segment {sorted(seg_names)}, got {v!r}")
        if k != "truncation" and not all(_is_count(c) for c in v.values()):
            raise CorruptStoreError(f"{where}: {k} must map segments to non-negative ints, got {v!r}")
    if not all(isinstance(t, dict) and _is_count(t.get("count")) for t in doc["truncation"].values()):
        raise CorruptStoreError(f"{where}: truncation must map segments to {{count, fraction}}, got {doc['truncation']!r}")
    if not isinstance(doc["created"], str) or not isinstance(doc["actstore_version"], str):
        raise CorruptStoreError(f"{where}: created and actstore_version must be strings")
    return Manifest(
        config=cfg, n_examples=n_total, shards=tuple(entries), truncation=doc["truncation"],
        nonfinite=doc["nonfinite"], overflow=doc["overflow"], stats=stats, created=doc["created"],
        actstore_version=doc["actstore_version"],
    )


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
