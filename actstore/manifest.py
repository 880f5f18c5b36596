"""finalize: merge the committed writer shards of a store into its manifest (atomically)."""

from __future__ import annotations

import errno
import os
from typing import Any

from actstore import catalog
from actstore._version import __version__
from actstore.errors import CorruptStoreError, DiskFullError, NotFinalizedError, StoreNotFoundError
from actstore.layout import keys, records
from actstore.layout.checksum import crc32c
from actstore.layout.records import Manifest, ShardEntry
from actstore.stats import RunningStats, read_stats
from actstore.storage import Storage, open_storage

__all__ = ["Manifest", "ShardEntry", "finalize", "load_manifest"]


def finalize(path: str | os.PathLike | Storage, *, allow_partial: bool = False) -> Manifest:
    """Merge the committed writer shards of a store into manifest.json (atomically).

    Args:
        path: the store root.
        allow_partial: include the committed prefix of shards whose writer never closed
            (crashed and not to be resumed); by default such a shard is an error.

    Returns:
        The manifest written. Examples are ordered shard-major: ascending shard number,
        then each shard's local order.
    """
    storage = open_storage(path)
    if not catalog.has_identity(storage):
        raise StoreNotFoundError(f"{storage.url} is not an actstore store (no {keys.IDENTITY}); nothing to finalize")
    cfg = catalog.read_identity(storage)
    numbers = catalog.shard_numbers(storage)
    if not numbers:
        raise CorruptStoreError(f"{storage.url} has no writer shards in {keys.SHARDS}/; write some before finalizing")
    entries, incomplete = [], []
    truncated, nonfinite, overflow = (dict.fromkeys((s.name for s in cfg.segments), 0) for _ in range(3))
    stats: RunningStats | None = None
    stats_ok = True
    start = 0
    for number in numbers:
        shard = catalog.shard_storage(storage, number)
        rec = catalog.read_commit(shard)
        if not rec.complete:
            incomplete.append(f"shard {number} ({rec.n_committed} examples committed)")
            if not allow_partial:
                continue
        blocks = catalog.read_blocks(shard, rec.n_blocks)
        records.check_blocks_tile(blocks, rec.n_committed, shard.url)
        entries.append(
            ShardEntry(
                shard=number, name=keys.shard_name(number), start=start, n_examples=rec.n_committed,
                complete=rec.complete, n_blocks=len(blocks), crc32c=records.blocks_checksum(blocks),
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
    if incomplete and not allow_partial:
        raise NotFinalizedError(
            f"cannot finalize {storage.url}: {', '.join(incomplete)} not closed (a writer still running, or killed). "
            "Resume and close it (ShardWriter(..., resume=True) or `actstore write --resume`), "
            "or pass allow_partial=True (`actstore finalize --allow-partial`) to publish only what was committed."
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
        config=cfg, n_examples=start, shards=tuple(entries),
        truncation=records.truncation(truncated, start), nonfinite=nonfinite, overflow=overflow, stats=stats_name,
        created=records.now(), actstore_version=__version__,
    )
    _publish(storage, keys.MANIFEST, records.dump_manifest(manifest))
    return records.parse_manifest(records.dump_manifest(manifest), storage.where(keys.MANIFEST), storage.url)


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
            f"out of disk space while finalizing {storage.url} ({os.strerror(e.errno)}); the previous manifest is unchanged. "
            f"Free space, then rerun `actstore finalize {storage.url}`"
        )
        err.errno = e.errno
        raise err from e

