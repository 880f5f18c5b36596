"""What a follow stream checks of the store it reads, so that it yields exactly the rows
the store publishes or fails naming why (docs/loaders.md, "Training while capturing").

- A shard's generation is told apart by its block records (meta/blocks.jsonl: each
  block's examples and the crc32c of their bytes): the stream keeps the records of the
  rows it took. New rows are taken only when the shard still holds those records before
  and after they are read, and the stream ends only when the manifest's entry of each
  shard (its block count and the crc32c over its blocks' crc32c) equals them: a shard
  rewritten (`ShardWriter(..., overwrite=True)`) or deleted under the stream raises
  ShardRewrittenError, and rows of two generations are never yielded together.
- A store whose identity file is gone was deleted: StoreNotFoundError at once.
- A shard that is not complete needs a live writer: the holder of its lease (a process
  on this host that runs, else a lease renewed within its TTL). A dead holder, or no
  holder, is reported (NotFinalizedError) without waiting for the idle timeout.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from actstore import catalog
from actstore.errors import ActstoreError, NotFinalizedError, ShardRewrittenError, StoreNotFoundError
from actstore.layout import keys, records
from actstore.layout.records import Block, Commit
from actstore.storage import Storage
from actstore.write import lease as leases

LEASE_CHECK_S = 2.0  # an idle stream reads the writers' leases at most this often


@dataclass
class Taken:
    """The rows a follow stream took from one shard: examples 0..n-1, which lie in the
    shard's block records `blocks` (all those committed when they were read)."""

    n: int = 0
    blocks: list[Block] = field(default_factory=list)
    commit: Commit | None = None  # the commit record last looked at
    failed: int = 0  # reads failed in a row, the block records unchanged (follow.READ_TRIES)


def check_seconds(name: str, v: Any, *, positive: bool, none_means: str | None = None) -> float | None:
    """A follow stream's time option: a finite number of seconds, > 0 (`positive`) or >= 0;
    None where `none_means` says what None does."""
    if v is None and none_means is not None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        also = f", or None ({none_means})" if none_means is not None else ""
        raise ValueError(f"{name} must be a finite number of seconds {bound}{also}. Got {v!r}.")
    return float(v)


def gone(storage: Storage, number: int, taken: dict[int, Taken], what: str) -> ActstoreError:
    """The error for a shard whose rows the stream took and that no longer holds them:
    the store deleted, or the shard rewritten or deleted (`what` says how it was seen)."""
    if not catalog.has_identity(storage):
        return vanished(storage, taken)
    t = taken[number]
    return ShardRewrittenError(
        f"shard {number} of {storage.url} was rewritten or deleted while it was followed ({what}): this stream took "
        f"{t.n} of its examples in {len(t.blocks)} block{'s' if len(t.blocks) != 1 else ''}, which the store no longer holds, and none of what replaced "
        "them; what it yielded is not this store's data: start a new stream (or train on TokenStream(store) once it "
        "is finalized)"
    )


def vanished(storage: Storage, taken: dict[int, Taken]) -> StoreNotFoundError:
    n = sum(t.n for t in taken.values())
    return StoreNotFoundError(
        f"{storage.url} was deleted while it was followed (its {keys.IDENTITY} is gone) after this stream took "
        f"{n} examples of it: nothing more can be streamed; check the path, or follow the store again once it is rewritten"
    )


def same_generation(shard: Storage, blocks: list[Block]) -> bool:
    """Whether the shard's committed block records still begin with `blocks`."""
    try:
        rec = catalog.read_commit(shard)
        return catalog.read_blocks(shard, rec.n_blocks)[: len(blocks)] == blocks
    except (ActstoreError, OSError):  # a record missing or torn: the shard is being rewritten
        return False


def all_published_taken(storage: Storage, manifest: records.Manifest, taken: dict[int, Taken]) -> bool:
    """Whether the stream took every example the (complete) manifest publishes; then each
    shard's taken rows must be exactly the published ones (ShardRewrittenError if not)."""
    published = {e.shard: e for e in manifest.shards}
    if any(taken.get(e.shard, Taken()).n < e.n_examples for e in manifest.shards):
        return False
    for number, t in taken.items():
        e = published.get(number)
        if t.n == 0 and e is None:
            continue
        if e is None or (t.n, len(t.blocks), records.blocks_checksum(t.blocks)) != (e.n_examples, e.n_blocks, e.crc32c):
            raise gone(
                storage,
                number,
                taken,
                "the manifest publishes other rows of it" if e is not None else "the manifest does not publish it",
            )
    return True


def check_writers(storage: Storage, taken: dict[int, Taken]) -> None:
    """Raise NotFinalizedError when a shard that is not complete has no live writer (its
    lease's holder dead, or no lease), its commit record unchanged since it was looked at."""
    for number, t in sorted(taken.items()):
        if t.commit is None or t.commit.complete:
            continue
        holder = leases.current(storage, number)
        if holder is not None and leases.holder_alive(holder):
            continue
        try:
            if catalog.read_commit(catalog.shard_storage(storage, number)) != t.commit:
                continue  # it committed (or closed) meanwhile: a writer lives, or lived till now
        except (ActstoreError, OSError):
            continue  # being rewritten: the next poll reads it
        if holder is None:
            who = "no writer holds it: its writer stopped or was killed before closing it"
        elif holder.host == leases.host_name():
            who = f"its writer ({holder.holder()}) has exited"
        else:
            who = (
                f"its writer ({holder.holder()}) is dead: its lease was last renewed "
                f"{time.time() - holder.renewed:.0f} s ago and expires after {holder.ttl:g} s"
            )
        raise NotFinalizedError(
            f"shard {number} of {storage.url} is not complete ({t.commit.n_committed} examples committed) and {who}; "
            f"resume it (`actstore write --resume`, or ShardWriter(..., shard={number}, resume=True)) or publish what "
            "was committed (`actstore finalize --allow-partial`), then follow the store again"
        )
