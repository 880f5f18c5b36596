"""Checks of one writer shard: commit and block records, checksums file, folders, per-sample
arrays, texts, statistics; the activation arrays are checked by actstore.verify.acts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore import catalog
from actstore.errors import ActstoreError, FormatVersionError, UnsafePathError
from actstore.layout import jsonio, keys, records, spec
from actstore.layout.records import Block, Commit, ShardEntry
from actstore.storage import KeyNotFound, Storage
from actstore.verify.acts import check_acts
from actstore.verify.check import Checker
from actstore.verify.report import ERROR, WARNING

_ZARR_META = set(keys.ZARR_NAMES)


@dataclass(frozen=True, kw_only=True)
class ShardCtx:
    name: str
    prefix: str  # the shard's key prefix in the store
    storage: Storage  # keys relative to the shard
    shard: int
    start: int | None
    n: int
    rec: Commit | None

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def global_index(self, local: int) -> int | None:
        return None if self.start is None else self.start + local


def check_shard(v: Checker, name: str, entry: ShardEntry | None) -> None:
    shard = keys.parse_shard_name(name)
    prefix = keys.shard_prefix(name)
    try:
        sh = catalog.shard_storage(v.storage, name)
    except UnsafePathError as e:
        v.add(ERROR, "symlink", str(e), prefix, shard=shard)
        return
    if v.listing.entries.get(prefix) is not None and v.listing.entries[prefix].kind == "link":
        v.symlink(prefix, shard)
    try:
        rec = catalog.read_commit(sh)
    except FormatVersionError:
        raise
    except (ActstoreError, OSError) as e:
        v.add(ERROR, "commit", str(e), f"{prefix}/{keys.COMMIT}", shard=shard)
        rec = None
    if entry is None and rec is None:
        return
    n = entry.n_examples if entry is not None else rec.n_committed
    n_blocks = entry.n_blocks if entry is not None else rec.n_blocks
    ctx = ShardCtx(name=name, prefix=prefix, storage=sh, shard=shard, start=entry.start if entry else None, n=n, rec=rec)
    v.report.n_shards += 1
    v.report.n_examples += n
    if rec is not None and entry is not None:
        _commit_vs_manifest(v, ctx, entry)
    blocks = _blocks(v, ctx, n_blocks, entry)
    el = _el_crcs(v, ctx)
    _check_dir_entries(v, ctx)
    # Deep reads only when the counts are backed by the commit record, the block records
    # and files on disk: damaged metadata must not make verify read (or allocate) forever.
    deep = v.deep and blocks is not None and (rec is None or rec.n_committed >= n) and _rows_ok(v, ctx)
    for si, seg in enumerate(v.cfg.segments):
        check_acts(v, ctx, seg, si, blocks, el, deep)
    _check_per_sample(v, ctx, deep)
    _check_texts(v, ctx, deep)
    if rec is not None and rec.stats_file and n:
        key = ctx.key(rec.stats_file)
        if v.listing.kind(key) != "file":
            v.add(ERROR, "stats", f"statistics file {rec.stats_file} named by the commit record is missing", key, shard=shard)
        elif v.deep:
            v.load_stats(key, shard)
    v.flush_counts(shard)


def _rows_ok(v: Checker, ctx: ShardCtx) -> bool:
    key = ctx.key(keys.field_array(spec.SAMPLE_KEY))
    try:
        rows = catalog.rows_on_disk(ctx.storage)
    except ActstoreError as e:
        v.add(ERROR, "array-meta", str(e), key, shard=ctx.shard)
        return False
    if rows < ctx.n:
        v.add(ERROR, "per-sample", f"the {spec.SAMPLE_KEY} array has chunk files for at most {rows} examples; {ctx.n} are published",
              key, shard=ctx.shard)
        return False
    return True


def _commit_vs_manifest(v: Checker, ctx: ShardCtx, entry: ShardEntry) -> None:
    rec = ctx.rec
    where = dict(shard=ctx.shard)
    key = ctx.key(keys.COMMIT)
    if rec.n_committed < entry.n_examples:
        v.add(ERROR, "commit", f"the commit record holds {rec.n_committed} examples; the manifest publishes {entry.n_examples}", key, **where)
    if entry.complete and not (rec.complete and rec.n_committed == entry.n_examples):
        v.add(
            ERROR, "commit",
            f"the manifest says the shard is complete with {entry.n_examples} examples; its commit record says "
            f"complete={rec.complete} with {rec.n_committed}",
            key, **where,
        )
    if rec.n_blocks < entry.n_blocks:
        v.add(ERROR, "commit", f"the commit record holds {rec.n_blocks} blocks; the manifest publishes {entry.n_blocks}", key, **where)


def _blocks(v: Checker, ctx: ShardCtx, n_blocks: int, entry: ShardEntry | None) -> list[Block] | None:
    key = ctx.key(keys.BLOCKS)
    where = dict(shard=ctx.shard)
    try:
        blocks = catalog.read_blocks(ctx.storage, n_blocks)
    except (ActstoreError, OSError) as e:
        v.add(ERROR, "blocks", str(e), key, **where)
        return None
    covered = 0
    seg_names = sorted(s.name for s in v.cfg.segments)
    for i, b in enumerate(blocks):
        if b.start != covered:
            v.add(ERROR, "blocks", f"block record {i} starts at example {b.start}, expected {covered}", key, **where)
            return None
        if sorted(b.crc32c) != seg_names:
            v.add(ERROR, "blocks", f"block record {i} has checksums for segments {sorted(b.crc32c)}, expected {seg_names}", key, **where)
            return None
        if b.nbytes != (b.stop - b.start) * v.cfg.example_bytes():
            v.add(ERROR, "blocks", f"block record {i} claims {b.nbytes} bytes for {b.stop - b.start} examples", key, **where)
        covered = b.stop
    if covered != ctx.n:
        v.add(ERROR, "blocks", f"the block records cover {covered} examples; {ctx.n} are published", key, **where)
        return None
    if entry is not None:
        total = records.blocks_checksum(blocks)
        if total != entry.crc32c:
            v.add(
                ERROR, "checksum-manifest",
                f"the block records' checksums add up to crc32c {total:#010x}, the manifest says {entry.crc32c:#010x}: "
                "blocks.jsonl or the manifest was altered",
                key, **where,
            )
        nbytes = sum(b.nbytes for b in blocks)
        if nbytes != entry.nbytes:
            v.add(ERROR, "checksum-manifest", f"the block records hold {nbytes} bytes, the manifest says {entry.nbytes}", key, **where)
    return blocks


def _el_crcs(v: Checker, ctx: ShardCtx) -> np.ndarray | None:
    """Per (example, segment, layer) crc32c, or None when the shard has no such file."""
    key = ctx.key(keys.EL_CRC)
    size = v.listing.size(key)
    if size is None:
        return None
    need = records.el_crc_nbytes(ctx.n, v.cfg)
    if size < need:
        v.add(ERROR, "checksums", f"{keys.EL_CRC} has {size} bytes; {ctx.n} examples need {need}", key, shard=ctx.shard)
        return None
    # Bounded by the object's size, checked above.
    return records.parse_el_crcs(ctx.storage.get_range(keys.EL_CRC, 0, need), ctx.n, v.cfg)


def _check_dir_entries(v: Checker, ctx: ShardCtx) -> None:
    """Links and stray files in the shard's own folders (arrays are walked per array)."""
    cfg = v.cfg
    expected = {
        "": _ZARR_META | {keys.ARRAYS, keys.META_DIR, keys.TEXT_DIR},
        keys.META_DIR: {keys.COMMIT.rsplit("/", 1)[-1], keys.BLOCKS.rsplit("/", 1)[-1], keys.EL_CRC.rsplit("/", 1)[-1]},
        keys.TEXT_DIR: {keys.text_file(t).rsplit("/", 1)[-1] for t in cfg.texts},
        keys.ARRAYS: _ZARR_META | {a.rsplit("/", 1)[-1] for a in _array_keys(cfg)},
    }
    current_stats = ctx.rec.stats_file.rsplit("/", 1)[-1] if ctx.rec and ctx.rec.stats_file else None
    for sub, names in expected.items():
        folder = ctx.key(sub)
        kind = v.listing.kind(folder)
        if kind != "dir":
            if kind == "link":
                v.symlink(folder, ctx.shard)
            elif sub and names:  # a folder with nothing to hold may be absent (object stores have no folders)
                v.add(ERROR, "missing-file", f"folder {sub}/ of the shard is missing", folder, shard=ctx.shard)
            continue
        for name, kind in sorted(v.listing.children(folder).items()):
            key = f"{folder}/{name}"
            if kind == "link":
                v.symlink(key, ctx.shard)
            elif name in names:
                continue
            elif keys.is_temporary(name) and ".tmp-" in name:
                v.add(WARNING, "temp-file", f"{name} is the temporary file of an interrupted write; safe to delete", key, shard=ctx.shard)
            elif sub == keys.META_DIR and re.match(r"^stats-\d{12}\.npz$", name):
                if name != current_stats:
                    v.add(WARNING, "stale-stats", f"{name} is the statistics file of an earlier commit (the writer was killed before deleting it); safe to delete", key, shard=ctx.shard)
            elif not keys.is_temporary(name):
                v.add(WARNING, "stray-file", f"{name} is not part of a writer shard", key, shard=ctx.shard)


def _array_keys(cfg) -> list[str]:
    names = [keys.acts_array(s.name) for s in cfg.segments] + [keys.len_array(s.name) for s in cfg.segments]
    if cfg.token_labels:
        names += [keys.labels_array(s.name) for s in cfg.segments]
    return names + [keys.field_array(spec.SAMPLE_KEY)] + [keys.field_array(f) for f in cfg.fields]


def _check_per_sample(v: Checker, ctx: ShardCtx, deep: bool) -> None:
    acts = {keys.acts_array(s.name) for s in v.cfg.segments}
    for array in _array_keys(v.cfg):
        if array in acts:
            continue
        name = array.rsplit("/", 1)[-1]
        key = ctx.key(array)
        where = dict(shard=ctx.shard)
        try:
            meta = catalog.array_meta(ctx.storage, array)
            shape = meta["shape"]
            ok = isinstance(shape, list) and shape and isinstance(shape[0], int)
        except KeyNotFound:
            v.add(ERROR, "array-meta", f"per-sample array {name} is missing", key, **where)
            continue
        except (ActstoreError, ValueError, KeyError, TypeError) as e:
            v.add(ERROR, "array-meta", f"metadata of per-sample array {name} is damaged ({e!r})", key, **where)
            continue
        if not ok or shape[0] < ctx.n:
            v.add(ERROR, "array-meta", f"per-sample array {name} holds {shape if not ok else shape[0]} values; {ctx.n} examples are published", key, **where)
            continue
        if deep:
            _deep_per_sample(v, ctx, array)


def _deep_per_sample(v: Checker, ctx: ShardCtx, array: str) -> None:
    import zarr

    name, key = array.rsplit("/", 1)[-1], ctx.key(array)
    try:
        values = np.asarray(zarr.open_array(store=ctx.storage.zarr_store(array, read_only=True), mode="r")[: ctx.n])
    except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes is damage
        v.add(ERROR, "per-sample", f"per-sample array {name} cannot be read ({e!r})", key, shard=ctx.shard)
        return
    for seg in v.cfg.segments:
        if array == keys.len_array(seg.name) and values.size and (values.min() < 0 or values.max() > seg.t_max):
            bad = int(np.flatnonzero((values < 0) | (values > seg.t_max))[0])
            v.add(
                ERROR, "per-sample", f"length {int(values[bad])} of segment {seg.name!r} lies outside 0..{seg.t_max}",
                key, shard=ctx.shard, local=bad, example=ctx.global_index(bad), segment=seg.name,
            )


def _check_texts(v: Checker, ctx: ShardCtx, deep: bool) -> None:
    for name in v.cfg.texts:
        rel = keys.text_file(name)
        key = ctx.key(rel)
        where = dict(shard=ctx.shard)
        kind = v.listing.kind(key)
        if kind != "file":
            if kind != "link":
                v.add(ERROR, "text", f"text file {name}.jsonl is missing", key, **where)
            continue
        want = ctx.rec.text_bytes.get(name) if ctx.rec else None
        size = v.listing.size(key)
        if want is not None and size < want:
            v.add(ERROR, "text", f"text file {name}.jsonl has {size} bytes; the commit record says {want}", key, **where)
            continue
        if deep:
            _deep_text(v, ctx, name, rel)


def _deep_text(v: Checker, ctx: ShardCtx, name: str, rel: str) -> None:
    key = ctx.key(rel)
    n_lines = 0
    for line in ctx.storage.get(rel).splitlines(keepends=True):
        if n_lines >= ctx.n:
            break
        i = n_lines
        n_lines += 1
        try:
            rec: Any = jsonio.parse(line)
            ok = isinstance(rec, dict) and rec.get("i") == i and name in rec
        except ValueError:
            ok = False
        if not ok:
            v.add(
                ERROR, "text", f"line {i + 1} of {name}.jsonl is damaged (expected {{\"i\": {i}, ..., \"{name}\": ...}})",
                key, shard=ctx.shard, local=i, example=ctx.global_index(i),
            )
    if n_lines < ctx.n:
        v.add(ERROR, "text", f"{name}.jsonl has {n_lines} lines; {ctx.n} examples are published", key, shard=ctx.shard)
