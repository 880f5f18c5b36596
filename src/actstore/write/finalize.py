"""finalize: merge the committed writer shards of a store into its manifest (atomically)."""

from __future__ import annotations

import errno
import os
from typing import Any

from actstore import catalog
from actstore._version import __version__
from actstore.errors import ActstoreError, CorruptStoreError, DiskFullError, NotFinalizedError, StoreNotFoundError
from actstore.layout import keys, records
from actstore.layout.checksum import crc32c
from actstore.layout.records import Manifest, ShardEntry
from actstore.layout.spool import FINALIZE_REMOVER
from actstore.spoolstate import read_record as read_spool_record
from actstore.stats import RunningStats, read_stats
from actstore.storage import Storage, open_storage
from actstore.write import family
from actstore.write.committed import check_per_sample
from actstore.write.spool import gc as spool_gc

__all__ = ["Manifest", "ShardEntry", "finalize", "load_manifest"]


def finalize(path: str | os.PathLike | Storage, *, allow_partial: bool = False) -> Manifest | list[Manifest]:
    """Merge the committed writer shards of a store into manifest.json (atomically).

    Args:
        path: the store root.
        allow_partial: publish what is committed even though shards are unfinished: the
            committed prefix of shards whose writer never closed, and no shard at all for
            ranks of the recorded world size that never wrote one. A shard that was only
            claimed (nothing committed: a writer creating it, or killed before its first
            commit) is left out. The manifest records what is missing (`partial`); `info`
            shows it and `verify --strict` refuses it.
            By default either is an error that names the shards and ranks.

    Returns:
        The manifest written. Examples are ordered shard-major: ascending shard number,
        then each shard's local order. Of an aligned family (a root holding family.json):
        one manifest per member, after checking they hold the same examples.
    """
    storage = open_storage(path)
    if family.is_family_root(storage):  # an aligned family: every member (docs/format.md, section 9)
        return family.finalize_family(storage, finalize, allow_partial=allow_partial)
    if not catalog.has_identity(storage):
        raise StoreNotFoundError(f"{storage.url} is not an actstore store (no {keys.IDENTITY}); nothing to finalize")
    cfg = catalog.read_identity(storage)
    numbers = catalog.shard_numbers(storage)
    if not numbers:
        raise CorruptStoreError(f"{storage.url} has no writer shards in {keys.SHARDS}/; write some before finalizing")
    published = _published(storage)
    entries, incomplete, incomplete_numbers, worlds = [], [], [], {}
    truncated, nonfinite, overflow = (dict.fromkeys((s.name for s in cfg.segments), 0) for _ in range(3))
    stats: RunningStats | None = None
    stats_ok = True
    start = 0
    for number in numbers:
        shard = catalog.shard_storage(storage, number)
        if catalog.claim_pending(shard):  # a writer inside its claim (or killed there)
            incomplete.append(f"shard {number} (being claimed, nothing committed)")
            incomplete_numbers.append(number)
            continue
        rec = catalog.read_commit(shard)
        if rec.world_size is not None:
            worlds.setdefault(rec.world_size, []).append(number)
        if not rec.complete:
            incomplete.append(f"shard {number} ({rec.n_committed} examples committed)")
            incomplete_numbers.append(number)
            if not allow_partial or rec.claimed_only:
                continue  # a shard with nothing committed is left out: it holds no arrays yet
        blocks = catalog.read_blocks(shard, rec.n_blocks)
        records.check_blocks_tile(blocks, rec.n_committed, shard.url)
        if published.get(number) != (len(blocks), records.blocks_checksum(blocks)):  # new blocks: checked once
            check_per_sample(shard, cfg, blocks, rec.n_committed, f"shard {number} of {storage.url}")
        entries.append(
            ShardEntry(
                shard=number,
                name=keys.shard_name(number),
                start=start,
                n_examples=rec.n_committed,
                complete=rec.complete,
                n_blocks=len(blocks),
                crc32c=records.blocks_checksum(blocks),
                nbytes=sum(b.nbytes for b in blocks),
            )
        )
        start += rec.n_committed
        for total, counts in ((truncated, rec.truncated), (nonfinite, rec.nonfinite), (overflow, rec.overflow)):
            for seg, v in counts.items():
                total[seg] = total.get(seg, 0) + v
        if rec.stats_file and rec.n_committed:
            st = read_stats(shard, rec.stats_file, then="the shard's statistics are damaged")
            if stats is None:
                stats = st
            else:
                stats.merge(st)
        elif rec.n_committed:
            stats_ok = False
    world, missing = _world(storage.url, worlds, numbers)
    if (incomplete or missing) and not allow_partial:
        lacks = [f"{', '.join(incomplete)} not closed (a writer still running, or killed)"] if incomplete else []
        if missing:
            lacks.append(
                f"rank{'s' if len(missing) > 1 else ''} {_ranges(missing)} of the {world} recorded with its shards wrote no shard"
            )
        raise NotFinalizedError(
            f"cannot finalize {storage.url}: {'; '.join(lacks)}. "
            "Run or resume those writers to the end (`actstore write --resume` with the same --rank/--world-size, "
            "or ShardWriter(..., resume=True) and close it), "
            "or pass allow_partial=True (`actstore finalize --allow-partial`) to publish only what was committed, recorded as partial."
        )
    if not entries:
        raise NotFinalizedError(
            f"cannot finalize {storage.url}: no shard has committed an example yet ({', '.join(incomplete)}); "
            "let the writers commit (or resume them), then finalize"
        )
    partial = (
        records.Partial(missing_ranks=tuple(missing), incomplete_shards=tuple(incomplete_numbers))
        if missing or incomplete
        else None
    )
    stats_name = None
    if stats is not None and stats_ok:
        # Named by content, so that a finalize killed before it replaces manifest.json
        # leaves the old manifest with its own statistics (older files are kept for
        # readers still holding the previous manifest; `actstore verify` lists them).
        data = stats.to_bytes()
        stats_name = keys.store_stats_file(crc32c(data))
        _publish(storage, stats_name, data)
    manifest = Manifest(
        config=cfg,
        n_examples=start,
        shards=tuple(entries),
        truncation=records.truncation(truncated, start),
        nonfinite=nonfinite,
        overflow=overflow,
        stats=stats_name,
        created=records.now(),
        actstore_version=__version__,
        world_size=world,
        partial=partial,
        spool_budget=spool.budget_bytes if (spool := read_spool_record(storage)) is not None else None,
    )
    _publish(storage, keys.MANIFEST, records.dump_manifest(manifest))
    spool_gc(storage, FINALIZE_REMOVER)  # a spool: what every consumer has read goes (records first)
    return records.parse_manifest(records.dump_manifest(manifest), storage.where(keys.MANIFEST), storage.url)


def _published(storage: Storage) -> dict[int, tuple[int, int]]:
    """shard -> (blocks, their checksum) as the current manifest publishes them (none when
    there is no manifest, or a damaged one)."""
    try:
        m = catalog.read_manifest(storage)
    except (ActstoreError, OSError, ValueError):
        return {}
    return {e.shard: (e.n_blocks, e.crc32c) for e in m.shards}


def _world(url: str, worlds: dict[int, list[int]], numbers: list[int]) -> tuple[int | None, list[int]]:
    """The world size the shards record (one for all) and its ranks without a shard."""
    if not worlds:
        return None, []
    if len(worlds) > 1:
        raise CorruptStoreError(
            f"cannot finalize {url}: its shards were written by runs of different world sizes "
            f"({'; '.join(f'{w} ranks: shards {_ranges(ns)}' for w, ns in sorted(worlds.items()))}); "
            "a store holds one run: rewrite the odd shards with the same --world-size, or write them to another store"
        )
    (world,) = worlds
    beyond = [n for n in numbers if n >= world]
    if beyond:
        raise CorruptStoreError(
            f"cannot finalize {url}: shards {_ranges(beyond)} lie beyond the {world} ranks its shards record"
        )
    return world, sorted(set(range(world)) - set(numbers))


def _ranges(ns: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (rank lists of a thousand-GPU job stay short)."""
    out: list[list[int]] = []
    for n in sorted(ns):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def load_manifest(path: str | os.PathLike | Storage) -> Manifest:
    """Read and validate the manifest of a store."""
    return catalog.read_manifest(open_storage(path))


def _publish(storage: Storage, key: str, data: Any) -> None:
    """An atomic put of finalize; a full disk leaves the previous manifest and says so."""
    try:
        storage.put(key, data)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        err = DiskFullError(
            f"out of disk space while finalizing {storage.url} ({os.strerror(e.errno)} writing {storage.where(key)}); "
            f"the previous manifest is unchanged. Free space, then rerun `actstore finalize {storage.url}`"
        )
        err.errno, err.filename = e.errno, storage.where(key)
        raise err from e
