"""The format's records: typed, frozen, with one `parse_*` and one `dump_*` each.

Identity (actstore.json), commit record (meta/commit.json), block records
(meta/blocks.jsonl), the per-(example, layer) checksums (meta/example_layer_crc32c.u32),
the manifest (manifest.json) and a shard's root attributes. Every parser treats its
input as untrusted: a document that does not match docs/format.md raises
CorruptStoreError (or FormatVersionError) naming the file and the field.
"""

from __future__ import annotations

import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from actstore.errors import CorruptStoreError, UnsafePathError
from actstore.layout import jsonio, keys, spec
from actstore.layout.config import StoreConfig, check_format_header

MAX_EXAMPLES = 2**48  # a document claiming more is refused before anything is allocated


def now() -> str:
    """UTC time as the records write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def is_count(v: Any) -> bool:
    """A non-negative int (bool excluded), as every count in the format."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _crc32c(data: Any, value: int = 0) -> int:
    from crc32c import crc32c

    return crc32c(data, value)


# ---- identity --------------------------------------------------------------------
def dump_identity(cfg: StoreConfig) -> bytes:
    return jsonio.dumps({"format": spec.FORMAT_NAME, "format_version": spec.FORMAT_VERSION, "config": cfg.to_json()})


def parse_identity(data: bytes, where: str) -> StoreConfig:
    doc = jsonio.loads(data, where, what="store's identity file")
    check_format_header(doc, where)
    return _config(doc.get("config"), where, "the store's identity file is damaged")


def _config(d: Any, where: str, then: str) -> StoreConfig:
    try:
        return StoreConfig.from_json(d)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # untrusted JSON: any shape
        raise CorruptStoreError(f"{where}: bad config ({e}); {then}") from None


# ---- commit record ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Commit:
    """meta/commit.json: the single commit point of a writer shard."""

    shard: int
    n_committed: int = 0
    complete: bool = False
    n_blocks: int = 0
    text_bytes: dict[str, int] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    overflow: dict[str, int] = field(default_factory=dict)
    stats_file: str | None = None
    updated: str = ""
    format_version: int = spec.FORMAT_VERSION
    world_size: int | None = None  # the number of ranks of the run (shard = rank); None: unranked

    @property
    def claimed_only(self) -> bool:
        """Claimed, nothing committed yet: a writer creating the shard, or one killed before
        its first commit (resumable; finalize --allow-partial leaves it out)."""
        return self.n_committed == 0 and not self.complete


def dump_commit(c: Commit) -> bytes:
    d = asdict(c)
    out = {k: d[k] for k in spec.COMMIT_FIELDS}
    out.update({k: d[k] for k in spec.COMMIT_OPTIONAL_FIELDS if d[k] is not None})
    return jsonio.dumps(out)


def parse_commit(data: bytes, where: str) -> Commit:
    rec = jsonio.loads(data, where, what="commit record")
    missing = [k for k in spec.COMMIT_FIELDS if k not in rec] if isinstance(rec, dict) else list(spec.COMMIT_FIELDS)
    if missing:
        raise CorruptStoreError(f"{where} lacks fields {missing}")
    check_format_header({"format": spec.FORMAT_NAME, "format_version": rec["format_version"]}, where)
    n = rec["n_committed"]
    if not is_count(n) or n > MAX_EXAMPLES:
        raise CorruptStoreError(f"{where}: n_committed must be a non-negative int, got {n!r}")
    if not is_count(rec["shard"]) or rec["shard"] > spec.MAX_SHARD:
        raise CorruptStoreError(f"{where}: shard must be an int in 0..{spec.MAX_SHARD}, got {rec['shard']!r}")
    if not isinstance(rec["complete"], bool):
        raise CorruptStoreError(f"{where}: complete must be true or false, got {rec['complete']!r}")
    if not is_count(rec["n_blocks"]) or rec["n_blocks"] > n:
        raise CorruptStoreError(f"{where}: n_blocks must be an int in 0..n_committed ({n}), got {rec['n_blocks']!r}")
    for k in ("text_bytes", "truncated", "nonfinite", "overflow"):
        v = rec[k]
        if not isinstance(v, dict) or not all(isinstance(s, str) and is_count(c) for s, c in v.items()):
            raise CorruptStoreError(f"{where}: {k} must map names to non-negative ints, got {v!r}")
    sf = rec["stats_file"]
    if isinstance(sf, str) and (sf.startswith("/") or ".." in sf.split("/")):
        raise UnsafePathError(
            f"path {sf!r} in the store's metadata points outside the shard ({where}); refusing to follow it"
        )
    if sf is not None and (not isinstance(sf, str) or not sf.startswith(spec.META_DIR + "/") or ".." in sf):
        raise CorruptStoreError(f"{where}: stats_file must be a file under {spec.META_DIR}/ or null, got {sf!r}")
    if not isinstance(rec["updated"], str):
        raise CorruptStoreError(f"{where}: updated must be a string, got {rec['updated']!r}")
    world = rec.get("world_size")
    if world is not None and not (is_count(world) and rec["shard"] < world <= spec.MAX_WORLD_SIZE):
        raise CorruptStoreError(
            f"{where}: world_size must be an int in {rec['shard'] + 1}..{spec.MAX_WORLD_SIZE} (above the shard number), got {world!r}"
        )
    return Commit(**{k: rec[k] for k in spec.COMMIT_FIELDS}, world_size=world)


# ---- block records ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Block:
    """One line of meta/blocks.jsonl: examples [start, stop) committed together."""

    start: int
    stop: int
    crc32c: dict[str, int]
    nbytes: int
    # crc32c of the block's rows of each per-sample array (by array name), as stored: C
    # order, little endian (checksum.per_sample_crc32c). None in blocks of older writers.
    per_sample_crc32c: dict[str, int] | None = None


def dump_block(b: Block) -> bytes:
    rec: dict[str, Any] = {"start": b.start, "stop": b.stop, "crc32c": dict(b.crc32c), "nbytes": b.nbytes}
    if b.per_sample_crc32c is not None:
        rec["per_sample_crc32c"] = dict(b.per_sample_crc32c)
    return jsonio.dump_line(rec)


def _crc_table(t: Any) -> bool:
    return isinstance(t, dict) and all(isinstance(k, str) and is_count(v) and v < 2**32 for k, v in t.items())


def parse_blocks(data: bytes, n_blocks: int, where: str) -> list[Block]:
    """The first `n_blocks` records of a blocks.jsonl (later lines are uncommitted)."""
    lines = data.split(b"\n")
    if len(lines) - 1 < n_blocks:
        raise CorruptStoreError(f"{where} holds {len(lines) - 1} block records; its commit record says {n_blocks}")
    out = []
    for i, line in enumerate(lines[:n_blocks]):
        b = jsonio.loads(line, f"{where} (block record {i})", what="block record")
        ok = (
            isinstance(b, dict)
            and set(b) - {"per_sample_crc32c"} == {"start", "stop", "crc32c", "nbytes"}
            and all(is_count(b.get(k)) for k in ("start", "stop", "nbytes"))
            and b["start"] < b["stop"]
            and _crc_table(b.get("crc32c"))
            and ("per_sample_crc32c" not in b or _crc_table(b["per_sample_crc32c"]))
        )
        if not ok:
            raise CorruptStoreError(
                f'{where}: block record {i} must be {{"start": int, "stop": int > start, "crc32c": '
                f'{{segment: uint32}}, "nbytes": int[, "per_sample_crc32c": {{array: uint32}}]}}, got {str(b)[:200]}'
            )
        out.append(Block(**b))
    return out


def committed_length(data: bytes, n_blocks: int, where: str) -> int:
    """Byte length of the first `n_blocks` lines of a blocks.jsonl (to drop a torn tail)."""
    pos = 0
    for _ in range(n_blocks):
        nxt = data.find(b"\n", pos)
        if nxt < 0:
            raise CorruptStoreError(f"{where} has fewer block records than its commit record says ({n_blocks})")
        pos = nxt + 1
    return pos


def block_problems(blocks: list[Block], n: int, cfg: StoreConfig | None = None) -> list[tuple[str, bool]]:
    """What is wrong with a shard's block records, as (message, fatal) pairs: they must tile
    examples 0..n-1 (fatal); with the store config, each must hold one crc32c per segment
    (fatal) and the bytes of its examples. After a fatal problem the records are unusable."""
    out: list[tuple[str, bool]] = []
    segments = sorted(s.name for s in cfg.segments) if cfg is not None else None
    covered = 0
    for i, b in enumerate(blocks):
        if b.start != covered:
            return out + [(f"block record {i} starts at example {b.start}, expected {covered}", True)]
        if segments is not None and sorted(b.crc32c) != segments:
            return out + [
                (f"block record {i} has checksums for segments {sorted(b.crc32c)}, expected {segments}", True)
            ]
        if cfg is not None and b.nbytes != (b.stop - b.start) * cfg.example_bytes():
            out.append((f"block record {i} claims {b.nbytes} bytes for {b.stop - b.start} examples", False))
        covered = b.stop
    if covered != n:
        out.append((f"the block records cover {covered} examples, not {n}", True))
    return out


def check_blocks_tile(blocks: list[Block], n: int, where: str) -> None:
    """Blocks must cover examples 0..n-1 contiguously."""
    for message, _ in block_problems(blocks, n):
        raise CorruptStoreError(f"{where}: {message}")


def blocks_checksum(blocks: list[Block]) -> int:
    """crc32c over every block's per-segment crc32c (sorted segment names), in block order."""
    crc = 0
    for b in blocks:
        for name in sorted(b.crc32c):
            crc = _crc32c(struct.pack("<I", int(b.crc32c[name]) & 0xFFFFFFFF), crc)
    return crc


# ---- per-(example, segment, layer) checksums -------------------------------------
EL_CRC_DTYPE = "<u4"


def dump_el_crcs(crcs_esl: np.ndarray) -> bytes:
    """(n, segments, layers) crc32c values as the crc file's bytes."""
    return np.ascontiguousarray(crcs_esl, dtype=EL_CRC_DTYPE).tobytes()


def el_crc_nbytes(n: int, cfg: StoreConfig) -> int:
    return n * len(cfg.segments) * cfg.n_layers * 4


def el_crc_offset(local: int, segment: int, layer_pos: int, cfg: StoreConfig) -> int:
    """Byte offset of one (example, segment, layer)'s crc32c in the checksums file."""
    return ((local * len(cfg.segments) + segment) * cfg.n_layers + layer_pos) * 4


def parse_el_crcs(data: bytes, n: int, cfg: StoreConfig) -> np.ndarray | None:
    """(n, segments, layers) crc32c values, or None when the file holds fewer."""
    nbytes = el_crc_nbytes(n, cfg)
    if len(data) < nbytes:
        return None
    return np.frombuffer(data[:nbytes], dtype=EL_CRC_DTYPE).reshape(n, len(cfg.segments), cfg.n_layers)


# ---- shard root attributes -------------------------------------------------------
def shard_attrs(
    cfg: StoreConfig, *, shard: int, n: int, truncated: dict[str, int], created: str, version: str
) -> dict[str, Any]:
    """The root attributes of a writer shard's Zarr group (docs/format.md, section 4)."""
    seg_attrs = {
        s.name: {
            "t_max": s.t_max,
            "t_chunk": s.t_chunk,
            "truncated_count": truncated[s.name],
            "truncated_fraction": (truncated[s.name] / n) if n else 0.0,
        }
        for s in cfg.segments
    }
    return {
        "actstore": {
            "format": spec.FORMAT_NAME,
            "format_version": spec.FORMAT_VERSION,
            "actstore_version": version,
            "shard": shard,
            "config": cfg.to_json(),
        },
        "schema_version": spec.FORMAT_VERSION,
        "model_id": cfg.model_id,
        "layers": list(cfg.layers),
        "num_layers": cfg.n_layers,
        "hidden_size": cfg.d_model,
        "d_model": cfg.d_model,
        "dtype": cfg.dtype,
        "segments": seg_attrs,
        "chunks": {s.name: [1, 1, s.t_chunk, cfg.d_model] for s in cfg.segments},
        "n_examples": n,
        "created": created,
        **{k: v for k, v in cfg.attrs.items() if k != "actstore"},
    }


def shard_attrs_config(group_meta: bytes, zarr_format: int, where: str) -> StoreConfig:
    """The configuration a shard recorded in its root attributes (.zattrs or zarr.json)."""
    doc = jsonio.loads(group_meta, where, what="shard's group metadata")
    attrs = doc.get("attributes", {}) if zarr_format == 3 and isinstance(doc, dict) else doc
    inner = attrs.get("actstore") if isinstance(attrs, dict) else None
    if isinstance(inner, dict):
        check_format_header(inner, where)
    return _config(inner.get("config") if isinstance(inner, dict) else None, where, "the shard's metadata is damaged")


def group_attrs_key(zarr_format: int) -> str:
    """Where a Zarr group keeps its attributes."""
    return ".zattrs" if zarr_format == 2 else "zarr.json"


# ---- manifest --------------------------------------------------------------------
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
    world_size: int | None = None  # the ranks of the run, when its writers were ranked
    partial: Partial | None = None  # set when finalize published with ranks or shards unfinished
    spool_budget: int | None = None  # a spool's byte budget (readers then look for removed examples)


@dataclass(frozen=True, kw_only=True)
class Partial:
    """What a store finalized with `allow_partial` lacks."""

    missing_ranks: tuple[int, ...]  # ranks of the world with no shard at all
    incomplete_shards: tuple[int, ...]  # shards whose writer never closed (their committed prefix is published)


def truncation(counts: dict[str, int], n_examples: int) -> dict[str, dict[str, float]]:
    """The manifest's per-segment truncation entry from truncated-example counts."""
    return {s: {"count": c, "fraction": (c / n_examples) if n_examples else 0.0} for s, c in counts.items()}


def dump_manifest(m: Manifest) -> bytes:
    return jsonio.dumps(
        {
            "format": spec.FORMAT_NAME,
            "format_version": spec.FORMAT_VERSION,
            "actstore_version": m.actstore_version,
            "created": m.created,
            "config": m.config.to_json(),
            "order": spec.ORDER_SHARD_MAJOR,
            "n_examples": m.n_examples,
            "shards": [asdict(e) for e in m.shards],
            "truncation": m.truncation,
            "nonfinite": m.nonfinite,
            "overflow": m.overflow,
            "stats": m.stats,
            **({"world_size": m.world_size} if m.world_size is not None else {}),
            **({"partial": {k: list(getattr(m.partial, k)) for k in spec.PARTIAL_FIELDS}} if m.partial else {}),
            **({"spool_budget": m.spool_budget} if m.spool_budget is not None else {}),
        }
    )


def parse_manifest(data: bytes, where: str, root: str | None = None) -> Manifest:
    """Validate a manifest; every problem is a CorruptStoreError naming the field.

    `root` (the store's location) names the store in the error for a path leaving it.
    """
    doc = jsonio.loads(data, where, what="manifest")
    check_format_header(doc, where)
    missing = [k for k in spec.MANIFEST_FIELDS if k not in doc]
    if missing:
        raise CorruptStoreError(f"{where} lacks fields {missing}")
    if doc["order"] != spec.ORDER_SHARD_MAJOR:
        raise CorruptStoreError(f"{where}: order must be {spec.ORDER_SHARD_MAJOR!r}, got {doc['order']!r}")
    cfg = _config(doc["config"], where, "rerun `actstore finalize`")
    n_total = doc["n_examples"]
    if not is_count(n_total) or n_total > MAX_EXAMPLES:
        raise CorruptStoreError(f"{where}: n_examples must be an int in 0..{MAX_EXAMPLES}, got {n_total!r}")
    if not isinstance(doc["shards"], list):
        raise CorruptStoreError(f"{where}: shards must be a list")
    entries = []
    start = 0
    seen = set()
    for s in doc["shards"]:
        entries.append(_shard_entry(s, cfg, where, start, seen))
        start += s["n_examples"]
    if start != n_total:
        raise CorruptStoreError(f"{where}: shards hold {start} examples but n_examples says {n_total}")
    stats = doc["stats"]
    if isinstance(stats, str) and (stats.startswith("/") or ".." in stats.split("/")):
        raise UnsafePathError(
            f"path {stats!r} in the store's metadata points outside the store {root or where!r}; refusing to follow it"
        )
    if stats is not None and (not isinstance(stats, str) or "/" in stats or stats.startswith(".")):
        raise CorruptStoreError(f"{where}: stats must be a file name at the store root or null, got {stats!r}")
    seg_names = {s.name for s in cfg.segments}
    for k in ("nonfinite", "overflow", "truncation"):
        v = doc[k]
        if not isinstance(v, dict) or set(v) != seg_names:
            raise CorruptStoreError(f"{where}: {k} must have one entry per segment {sorted(seg_names)}, got {v!r}")
        if k != "truncation" and not all(is_count(c) for c in v.values()):
            raise CorruptStoreError(f"{where}: {k} must map segments to non-negative ints, got {v!r}")
    if not all(isinstance(t, dict) and is_count(t.get("count")) for t in doc["truncation"].values()):
        raise CorruptStoreError(
            f"{where}: truncation must map segments to {{count, fraction}}, got {doc['truncation']!r}"
        )
    if not isinstance(doc["created"], str) or not isinstance(doc["actstore_version"], str):
        raise CorruptStoreError(f"{where}: created and actstore_version must be strings")
    world = doc.get("world_size")
    if world is not None and not (is_count(world) and 0 < world <= spec.MAX_WORLD_SIZE):
        raise CorruptStoreError(f"{where}: world_size must be an int in 1..{spec.MAX_WORLD_SIZE}, got {world!r}")
    budget = doc.get("spool_budget")
    if budget is not None and not (is_count(budget) and budget > 0):
        raise CorruptStoreError(f"{where}: spool_budget must be a positive int (bytes), got {budget!r}")
    return Manifest(
        config=cfg,
        n_examples=n_total,
        shards=tuple(entries),
        truncation=doc["truncation"],
        nonfinite=doc["nonfinite"],
        overflow=doc["overflow"],
        stats=stats,
        created=doc["created"],
        actstore_version=doc["actstore_version"],
        world_size=world,
        partial=_partial(doc.get("partial"), where),
        spool_budget=budget,
    )


def _partial(p: Any, where: str) -> Partial | None:
    if p is None:
        return None
    if (
        not isinstance(p, dict)
        or set(p) != set(spec.PARTIAL_FIELDS)
        or not all(
            isinstance(v, list)
            and len(v) <= spec.MAX_WORLD_SIZE
            and all(is_count(r) and r <= spec.MAX_SHARD for r in v)
            for v in p.values()
        )
    ):
        raise CorruptStoreError(
            f"{where}: partial must be {{{', '.join(spec.PARTIAL_FIELDS)}}} with lists of shard numbers, got {p!r}"
        )
    return Partial(**{k: tuple(p[k]) for k in spec.PARTIAL_FIELDS})


def _shard_entry(s: Any, cfg: StoreConfig, where: str, start: int, seen: set[str]) -> ShardEntry:
    if not isinstance(s, dict) or set(s) != set(spec.MANIFEST_SHARD_FIELDS):
        raise CorruptStoreError(
            f"{where}: shard entry {s!r} must have exactly the fields {list(spec.MANIFEST_SHARD_FIELDS)}"
        )
    if not isinstance(s["name"], str) or keys.parse_shard_name(s["name"]) is None:
        raise CorruptStoreError(f"{where}: shard name {s['name']!r} is not of the form shard-NNNNN.zarr")
    for k in ("shard", "start", "n_examples", "n_blocks", "crc32c", "nbytes"):
        if not is_count(s[k]):
            raise CorruptStoreError(f"{where}: shard {s['name']} field {k} must be a non-negative int, got {s[k]!r}")
    if not isinstance(s["complete"], bool) or s["crc32c"] >= 2**32 or s["shard"] != keys.parse_shard_name(s["name"]):
        raise CorruptStoreError(f"{where}: shard {s['name']} has a bad complete, crc32c or shard number: {s!r}")
    if s["n_blocks"] > s["n_examples"] or s["nbytes"] != s["n_examples"] * cfg.example_bytes():
        raise CorruptStoreError(
            f"{where}: shard {s['name']} claims {s['n_examples']} examples in {s['n_blocks']} blocks and {s['nbytes']} bytes; "
            f"{s['n_examples']} examples of this store take {s['n_examples'] * cfg.example_bytes()} bytes"
        )
    if s["start"] != start or s["name"] in seen:
        raise CorruptStoreError(
            f"{where}: shard {s['name']} starts at {s['start']}, expected {start} (shards must tile the examples)"
        )
    seen.add(s["name"])
    return ShardEntry(**s)
