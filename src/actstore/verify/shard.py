"""Checks of one writer shard: commit and block records against the manifest, the checksums
file, its folders' entries, per-sample arrays, texts, statistics. Activation arrays are
checked by actstore.verify.acts (fast) and actstore.verify.deep (checksums)."""

from __future__ import annotations

import numpy as np

from actstore import catalog
from actstore.errors import ActstoreError, FormatVersionError, UnsafePathError
from actstore.layout import keys, records, spec
from actstore.layout.arraymeta import array_problems, chunk_rows
from actstore.layout.arrays import ArraySpec, array_specs, every_chunk
from actstore.layout.chunks import array_shape, key_scheme, row_chunk_key
from actstore.layout.config import StoreConfig
from actstore.layout.records import Block, ShardEntry
from actstore.layout.spool import overlaps
from actstore.storage import KeyNotFound
from actstore.verify import deep as deep_checks
from actstore.verify.acts import ActsCheck
from actstore.verify.check import Checker, ShardCtx, array_entries, attrs_problem
from actstore.verify.report import ERROR, WARNING

_ZARR_META = set(keys.ZARR_NAMES)
_RESUMABLE = (
    "nothing of it is published or lost; `actstore write --resume` (ShardWriter(..., resume=True)) or a rerun "
    "of the import continues it, and `actstore finalize --allow-partial` leaves it out"
)


def check_shard(v: Checker, name: str, entry: ShardEntry | None) -> None:
    shard = keys.parse_shard_name(name)
    prefix = keys.shard_prefix(name)
    try:
        sh = catalog.shard_storage(v.storage, name)
    except UnsafePathError as e:
        v.add(ERROR, "symlink", str(e), prefix, shard=shard)
        return
    if v.listing.kind(prefix) == "link":
        v.symlink(prefix, shard)
    if entry is None and catalog.claim_pending(sh):
        v.add(
            WARNING,
            "resumable",
            f"shard {name} is being claimed, or its writer was killed inside the claim: {_RESUMABLE}",
            prefix,
            shard=shard,
        )
        return
    try:
        rec = catalog.read_commit(sh)
    except FormatVersionError:
        raise
    except (ActstoreError, OSError) as e:
        v.add(ERROR, "commit", str(e), f"{prefix}/{keys.COMMIT}", shard=shard)
        rec = None
    if entry is None and rec is None:
        return
    if rec is not None and rec.claimed_only and (entry is None or entry.n_examples == 0):
        v.add(
            WARNING,
            "resumable",
            f"shard {name} was claimed but nothing is committed yet (a writer creating it, or one killed before "
            f"its first commit): {_RESUMABLE}",
            f"{prefix}/{keys.COMMIT}",
            shard=shard,
        )
        return
    n = entry.n_examples if entry is not None else rec.n_committed
    n_blocks = entry.n_blocks if entry is not None else rec.n_blocks
    ctx = ShardCtx(
        name=name,
        prefix=prefix,
        storage=sh,
        shard=shard,
        start=entry.start if entry else None,
        n=n,
        rec=rec,
        removed=v.removed.get(shard, ()),
    )
    v.report.n_shards += 1
    v.report.n_examples += n
    if rec is not None and entry is not None:
        _commit_vs_manifest(v, ctx, entry)
    blocks = _blocks(v, ctx, n_blocks, entry)
    if ctx.removed:
        gone = [b for b in blocks or [] if overlaps(ctx.removed, b.start, b.stop)]
        v.report.n_removed_examples += sum(b.stop - b.start for b in gone)
        v.report.n_removed_bytes += sum(b.nbytes for b in gone)
    el = _el_crcs(v, ctx)
    _check_dir_entries(v, ctx)
    _check_group(v, ctx)
    # Deep reads only when the counts are backed by the commit record, the block records
    # and files on disk: damaged metadata must not make verify read (or allocate) forever.
    deep = v.deep and blocks is not None and (rec is None or rec.n_committed >= n) and _rows_ok(v, ctx)
    for si, seg in enumerate(v.cfg.segments):
        acts = ActsCheck(v, ctx, seg, si)
        if acts.fast():
            if deep and acts.deep_ok:
                deep_checks.checksums(acts, blocks, el)
            acts.report_missing()
    _check_per_sample(v, ctx, deep, blocks or [])
    _check_texts(v, ctx, deep)
    if rec is not None and rec.stats_file and n:
        key = ctx.key(rec.stats_file)
        kind = v.listing.kind(key)
        if kind is None:
            v.add(
                ERROR,
                "stats",
                f"statistics file {rec.stats_file} named by the commit record is missing",
                key,
                shard=shard,
            )
        elif not v.not_a_file(key, kind, shard) and v.deep:
            deep_checks.load_stats(v, key, shard)
    v.flush_counts(shard)


def _check_group(v: Checker, ctx: ShardCtx) -> None:
    """The shard's group attributes hold the store's config (resume compares against it)."""
    rel = records.group_attrs_key(v.cfg.zarr_format)
    key = ctx.key(rel)
    if v.listing.kind(key) != "file":
        if v.listing.kind(key) is None:
            v.add(
                ERROR,
                "shard-meta",
                f"{rel} of the shard is missing (it holds the shard's config)",
                key,
                shard=ctx.shard,
            )
        return  # anything else there was reported with the folder's entries
    try:
        cfg = records.shard_attrs_config(ctx.storage.get(rel), v.cfg.zarr_format, ctx.storage.where(rel))
    except (ActstoreError, OSError) as e:
        v.add(ERROR, "shard-meta", str(e), key, shard=ctx.shard)
        return
    diffs = cfg.differences(v.cfg)
    if diffs:
        v.add(
            ERROR, "shard-meta", f"the shard's {rel} describes another store: {'; '.join(diffs)}", key, shard=ctx.shard
        )


def _rows_ok(v: Checker, ctx: ShardCtx) -> bool:
    key = ctx.key(keys.field_array(spec.SAMPLE_KEY))
    try:
        rows = catalog.rows_on_disk(ctx.storage)
    except ActstoreError as e:
        v.add(ERROR, "array-meta", str(e), key, shard=ctx.shard)
        return False
    if rows < ctx.n:
        v.add(
            ERROR,
            "per-sample",
            f"the {spec.SAMPLE_KEY} array has chunk files for at most {rows} examples; {ctx.n} are published",
            key,
            shard=ctx.shard,
        )
        return False
    return True


def _commit_vs_manifest(v: Checker, ctx: ShardCtx, entry: ShardEntry) -> None:
    rec = ctx.rec
    where = dict(shard=ctx.shard)
    key = ctx.key(keys.COMMIT)
    if rec.n_committed < entry.n_examples:
        v.add(
            ERROR,
            "commit",
            f"the commit record holds {rec.n_committed} examples; the manifest publishes {entry.n_examples}",
            key,
            **where,
        )
    if entry.complete and not (rec.complete and rec.n_committed == entry.n_examples):
        v.add(
            ERROR,
            "commit",
            f"the manifest says the shard is complete with {entry.n_examples} examples; its commit record says "
            f"complete={rec.complete} with {rec.n_committed}",
            key,
            **where,
        )
    if rec.n_blocks < entry.n_blocks:
        v.add(
            ERROR,
            "commit",
            f"the commit record holds {rec.n_blocks} blocks; the manifest publishes {entry.n_blocks}",
            key,
            **where,
        )


def _blocks(v: Checker, ctx: ShardCtx, n_blocks: int, entry: ShardEntry | None) -> list[Block] | None:
    key = ctx.key(keys.BLOCKS)
    where = dict(shard=ctx.shard)
    try:
        blocks = catalog.read_blocks(ctx.storage, n_blocks)
    except (ActstoreError, OSError) as e:
        v.add(ERROR, "blocks", str(e), key, **where)
        return None
    problems = records.block_problems(blocks, ctx.n, v.cfg)
    for message, _ in problems:
        v.add(ERROR, "blocks", message, key, **where)
    if any(fatal for _, fatal in problems):
        return None
    if entry is not None:
        total = records.blocks_checksum(blocks)
        if total != entry.crc32c:
            v.add(
                ERROR,
                "checksum-manifest",
                f"the block records' checksums add up to crc32c {total:#010x}, the manifest says {entry.crc32c:#010x}: "
                f"{keys.basename(keys.BLOCKS)} or the manifest was altered",
                key,
                **where,
            )
        nbytes = sum(b.nbytes for b in blocks)
        if nbytes != entry.nbytes:
            v.add(
                ERROR,
                "checksum-manifest",
                f"the block records hold {nbytes} bytes, the manifest says {entry.nbytes}",
                key,
                **where,
            )
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
    """Links, odd and stray entries in the shard's own folders (arrays are walked per array)."""
    cfg = v.cfg
    files = {  # the regular files each folder holds (beside the folders listed in `dirs`)
        "": _ZARR_META,
        keys.META_DIR: {keys.basename(k) for k in (keys.COMMIT, keys.BLOCKS, keys.EL_CRC)},
        keys.TEXT_DIR: {keys.basename(keys.text_file(t)) for t in cfg.texts},
        keys.ARRAYS: _ZARR_META,
    }
    dirs = {"": {keys.ARRAYS, keys.META_DIR, keys.TEXT_DIR}, keys.ARRAYS: {keys.basename(a) for a in _array_keys(cfg)}}
    current_stats = keys.basename(ctx.rec.stats_file) if ctx.rec and ctx.rec.stats_file else None
    for sub, names in files.items():
        folder = ctx.key(sub)
        kind = v.listing.kind(folder)
        if kind != "dir":
            if kind == "link" and sub:  # the shard's own folder was reported by check_shard
                v.symlink(folder, ctx.shard)
            elif sub and (
                names or sub in dirs
            ):  # a folder with nothing to hold may be absent (object stores have no folders)
                v.add(ERROR, "missing-file", f"folder {sub}/ of the shard is missing", folder, shard=ctx.shard)
            continue
        for name, kind in sorted(v.listing.children(folder).items()):
            key = f"{folder}/{name}"
            if name in names:
                v.not_a_file(key, kind, ctx.shard)
            elif v.odd_entry(key, kind, ctx.shard) or name in dirs.get(sub, ()):
                continue
            elif keys.is_interrupted_write(name):
                v.add(
                    WARNING,
                    "temp-file",
                    f"{name} is the temporary file of an interrupted write; safe to delete",
                    key,
                    shard=ctx.shard,
                )
            elif sub == keys.META_DIR and keys.is_shard_stats_file(name):
                if ctx.rec is None:  # the record naming the live statistics is damaged: any may be it
                    v.add(
                        WARNING,
                        "stale-stats",
                        f"{name} is a statistics file; the commit record that names the live one is damaged, so "
                        "this may be it: keep it",
                        key,
                        shard=ctx.shard,
                    )
                elif name != current_stats:
                    v.add(
                        WARNING,
                        "stale-stats",
                        f"{name} is the statistics file of an earlier commit (the writer was killed before deleting it); safe to delete",
                        key,
                        shard=ctx.shard,
                    )
            elif not keys.is_temporary(name):
                v.add(WARNING, "stray-file", f"{name} is not part of a writer shard", key, shard=ctx.shard)


def _array_keys(cfg: StoreConfig) -> list[str]:
    names = [keys.acts_array(s.name) for s in cfg.segments] + [keys.len_array(s.name) for s in cfg.segments]
    if cfg.token_labels:
        names += [keys.labels_array(s.name) for s in cfg.segments]
    if cfg.token_ids:
        names += [keys.token_ids_array(s.name) for s in cfg.segments]
    return names + [keys.field_array(spec.SAMPLE_KEY)] + [keys.field_array(f) for f in cfg.fields]


def _check_per_sample(v: Checker, ctx: ShardCtx, deep: bool, blocks: list[Block]) -> None:
    specs = array_specs(v.cfg)
    acts = {keys.acts_array(s.name) for s in v.cfg.segments}
    for array in _array_keys(v.cfg):
        if array in acts:
            continue
        name = keys.basename(array)
        key = ctx.key(array)
        where = dict(shard=ctx.shard)
        try:
            meta = catalog.array_meta(ctx.storage, array)
            shape = array_shape(meta)
        except KeyNotFound:
            v.add(ERROR, "array-meta", f"per-sample array {name} is missing", key, **where)
            continue
        except (ActstoreError, ValueError, KeyError, TypeError) as e:
            v.add(ERROR, "array-meta", f"metadata of per-sample array {name} is damaged ({e!r})", key, **where)
            continue
        if not shape or shape[0] < ctx.n:
            v.add(
                ERROR,
                "array-meta",
                f"per-sample array {name} holds {shape[0] if shape else shape} values; {ctx.n} examples are published",
                key,
                **where,
            )
            continue
        problems = array_problems(meta, specs[array], v.cfg.zarr_format, ctx.n, complete=ctx.complete)
        if problems:
            v.add(ERROR, "array-meta", f"per-sample array {name} has {problems[0]}", key, **where)
            continue
        attrs = attrs_problem(ctx, array, meta, v.cfg)
        if attrs:
            v.add(ERROR, "array-meta", f"per-sample array {name}: {attrs}", key, **where)
        dense = not attrs and every_chunk(catalog.array_attrs(ctx.storage, array, meta))
        if _walk_per_sample(v, ctx, array, meta, specs[array], dense) and deep:
            deep_checks.per_sample_values(v, ctx, array, blocks, specs[array].dtype)


def _walk_per_sample(v: Checker, ctx: ShardCtx, array: str, meta: dict, want: ArraySpec, dense: bool) -> bool:
    """Links, odd entries and stray files among a per-sample array's chunk files, each chunk
    file's size (per-sample arrays are never compressed) and, when the array promises every
    chunk (`dense`), the chunks missing; False when a chunk cannot be read."""
    fmt, sep = key_scheme(meta)
    rows, name = chunk_rows(meta, want), keys.basename(array)
    nbytes = rows * int(np.prod(want.chunks[1:], dtype=np.int64)) * np.dtype(want.dtype).itemsize
    ok, present = True, set()
    for rel, key, entry in array_entries(v.listing, ctx.key(array), fmt, sep, len(want.shape)):
        if key is not None and not any(key[1:]):
            present.add(key[0])  # a folder there is reported as such, not also as missing
        if v.not_a_chunk_file(entry.key, entry.kind, ctx.shard):
            ok = False
        elif key is None or any(key[1:]):
            if not keys.is_temporary(keys.basename(rel)):
                v.add(
                    WARNING,
                    "stray-file",
                    f"{rel} in array {name} is not a chunk of this array",
                    entry.key,
                    shard=ctx.shard,
                )
        elif key[0] * rows < ctx.n and entry.size != nbytes:
            v.add(
                ERROR,
                "chunk-size",
                f"chunk file {rel} of per-sample array {name} has {entry.size} bytes, expected {nbytes}",
                entry.key,
                shard=ctx.shard,
            )
            ok = False
    for c0, c1 in _gaps(present, -(-ctx.n // rows)) if dense else ():  # runs of missing chunks, however many
        rel = row_chunk_key(array, fmt, sep, len(want.shape), c0)[len(array) + 1 :]
        which, verb = (f"chunk file {rel}", "is") if c1 == c0 + 1 else (f"{c1 - c0} chunk files from {rel} on", "are")
        v.add(
            ERROR,
            "missing-chunk",
            f"{which} of per-sample array {name} (examples {c0 * rows}..{min(ctx.n, c1 * rows) - 1}) "
            f"{verb} missing: its writer writes every chunk, zeros included, so it was deleted (readers would return zeros)",
            f"{ctx.key(array)}/{rel}",
            shard=ctx.shard,
        )
        ok = False
    return ok


def _gaps(present: set[int], total: int) -> list[tuple[int, int]]:
    """The runs [c0, c1) of 0..total-1 not in `present`, found without counting to total."""
    out, nxt = [], 0
    for c in sorted(present):
        if c > nxt:
            out.append((nxt, c))
        nxt = max(nxt, c + 1)
    if total > nxt:
        out.append((nxt, total))
    return out


def _check_texts(v: Checker, ctx: ShardCtx, deep: bool) -> None:
    for name in v.cfg.texts:
        rel = keys.text_file(name)
        key = ctx.key(rel)
        where = dict(shard=ctx.shard)
        kind = v.listing.kind(key)
        if kind != "file":
            if kind is None:
                v.add(ERROR, "text", f"text file {name}.jsonl is missing", key, **where)
            continue  # anything else there was reported with the folder's entries
        want = ctx.rec.text_bytes.get(name) if ctx.rec else None
        size = v.listing.size(key)
        if want is not None and size < want:
            v.add(
                ERROR, "text", f"text file {name}.jsonl has {size} bytes; the commit record says {want}", key, **where
            )
            continue
        if deep:
            deep_checks.text_lines(v, ctx, name)
