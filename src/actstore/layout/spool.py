"""The spool's records and its pure accounting (docs/format.md, "The spool"; issue 41).

A spool is a store with a byte budget: committed blocks are kept until every registered,
non-dropped consumer has acknowledged them, then their activation files are removed. Four
JSON records under `spool/` at the store root say so:

- `spool/spool.json` (SpoolRecord): the budget; written once, its presence makes a spool.
- `spool/consumers/<name>/rank-<r>.json` (ConsumerRecord): what one consumer rank acked.
- `spool/dropped/<name>.json` (DroppedRecord): a consumer that no longer holds blocks back.
- `spool/removed/<shard_name>/<remover>.json` (RemovedRecord): example ranges of a shard
  whose activation files were (or are being) removed, written before the deletion.

Example ranges are half-open `(start, stop)` pairs, kept merged: sorted, disjoint, not
touching. No I/O here; the writer (actstore.write.spool) and the consumers read and write
these records through the storage layer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from actstore.errors import CorruptStoreError, SpoolError
from actstore.layout import jsonio, keys
from actstore.layout.records import is_count, now

SPOOL_FORMAT_VERSION = 1
SPOOL_DIR = "spool"
SPOOL_FILE = "spool/spool.json"
CONSUMERS_DIR = "spool/consumers"
DROPPED_DIR = "spool/dropped"
REMOVED_DIR = "spool/removed"

SPOOL_FIELDS = ("format_version", "budget_bytes", "created")
CONSUMER_FIELDS = ("name", "rank", "world_size", "acked", "registered", "updated")
DROPPED_FIELDS = ("name", "dropped", "by")
REMOVED_FIELDS = ("removed", "bytes", "updated")

MAX_WORLD_SIZE = 65536  # consumer ranks of one name (a larger number is a typo or damage)
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_RANK_FILE_RE = re.compile(r"^rank-(\d{1,5})\.json$")
_REMOVER_RE = re.compile(r"^(writer-\d{5}|finalize|cli-[0-9a-f]{8})$")
FINALIZE_REMOVER = "finalize"

Ranges = tuple[tuple[int, int], ...]


# ---- keys --------------------------------------------------------------------------
def check_name(name: Any, what: str = "consumer name") -> str:
    """`name` if it is a valid consumer name; SpoolError saying the rule otherwise."""
    if not isinstance(name, str) or not NAME_RE.match(name) or name in (".", ".."):
        raise SpoolError(f"{what} must be 1-64 characters of A-Z a-z 0-9 . _ - (not '.' or '..'). Got {name!r}.")
    return name


def consumer_dir(name: str) -> str:
    return f"{CONSUMERS_DIR}/{check_name(name)}"


def consumer_key(name: str, rank: int) -> str:
    """`spool/consumers/<name>/rank-<rank>.json`."""
    return f"{consumer_dir(name)}/rank-{int(rank)}.json"


def parse_rank_file(file: str) -> int | None:
    """The rank of a file name in a consumer's folder (`rank-3.json` -> 3), or None."""
    m = _RANK_FILE_RE.match(file)
    return int(m.group(1)) if m else None


def dropped_key(name: str) -> str:
    """`spool/dropped/<name>.json`."""
    return f"{DROPPED_DIR}/{check_name(name)}.json"


def parse_dropped_file(file: str) -> str | None:
    """The consumer name of a file in spool/dropped/, or None when it is not one."""
    if not file.endswith(".json"):
        return None
    name = file[: -len(".json")]
    return name if NAME_RE.match(name) and name not in (".", "..") else None


def writer_remover(shard: int) -> str:
    """The remover name of shard `shard`'s writer (`writer-00003`)."""
    return f"writer-{int(shard):05d}"


def cli_remover(token: str) -> str:
    """The remover name of a one-off command (`cli-<8 hex>`)."""
    name = f"cli-{token}"
    if not _REMOVER_RE.match(name):
        raise ValueError(f"a command's remover token must be 8 lowercase hex digits. Got {token!r}.")
    return name


def is_remover(name: str) -> bool:
    return _REMOVER_RE.match(name) is not None


def removed_dir(shard: int) -> str:
    """`spool/removed/<shard_name>`: the removal records of shard `shard`."""
    return f"{REMOVED_DIR}/{keys.shard_name(shard)}"


def removed_key(shard: int, remover: str) -> str:
    """`spool/removed/<shard_name>/<remover>.json`."""
    if not is_remover(remover):
        raise ValueError(f"remover must be writer-NNNNN, finalize or cli-<8 hex>. Got {remover!r}.")
    return f"{removed_dir(shard)}/{remover}.json"


def parse_remover_file(file: str) -> str | None:
    """The remover of a file name in a shard's removal folder, or None when it is not one."""
    if not file.endswith(".json"):
        return None
    name = file[: -len(".json")]
    return name if is_remover(name) else None


# ---- the byte budget ----------------------------------------------------------------
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p + "b"] = 1000**_i  # SI: kB, MB, GB, TB, PB
    _UNITS[_p + "ib"] = 1024**_i  # IEC: KiB, MiB, GiB, TiB, PiB
_BUDGET_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
BUDGET_HELP = (
    "a number of bytes with an optional unit: SI (kB, MB, GB, TB, PB: powers of 1000) or IEC "
    "(KiB, MiB, GiB, TiB, PiB: powers of 1024), e.g. 50GB, 512MiB, 1.5TB or 1000000"
)


def parse_budget(value: Any) -> int:
    """A spool budget in bytes from `value`: a positive int, or a string such as "50GB",
    "50 GiB", "512MiB", "1.5TB" or "1000000" (units are case-insensitive; GB = 1000**3,
    GiB = 1024**3). SpoolError naming the value and the accepted spellings otherwise."""
    if isinstance(value, bool):
        raise SpoolError(f"a spool budget must be {BUDGET_HELP}. Got {value!r}.")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _BUDGET_RE.match(value)) and m.group(2).lower() in _UNITS:
        number, unit = m.groups()
        scale = _UNITS[unit.lower()]
        n = int(number) * scale if "." not in number else math.floor(float(number) * scale)
    else:
        raise SpoolError(f"a spool budget must be {BUDGET_HELP}. Got {value!r}.")
    if n < 1:
        raise SpoolError(f"a spool budget must be at least 1 byte. Got {value!r}.")
    return n


def format_bytes(n: int) -> str:
    """`n` bytes in the unit people read (SI, as budgets are usually given): 1.50 GB."""
    for unit, scale in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# ---- example ranges -----------------------------------------------------------------
def merge_ranges(ranges: Iterable[tuple[int, int] | list[int]]) -> Ranges:
    """The union of half-open ranges as merged ranges (sorted, disjoint, not touching);
    empty ranges (start >= stop) are dropped."""
    out: list[list[int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b in ranges if a < b):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return tuple((a, b) for a, b in out)


def add_range(ranges: Ranges, start: int, stop: int) -> Ranges:
    """`ranges` with [start, stop) added."""
    return merge_ranges((*ranges, (start, stop)))


def covers(ranges: Ranges, start: int, stop: int) -> bool:
    """Whether merged `ranges` hold every example of [start, stop) (an empty range: True)."""
    if start >= stop:
        return True
    return any(a <= start and stop <= b for a, b in ranges)


def overlaps(ranges: Ranges, start: int, stop: int) -> bool:
    """Whether merged `ranges` hold any example of [start, stop)."""
    return start < stop and any(a < stop and start < b for a, b in ranges)


def contains(ranges: Ranges, example: int) -> bool:
    return covers(ranges, example, example + 1)


def range_count(ranges: Ranges) -> int:
    """How many examples merged `ranges` hold."""
    return sum(b - a for a, b in ranges)


# ---- records ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SpoolRecord:
    """spool/spool.json: the budget, written once by the first spooled writer."""

    budget_bytes: int
    created: str = ""
    format_version: int = SPOOL_FORMAT_VERSION


@dataclass(frozen=True, kw_only=True)
class ConsumerRecord:
    """spool/consumers/<name>/rank-<rank>.json, written only by that consumer rank.

    `acked` maps each shard number to the merged example ranges it acknowledged."""

    name: str
    rank: int
    world_size: int
    acked: Mapping[int, Ranges]
    registered: str = ""
    updated: str = ""

    def acked_ranges(self, shard: int) -> Ranges:
        return self.acked.get(shard, ())


@dataclass(frozen=True, kw_only=True)
class DroppedRecord:
    """spool/dropped/<name>.json: written by `actstore spool drop`."""

    name: str
    dropped: str
    by: str


@dataclass(frozen=True, kw_only=True)
class RemovedRecord:
    """spool/removed/<shard_name>/<remover>.json: what one remover removed from one shard."""

    removed: Ranges
    bytes: int
    updated: str = ""


def _doc(data: bytes, where: str, what: str, fields: tuple[str, ...]) -> dict[str, Any]:
    doc = jsonio.loads(data, where, what=what)
    if not isinstance(doc, dict) or set(doc) != set(fields):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise CorruptStoreError(f"{where}: a {what} must have exactly the fields {list(fields)}, got {got}")
    return doc


def _text(doc: dict[str, Any], keys_: tuple[str, ...], where: str) -> None:
    for k in keys_:
        if not isinstance(doc[k], str):
            raise CorruptStoreError(f"{where}: {k} must be a string, got {doc[k]!r}")


def dump_spool(rec: SpoolRecord) -> bytes:
    return jsonio.dumps(
        {"format_version": rec.format_version, "budget_bytes": rec.budget_bytes, "created": rec.created or now()}
    )


def parse_spool(data: bytes, where: str) -> SpoolRecord:
    doc = _doc(data, where, "spool record", SPOOL_FIELDS)
    if doc["format_version"] != SPOOL_FORMAT_VERSION:
        raise CorruptStoreError(
            f"{where}: format_version must be {SPOOL_FORMAT_VERSION} (this actstore's spool format), "
            f"got {doc['format_version']!r}; a newer actstore wrote it: upgrade actstore"
        )
    if not is_count(doc["budget_bytes"]) or doc["budget_bytes"] < 1:
        raise CorruptStoreError(f"{where}: budget_bytes must be a positive int, got {doc['budget_bytes']!r}")
    _text(doc, ("created",), where)
    return SpoolRecord(**doc)


def _dump_ranges(ranges: Ranges) -> list[list[int]]:
    return [[a, b] for a, b in merge_ranges(ranges)]


def _parse_ranges(v: Any, where: str, what: str) -> Ranges:
    ok = isinstance(v, list) and all(
        isinstance(r, list) and len(r) == 2 and is_count(r[0]) and is_count(r[1]) and r[0] < r[1] for r in v
    )
    if not ok:
        raise CorruptStoreError(f"{where}: {what} must be a list of [start, stop] with 0 <= start < stop, got {v!r}")
    return merge_ranges(v)


def _parse_shard(v: Any) -> int | None:
    if is_count(v):
        return v
    return keys.parse_shard_name(v) if isinstance(v, str) else None


def dump_consumer(rec: ConsumerRecord) -> bytes:
    acked = [[shard, a, b] for shard in sorted(rec.acked) for a, b in merge_ranges(rec.acked[shard])]
    doc = {
        "name": check_name(rec.name),
        "rank": rec.rank,
        "world_size": rec.world_size,
        "acked": acked,
        "registered": rec.registered or now(),
        "updated": rec.updated or now(),
    }
    return jsonio.dumps(doc, indent=None) + b"\n"  # one line: a long-running consumer's record grows


def parse_consumer(data: bytes, where: str) -> ConsumerRecord:
    doc = _doc(data, where, "consumer record", CONSUMER_FIELDS)
    if not isinstance(doc["name"], str) or not NAME_RE.match(doc["name"]):
        raise CorruptStoreError(f"{where}: name must be 1-64 characters of A-Z a-z 0-9 . _ -, got {doc['name']!r}")
    ws, rank = doc["world_size"], doc["rank"]
    if not is_count(ws) or not 1 <= ws <= MAX_WORLD_SIZE:
        raise CorruptStoreError(f"{where}: world_size must be an int in 1..{MAX_WORLD_SIZE}, got {ws!r}")
    if not is_count(rank) or rank >= ws:
        raise CorruptStoreError(f"{where}: rank must be an int in 0..{ws - 1} (below world_size), got {rank!r}")
    _text(doc, ("registered", "updated"), where)
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for item in doc["acked"] if isinstance(doc["acked"], list) else [None]:
        shard = _parse_shard(item[0]) if isinstance(item, list) and len(item) == 3 else None
        if shard is None or not (is_count(item[1]) and is_count(item[2]) and item[1] < item[2]):
            raise CorruptStoreError(
                f"{where}: acked must be a list of [shard, start, stop] with 0 <= start < stop, got item {item!r}"
            )
        by_shard.setdefault(shard, []).append((item[1], item[2]))
    acked = {s: merge_ranges(r) for s, r in sorted(by_shard.items())}
    return ConsumerRecord(
        name=doc["name"], rank=rank, world_size=ws, acked=acked, registered=doc["registered"], updated=doc["updated"]
    )


def dump_dropped(rec: DroppedRecord) -> bytes:
    return jsonio.dumps({"name": check_name(rec.name), "dropped": rec.dropped or now(), "by": rec.by})


def parse_dropped(data: bytes, where: str) -> DroppedRecord:
    doc = _doc(data, where, "dropped-consumer record", DROPPED_FIELDS)
    if not isinstance(doc["name"], str) or not NAME_RE.match(doc["name"]):
        raise CorruptStoreError(f"{where}: name must be 1-64 characters of A-Z a-z 0-9 . _ -, got {doc['name']!r}")
    _text(doc, ("dropped", "by"), where)
    return DroppedRecord(**doc)


def dump_removed(rec: RemovedRecord) -> bytes:
    return jsonio.dumps({"removed": _dump_ranges(rec.removed), "bytes": rec.bytes, "updated": rec.updated or now()})


def parse_removed(data: bytes, where: str) -> RemovedRecord:
    doc = _doc(data, where, "removal record", REMOVED_FIELDS)
    if not is_count(doc["bytes"]):
        raise CorruptStoreError(f"{where}: bytes must be a non-negative int, got {doc['bytes']!r}")
    _text(doc, ("updated",), where)
    return RemovedRecord(
        removed=_parse_ranges(doc["removed"], where, "removed"), bytes=doc["bytes"], updated=doc["updated"]
    )


# ---- accounting ---------------------------------------------------------------------
@dataclass(frozen=True)
class SpoolBlock:
    """One committed block as the spool counts it: line `index` of shard `shard`'s
    meta/blocks.jsonl, examples [start, stop), `nbytes` bytes of activations."""

    shard: int
    index: int
    start: int
    stop: int
    nbytes: int


def block_owner(shard: int, block_index: int, start: int, world_size: int) -> int:
    """The consumer rank (of `world_size`) that reads and acknowledges a block: the blocks of
    each shard dealt round robin, each shard starting one rank further on, so that ranks
    share the first blocks of many shards. Pure: every rank computes the same owner."""
    if not is_count(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int. Got {world_size!r}.")
    del start  # a block's index fixes it; kept in the signature for rules that weigh positions
    return (int(shard) + int(block_index)) % world_size


def removed_union(records: Iterable[RemovedRecord]) -> Ranges:
    """The removed set of one shard: the union over its removers' records."""
    return merge_ranges(r for rec in records for r in rec.removed)


def is_removed(block: SpoolBlock, removed: Mapping[int, Ranges]) -> bool:
    """Whether any example of `block` is in its shard's removed set (its files may be gone)."""
    return overlaps(removed.get(block.shard, ()), block.start, block.stop)


def spooled_bytes(blocks: Iterable[SpoolBlock], removed: Mapping[int, Ranges]) -> int:
    """Bytes of the committed blocks whose activation files are kept (not removed): what the
    budget bounds."""
    return sum(b.nbytes for b in blocks if not is_removed(b, removed))


def acked_by(block: SpoolBlock, ranks: Iterable[ConsumerRecord]) -> bool:
    """Whether one consumer (the records of its ranks) acknowledged `block`: a rank lists its
    examples in its acked ranges (the owner under block_owner is the rank that does)."""
    return any(covers(r.acked_ranges(block.shard), block.start, block.stop) for r in ranks)


def by_name(consumers: Iterable[ConsumerRecord]) -> dict[str, list[ConsumerRecord]]:
    """Consumer records grouped by consumer name, ranks in order."""
    out: dict[str, list[ConsumerRecord]] = {}
    for rec in sorted(consumers, key=lambda r: (r.name, r.rank)):
        out.setdefault(rec.name, []).append(rec)
    return out


def consumed(block: SpoolBlock, consumers: Iterable[ConsumerRecord], dropped: Iterable[str]) -> bool:
    """Whether `block` may be removed: some consumer has registered, and every registered,
    non-dropped consumer acknowledged it. With no consumer registered yet nothing is
    consumed (the writers wait for one); when every registered consumer was dropped,
    nothing holds blocks back."""
    groups = by_name(consumers)
    gone = set(dropped)
    if not groups:
        return False
    return all(acked_by(block, ranks) for name, ranks in groups.items() if name not in gone)


def lag(blocks: Iterable[SpoolBlock], ranks: Iterable[ConsumerRecord], removed: Mapping[int, Ranges]) -> int:
    """How many kept blocks one consumer (its ranks' records) has not acknowledged."""
    ranks = list(ranks)
    return sum(1 for b in blocks if not is_removed(b, removed) and not acked_by(b, ranks))
