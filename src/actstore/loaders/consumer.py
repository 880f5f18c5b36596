"""ConsumerStream (`TokenStream.follow(path, consumer="sae-l8")`): a durable, resumable
follow stream (docs/loaders.md, "Consumers").

A named consumer registers in the store (a create-only record per rank,
actstore.loaders.consumerrecord) and streams, as a follow stream does, every kept block
of the store that its rank owns (actstore.layout.spool.block_owner) and that it has not
acknowledged: each block is read whole into the shuffle pool, its rows tagged, and the
tags of each batch handed to the loop mark those rows as yielded (consumerstate.Progress).
A block all of whose rows were handed over is *completed*; the store learns it (the
consumer's record, which lets a spool's writers delete the block) only once a checkpoint
covering it is durable:

- ack="checkpoint" (default): the blocks completed as of one `state_dict()` call are
  written at the next call (the trainer has saved the first checkpoint by then), or by
  `acknowledge()`; loading a state proves it durable, so its blocks are written then.
- ack="manual": only `acknowledge(state)`, for checkpoints saved asynchronously.
- ack="yielded": as soon as a block is completed (a consumer without checkpoints).

So a trainer killed with -9 and restarted from its last checkpoint (`load_state_dict`)
gets every kept token exactly once over its run, except those yielded after that
checkpoint, which it gets again; a checkpoint older than the store's record is refused.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Unpack

import numpy as np
import torch

from actstore import catalog
from actstore.errors import ActstoreError, NotFinalizedError, SpoolError
from actstore.layout import keys, spool
from actstore.layout.config import StoreConfig
from actstore.layout.records import parse_blocks
from actstore.layout.spool import Ranges, block_owner, overlaps
from actstore.loaders import consumerrecord as records
from actstore.loaders.consumerstate import (
    ROW_BITS,
    STATE_FORMAT,
    STATE_VERSION,
    Progress,
    check_state,
    not_covered,
    ranges_of,
)
from actstore.loaders.follow import FollowStream, _Changed, _Pool
from actstore.loaders.followcheck import Taken, check_writers
from actstore.loaders.spec import StreamOptions, dist_rank_world
from actstore.progress import warn
from actstore.read.interface import Reader
from actstore.spoolstate import read_record, removed_ranges
from actstore.storage import Storage, open_storage

ACK_MODES = ("checkpoint", "manual", "yielded")


class ConsumerStream(FollowStream):
    """A follow stream of a named, durable consumer (see the module docstring).

    Args:
        store: the store's location (a folder, a URL, a Storage or a Reader of it); it may
            not exist yet (the consumer registers once it does).
        consumer: the consumer's name, 1-64 characters of A-Z a-z 0-9 . _ -; each name
            reads every kept token once (several names read the same store independently).
        rank, world_size: this process's share of the name's blocks (default from
            torch.distributed when initialised, else 0 of 1); ranks own disjoint blocks.
        ack: when the store learns that a block was consumed: "checkpoint", "manual" or
            "yielded" (see the module docstring).
        **options: FollowStream's (poll_s, idle_timeout_s and StreamSpec's fields).

    Attributes:
        record: this rank's record in the store (None until the store exists).
        skipped: blocks (shard, start, stop) this consumer never saw because a spool had
            removed them before it registered.
    """

    def __init__(
        self,
        store: str | os.PathLike | Storage | Reader,
        *,
        consumer: str,
        rank: int | None = None,
        world_size: int | None = None,
        ack: str = "checkpoint",
        **options: Unpack[StreamOptions],
    ):
        self.name = spool.check_name(consumer)
        if ack not in ACK_MODES:
            raise ValueError(f"ack must be one of {list(ACK_MODES)}. Got {ack!r}.")
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        super().__init__(store, **options)
        self.ack = ack
        self.rng = np.random.default_rng(self.seed)
        self.progress = Progress()
        self.record: spool.ConsumerRecord | None = None
        self.skipped: list[tuple[int, int, int]] = []
        self._last_state: dict[str, Any] | None = None  # what the last state_dict() returned
        self._loaded: Mapping[str, Any] | None = None  # a state loaded before the record was read
        self._last_flush = 0.0
        storage = open_storage(self.location)
        if catalog.has_identity(storage):
            self._register(storage)

    # ---- the store's record ------------------------------------------------------
    def _register(self, storage: Storage) -> None:
        self.record = records.register(storage, self.name, self.rank, self.world_size)
        self._storage = storage
        if self._loaded is not None:
            self._check_behind(self._loaded)
            if self.ack != "manual":
                self._write(ranges_of(self._loaded["completed"]))
        else:
            self.progress.completed = dict(self.record.acked)  # a restart without a state: from the record

    def _check_behind(self, state: Mapping[str, Any]) -> None:
        """Refuse a state older than the store's record: blocks the record acknowledges that
        the state has not completed may have been removed by the spool's writers."""
        ahead = not_covered(self.record.acked, ranges_of(state["completed"]))
        if ahead:
            s, a, b = ahead[0]
            raise SpoolError(
                f"this checkpoint of consumer {self.name!r} rank {self.rank} is older than its record in "
                f"{self._storage.url}: the store was told it consumed examples {a}..{b - 1} of shard {s} "
                f"({len(ahead)} range{'s' if len(ahead) > 1 else ''} in all) that this state has not finished, and a "
                "spool may have removed them; restart from the latest checkpoint (the store is acknowledged one "
                "state_dict() behind it with ack='checkpoint'), or read the store as a new consumer name"
            )

    def _write(self, acked: Mapping[int, Ranges]) -> None:
        if self.record is not None:
            self.record = records.write_acked(self._storage, self.record, acked)

    def acknowledge(self, state: Mapping[str, Any] | None = None) -> None:
        """Tell the store that `state` (default: what the last state_dict() returned) is
        saved durably: the blocks it completed may be removed by a spool's writers."""
        state = self._last_state if state is None else state
        if state is None:
            raise ValueError("acknowledge() needs a state: call state_dict() (and save it) first")
        check_state(state, self._identity())
        self._write(ranges_of(state["completed"]))

    # ---- state ---------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        asked = self.layers_asked
        layers = None if asked is None else [asked] if isinstance(asked, (int, str)) else list(asked)
        segs = self.segments_asked
        segs = None if segs is None else [segs] if isinstance(segs, str) else list(segs)
        return {
            "consumer": self.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "layers": layers,
            "segments": segs,
            "token_mask": self.token_mask,
        }

    def state_dict(self) -> dict[str, Any]:
        """The consumer's position (JSON-serialisable): its completed blocks, the rows
        already yielded of blocks in flight, and the shuffle's random state. With
        ack="checkpoint" the store is told of the previous call's completed blocks."""
        if self.ack == "checkpoint" and self._last_state is not None:
            self._write(ranges_of(self._last_state["completed"]))
        state = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            **self._identity(),
            **self.progress.state(),
            "rng": self.rng.bit_generator.state,
        }
        self._last_state = state
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state of this consumer: every block it had not completed is read
        again, the rows it had yielded of each left out. Refused when the store's record is
        ahead of it (SpoolError) or it is another consumer's (ValueError)."""
        check_state(state, self._identity())
        self.progress.restore(state)
        self.rng.bit_generator.state = state["rng"]
        self._last_state = dict(state)
        self._loaded = state
        if self.record is not None:
            self._check_behind(state)
            if self.ack != "manual":
                self._write(ranges_of(state["completed"]))

    # ---- iteration -----------------------------------------------------------------
    def _pool(self, cfg: StoreConfig) -> _Pool:
        self._current = _ConsumerPool(self, cfg)
        return self._current

    def _wait_for_identity(self, storage: Storage) -> StoreConfig:
        cfg = super()._wait_for_identity(storage)
        if self.record is None:
            self._register(storage)
        return cfg

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.progress.rewind()  # rows drawn but not handed over by an earlier iteration: read again
        return self._handed(super().__iter__())

    def _handed(self, batches: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        """The batches as the loop receives them; each marks its rows yielded first."""
        for batch in batches:
            self.progress.mark(self._current.drawn.popleft())  # (the pool appended it before the batch left)
            if self.ack == "yielded" and time.monotonic() - self._last_flush >= self.poll_s:
                self._flush()
            yield batch
        if self.ack == "yielded":
            self._flush()

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        self._write(self.progress.completed_now())

    def pending_examples(self) -> int:
        """Examples of blocks completed but not yet acknowledged in the store (a spool keeps
        them for this consumer)."""
        done = self.progress.completed_now()
        acked = self.record.acked if self.record is not None else {}
        return sum(b - a for s, a, b in not_covered(done, acked))


def _records_prefix(shard: Storage, blocks: list[Any]) -> Callable[[], bool]:
    """A check that the shard still holds the block records `blocks`: their bytes, read once
    (and parsed once, to be `blocks`), compared with the start of its blocks.jsonl at each
    call (followcheck.same_generation parses every record at each look: a cost that grows
    with the shard, at each piece of a long read)."""
    try:
        lines = shard.get(keys.BLOCKS).split(b"\n")
    except (ActstoreError, OSError) as e:
        raise _Changed(f"reading its block records failed: {e}") from None
    prefix = b"".join(line + b"\n" for line in lines[: len(blocks)])
    if len(lines) <= len(blocks) or parse_blocks(prefix, len(blocks), shard.where(keys.BLOCKS)) != blocks:
        raise _Changed("its block records changed")

    def same() -> bool:
        try:
            return shard.get(keys.BLOCKS).startswith(prefix)
        except (ActstoreError, OSError):
            return False  # gone or torn: being rewritten

    return same


class _ConsumerPool(_Pool):
    """The follow stream's pool, reading the consumer's blocks whole and tagging their rows.
    It is full at buffer_bytes exactly (no headroom: a block's rows are added as room
    appears), so a pool's state when a batch is drawn is a function of the order of the
    blocks, not of the reader thread's timing."""

    HEADROOM = 0

    def __init__(self, fs: ConsumerStream, cfg: StoreConfig):
        super().__init__(fs, cfg)
        self.tags = np.empty(self.cap, np.int64)
        self.rng = fs.rng
        self.warned: set[str] = set()  # shards whose dead writer was reported
        self.spool = False  # the store was seen to be a spool

    def _check_writers(self, storage: Storage, taken: dict[int, Taken]) -> None:
        """A dead writer is waited for (its shard may resume); a dropped consumer stops."""
        records.check_not_dropped(storage, self.fs.name)
        try:
            check_writers(storage, taken)
        except NotFinalizedError as e:
            shard = re.match(r"shard (\d+) ", str(e))  # (check_writers names the first dead one)
            if shard is None or shard.group(1) not in self.warned:
                self.warned.add(shard.group(1) if shard else str(e))
                warn(f"consumer {self.fs.name!r} waits for a writer to resume: {e}")

    def _nothing_new(self, storage: Storage) -> None:
        """On a spool the writers may be waiting for the blocks this pool holds: serve it as
        it is rather than wait for it to fill (the batches mix fewer blocks meanwhile)."""
        if not self.spool:
            self.spool = read_record(storage) is not None
        if self.spool and not self.starved:
            with self.cond:
                self.starved = True
                self.cond.notify_all()

    def _idle_hint(self) -> str:
        pending = self.fs.pending_examples()
        if not pending:
            return ""
        return (
            f"; consumer {self.fs.name!r} has {pending} examples yielded but not acknowledged, which a spool's writers "
            "wait for: call state_dict() (or acknowledge()) as checkpoints are saved, or pass ack='yielded'"
        )

    def _read(self, storage: Storage, number: int, rec: Any, blocks: list[Any], t: Taken) -> None:
        """Take the shard's new blocks: those this rank owns and has not completed are read
        whole (a piece of about piece_bytes at a time), kept only when the shard holds the
        same block records afterwards and no remover names them."""
        fs: ConsumerStream = self.fs
        reader, lens, keep = self._open(storage, number, rec)
        shard = catalog.shard_storage(storage, number)
        same = _records_prefix(shard, blocks)
        removed = removed_ranges(storage, number)
        piece: list[tuple[int, Any, np.ndarray | None]] = []
        size = 0
        for i in range(len(t.blocks), len(blocks)):
            b = blocks[i]
            rows = None
            mine = block_owner(number, i, b.start, fs.world_size) == fs.rank
            if (
                mine
                and not fs.progress.is_completed(number, b.start, b.stop)
                and not overlaps(removed, b.start, b.stop)
            ):
                try:
                    rows = self._read_unit(reader, lens, keep, b.start, b.stop)
                except (ActstoreError, OSError):
                    if not overlaps(removed_ranges(storage, number), b.start, b.stop):
                        raise  # (a file replaced under the read: the follow stream reads it again)
                    rows = None  # removed while it was read: skipped below
                size += 0 if rows is None else rows.nbytes
            piece.append((i, b, rows if mine else None))
            if i + 1 < len(blocks) and size < self.piece_bytes:
                continue
            if not same():
                raise _Changed("its block records changed while it was read")
            removed = removed_ranges(storage, number)  # after the read: a removal names its blocks first
            for j, blk, got in piece:
                self._take_block(
                    number, j, blk, got, removed, mine=block_owner(number, j, blk.start, fs.world_size) == fs.rank
                )
                t.n, t.blocks = blk.stop, blocks[: j + 1]
            piece, size = [], 0

    def _take_block(self, number: int, i: int, b: Any, rows: np.ndarray | None, removed: Ranges, *, mine: bool) -> None:
        fs: ConsumerStream = self.fs
        if not mine or fs.progress.is_completed(number, b.start, b.stop):
            return
        if rows is None or overlaps(removed, b.start, b.stop):
            records.check_not_dropped(fs._storage, fs.name)
            fs.skipped.append((number, b.start, b.stop))
            return
        if self.n >= self.cap - self.unit_max:
            self.starved = False  # full again: the writers keep up
        block_id, left = fs.progress.begin(number, b.start, b.stop, len(rows))
        idx = np.flatnonzero(left)
        if len(idx):
            tags = (np.int64(block_id) << ROW_BITS) | idx.astype(np.int64)
            self._add(rows if len(idx) == len(rows) else rows[idx], tags)  # (rows[idx]: a copy, restored blocks only)
        fs.blocks_read.append((number, b.start, b.stop, time.monotonic()))
