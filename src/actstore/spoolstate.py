"""What a spool holds now, read from its records (the format: actstore.layout.spool).

One scan reads the spool record, every consumer, dropped-consumer and removal record and
the committed blocks of every shard, with a bounded number of listings (shards/, and one
each of spool/consumers, spool/dropped and spool/removed), whatever the number of
examples. A `BlockCache` kept between scans reads a shard's blocks.jsonl again only when
its commit record says it holds more blocks. Writers (actstore.write.spool), readers,
info, verify and finalize all see the spool through `read_state`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actstore import catalog
from actstore.errors import KeyNotFound
from actstore.layout import keys, records
from actstore.layout import spool as sp
from actstore.storage import Storage


def read_record(storage: Storage) -> sp.SpoolRecord | None:
    """The spool record of a store; None when the store is no spool."""
    try:
        data = storage.get(sp.SPOOL_FILE)
    except KeyNotFound:
        return None
    return sp.parse_spool(data, storage.where(sp.SPOOL_FILE))


def read_removed(storage: Storage) -> dict[int, dict[str, sp.RemovedRecord]]:
    """Every removal record, by shard number and remover (one listing of spool/removed)."""
    out: dict[int, dict[str, sp.RemovedRecord]] = {}
    for e in storage.list(sp.REMOVED_DIR):
        parts = e.key.split("/")
        shard = keys.parse_shard_name(parts[-2]) if len(parts) == 4 else None
        remover = sp.parse_remover_file(parts[-1])
        if shard is None or remover is None:
            continue  # a temporary file of an unfinished write, or something not ours
        try:
            data = storage.get(e.key)
        except KeyNotFound:
            continue  # replaced between the listing and the read: the next scan sees it
        out.setdefault(shard, {})[remover] = sp.parse_removed(data, storage.where(e.key))
    return out


def removed_ranges(storage: Storage, shard: int) -> sp.Ranges:
    """The removed set of one shard (one listing of its removal folder)."""
    recs = []
    for name in storage.list_dir(sp.removed_dir(shard)):
        if sp.parse_remover_file(name) is not None:
            key = f"{sp.removed_dir(shard)}/{name}"
            try:
                recs.append(sp.parse_removed(storage.get(key), storage.where(key)))
            except KeyNotFound:
                continue
    return sp.removed_union(recs)


def read_consumers(storage: Storage) -> list[sp.ConsumerRecord]:
    """Every consumer rank's record (one listing of spool/consumers)."""
    out = []
    for e in storage.list(sp.CONSUMERS_DIR):
        parts = e.key.split("/")
        if len(parts) != 4 or sp.parse_rank_file(parts[-1]) is None:
            continue
        try:
            data = storage.get(e.key)
        except KeyNotFound:
            continue
        out.append(sp.parse_consumer(data, storage.where(e.key)))
    return out


def read_dropped(storage: Storage) -> dict[str, sp.DroppedRecord]:
    """Dropped consumers by name (one listing of spool/dropped)."""
    out = {}
    for name in storage.list_dir(sp.DROPPED_DIR):
        if sp.parse_dropped_file(name) is None:
            continue
        key = f"{sp.DROPPED_DIR}/{name}"
        try:
            rec = sp.parse_dropped(storage.get(key), storage.where(key))
        except KeyNotFound:
            continue
        out[rec.name] = rec
    return out


@dataclass
class BlockCache:
    """Committed blocks per shard between scans: (their bytes in blocks.jsonl, blocks). A
    shard's committed block records never change (a resume drops only the uncommitted
    tail), so a grown shard's new records are read from where the cached ones end."""

    shards: dict[int, tuple[int, list[sp.SpoolBlock]]] = field(default_factory=dict)

    def blocks(self, storage: Storage) -> list[sp.SpoolBlock]:
        """The committed blocks of every shard (one listing of shards/; per shard its
        commit record, and the new part of its blocks.jsonl when it grew)."""
        out: list[sp.SpoolBlock] = []
        for shard in catalog.shard_numbers(storage):
            sh = catalog.shard_storage(storage, shard)
            try:
                commit = records.parse_commit(sh.get(keys.COMMIT), sh.where(keys.COMMIT))
            except KeyNotFound:
                continue  # a claim under way: nothing committed
            offset, cached = self.shards.get(shard, (0, []))
            if commit.n_blocks < len(cached):  # the shard was written again (overwrite): read it afresh
                offset, cached = 0, []
            if commit.n_blocks > len(cached):
                offset, cached = self._grown(sh, shard, commit.n_blocks, offset, cached)
                self.shards[shard] = (offset, cached)
            out += cached
        return out

    @staticmethod
    def _grown(
        sh: Storage, shard: int, n_blocks: int, offset: int, cached: list[sp.SpoolBlock]
    ) -> tuple[int, list[sp.SpoolBlock]]:
        """(bytes, blocks) of a shard's first `n_blocks` block records, read from `offset`."""
        size = sh.size(keys.BLOCKS) or 0
        data = sh.get_range(keys.BLOCKS, offset, size - offset) if size > offset else b""
        where, n_new = sh.where(keys.BLOCKS), n_blocks - len(cached)
        new = records.parse_blocks(data, n_new, where)
        first = len(cached)
        cached = cached + [sp.SpoolBlock(shard, first + i, b.start, b.stop, b.nbytes) for i, b in enumerate(new)]
        return offset + records.committed_length(data, n_new, where), cached


@dataclass
class SpoolState:
    """A spool as one scan found it."""

    record: sp.SpoolRecord
    blocks: list[sp.SpoolBlock]
    removers: dict[int, dict[str, sp.RemovedRecord]]
    consumers: list[sp.ConsumerRecord]
    dropped: dict[str, sp.DroppedRecord]

    @property
    def budget(self) -> int:
        return self.record.budget_bytes

    @property
    def removed(self) -> dict[int, sp.Ranges]:
        """The removed set of each shard (the union of its removers' records)."""
        return {s: sp.removed_union(r.values()) for s, r in self.removers.items()}

    def kept(self) -> list[sp.SpoolBlock]:
        removed = self.removed
        return [b for b in self.blocks if not sp.is_removed(b, removed)]

    @property
    def kept_bytes(self) -> int:
        """Committed activation bytes not removed: what the budget bounds."""
        return sp.spooled_bytes(self.blocks, self.removed)

    @property
    def removed_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks) - self.kept_bytes

    def consumable(self) -> list[sp.SpoolBlock]:
        """Kept blocks every live consumer acknowledged: the ones to remove."""
        gone = set(self.dropped)
        return [b for b in self.kept() if sp.consumed(b, self.consumers, gone)]

    def live_consumers(self) -> dict[str, list[sp.ConsumerRecord]]:
        """Registered consumers not dropped, by name (their ranks' records)."""
        return {n: r for n, r in sp.by_name(self.consumers).items() if n not in self.dropped}

    def lags(self) -> dict[str, int]:
        """Kept blocks each live consumer has not acknowledged, by name."""
        kept, removed = self.kept(), self.removed
        return {n: sp.lag(kept, ranks, removed) for n, ranks in self.live_consumers().items()}


def read_state(storage: Storage, cache: BlockCache | None = None) -> SpoolState | None:
    """The spool of a store as it is now; None when the store is no spool."""
    rec = read_record(storage)
    if rec is None:
        return None
    blocks = (cache or BlockCache()).blocks(storage)
    return SpoolState(
        record=rec,
        blocks=blocks,
        removers=read_removed(storage),
        consumers=read_consumers(storage),
        dropped=read_dropped(storage),
    )


def describe(state: SpoolState) -> dict[str, Any]:
    """The spool as `actstore info` and `actstore spool status` show it."""
    kept, removed = state.kept(), state.removed
    lags = state.lags()
    consumers = []
    for name, ranks in sp.by_name(state.consumers).items():
        acked = sum(1 for b in state.blocks if sp.acked_by(b, ranks))
        consumers.append(
            {
                "name": name,
                "ranks": len(ranks),
                "world_size": max(r.world_size for r in ranks),
                "acked_blocks": acked,
                "lag_blocks": lags.get(name),
                "dropped": name in state.dropped,
                "updated": max(r.updated for r in ranks),
            }
        )
    return {
        "budget_bytes": state.budget,
        "blocks": len(state.blocks),
        "kept_blocks": len(kept),
        "kept_bytes": state.kept_bytes,
        "removed_blocks": sum(1 for b in state.blocks if sp.is_removed(b, removed)),
        "removed_bytes": state.removed_bytes,
        "consumers": consumers,
        "dropped": sorted(state.dropped),
    }


def spool_lines(d: dict[str, Any]) -> list[str]:
    """`describe()` as the lines `actstore info` and `actstore spool status` print."""
    size = sp.format_bytes
    lines = [
        f"spool        budget {size(d['budget_bytes'])}: {d['kept_blocks']} blocks kept ({size(d['kept_bytes'])}), "
        f"{d['removed_blocks']} removed ({size(d['removed_bytes'])}) of {d['blocks']} committed"
    ]
    if not d["consumers"]:
        lines.append("  no consumer registered (writers wait for one once the budget is full)")
    for c in d["consumers"]:
        state = "dropped" if c["dropped"] else f"lagging {c['lag_blocks']} blocks"
        lines.append(
            f"  consumer {c['name']}: {c['ranks']} of {c['world_size']} ranks, {c['acked_blocks']} blocks acked, "
            f"{state} (updated {c['updated']})"
        )
    return lines
