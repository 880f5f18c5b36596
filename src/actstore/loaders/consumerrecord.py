"""A consumer rank's records in the store (docs/format.md, "The spool"): registration (a
create-only record), its acknowledged blocks (the record replaced, only ever growing), the
check that it was not dropped. The records' form is actstore.layout.spool's; this module
does their I/O for a reader (what a spool holds now is actstore.spoolstate's to read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from actstore.errors import ConsumerDroppedError, KeyNotFound, SpoolError
from actstore.layout import spool
from actstore.layout.records import now
from actstore.layout.spool import ConsumerRecord, Ranges
from actstore.storage import Storage


def check_not_dropped(storage: Storage, name: str) -> None:
    """ConsumerDroppedError when `actstore spool drop` dropped consumer `name`."""
    key = spool.dropped_key(name)
    try:
        rec = spool.parse_dropped(storage.get(key), storage.where(key))
    except KeyNotFound:
        return
    raise ConsumerDroppedError(
        f"consumer {name!r} of {storage.url} was dropped ({rec.dropped}, by {rec.by}): the spool's writers no longer "
        "keep its blocks, so some it has not read may be gone; register under a new name "
        f"(TokenStream.follow(..., consumer='{name}-2')) to read what the store still holds"
    )


def read_record(storage: Storage, name: str, rank: int) -> ConsumerRecord | None:
    key = spool.consumer_key(name, rank)
    try:
        return spool.parse_consumer(storage.get(key), storage.where(key))
    except KeyNotFound:
        return None


def register(storage: Storage, name: str, rank: int, world_size: int) -> ConsumerRecord:
    """This rank's record: created (nothing acknowledged) if the consumer is new, else the
    one a run before left (its acknowledged blocks are where a restart continues). Refused
    when the consumer was dropped, or was registered with another world size."""
    check_not_dropped(storage, name)
    folder = spool.consumer_dir(name)
    for file in storage.list_dir(folder):
        r = spool.parse_rank_file(file)
        other = read_record(storage, name, r) if r is not None else None
        if other is not None and other.world_size != world_size:
            raise SpoolError(
                f"consumer {name!r} of {storage.url} was registered with world_size={other.world_size} "
                f"({storage.where(f'{folder}/{file}')}); this stream has world_size={world_size}: its ranks own other "
                "blocks. Use the same world size, or a new consumer name"
            )
    fresh = ConsumerRecord(name=name, rank=rank, world_size=world_size, acked={}, registered=now(), updated=now())
    if storage.put_if_absent(spool.consumer_key(name, rank), spool.dump_consumer(fresh)):
        return fresh
    rec = read_record(storage, name, rank)
    if rec is None:  # (removed between the create and the read: by hand)
        raise SpoolError(f"consumer {name!r} rank {rank}'s record of {storage.url} vanished while it registered")
    if rec.world_size != world_size:
        raise SpoolError(
            f"consumer {name!r} rank {rank} of {storage.url} was registered with world_size={rec.world_size}; "
            f"this stream has world_size={world_size}. Use the same world size, or a new consumer name"
        )
    return rec


def write_acked(storage: Storage, rec: ConsumerRecord, acked: Mapping[int, Ranges]) -> ConsumerRecord:
    """`rec` replaced by one acknowledging `acked` as well (the record only grows)."""
    check_not_dropped(storage, rec.name)
    shards = set(rec.acked) | set(acked)
    grown = {s: spool.merge_ranges((*rec.acked.get(s, ()), *acked.get(s, ()))) for s in sorted(shards)}
    if grown == dict(rec.acked):
        return rec
    new = replace(rec, acked=grown, updated=now())
    storage.put(spool.consumer_key(rec.name, rec.rank), spool.dump_consumer(new))
    return new
