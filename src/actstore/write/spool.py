"""The writer side of a spool (a store with a byte budget; docs/capture.md, "The spool").

- `open_spool`: the spool record, created once (create-only); a writer with another
  budget, a block larger than the budget or a layout whose files hold several examples is
  refused before anything of the shard is written.
- `remove_consumed`: removes the activation files of consumed blocks (of any shard): the
  removal record first (intent), then batched deletes. Per-sample arrays, texts and the
  shard's records are kept.
- `SpoolGate`: a spooled writer's back-pressure: before a batch's activation files are
  written, the store's kept bytes + the writer's uncommitted bytes + the batch must fit
  the budget; otherwise the writer commits what it holds, removes consumed blocks, then
  waits (polling, with a progress line naming the consumers it waits for). It never fails
  for waiting.
"""

from __future__ import annotations

import getpass
import os
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from actstore import catalog, progress
from actstore.errors import CorruptStoreError, SpoolError
from actstore.layout import keys, records
from actstore.layout import spool as sp
from actstore.layout.chunks import ChunkGeometry, array_shape, key_scheme
from actstore.layout.config import StoreConfig
from actstore.spoolstate import BlockCache, SpoolState, read_record, read_state, removed_ranges
from actstore.storage import Storage

POLL_SECONDS = 1.0  # a waiting writer looks at the consumers' records this often
DELETE_BATCH = 1000  # keys deleted per request on an object store (S3's limit)
SPOOL_LAYOUTS = "zarr_format=2 (--zarr-format 2), or zarr_format=3 without Zarr sharding (shard_examples=None)"


def check_layout(cfg: StoreConfig) -> None:
    """A spool removes the files of consumed examples: every activation file must hold one
    example (no Zarr shard files of several examples)."""
    if cfg.shard_examples is not None:
        raise SpoolError(
            f"a spool removes the activation files of consumed examples, but this store keeps {cfg.shard_examples} "
            f"examples per Zarr shard file; spool a store with one file per example: {SPOOL_LAYOUTS}"
        )


def open_spool(storage: Storage, budget: int, cfg: StoreConfig, commit_bytes: int) -> sp.SpoolRecord:
    """The store's spool record, created with `budget` if the store has none (create-only:
    racing writers agree on one); refuses another budget, a layout it cannot free and a
    block (commit_bytes) larger than the budget."""
    check_layout(cfg)
    if commit_bytes > budget:
        raise SpoolError(
            f"a block of {sp.format_bytes(commit_bytes)} (commit_bytes, --commit-mb) does not fit the spool's budget "
            f"of {sp.format_bytes(budget)}: commit smaller blocks or give the spool a larger budget"
        )
    rec = sp.SpoolRecord(budget_bytes=budget, created=records.now())
    storage.put_if_absent(sp.SPOOL_FILE, sp.dump_spool(rec))
    found = read_record(storage)
    if found is None:  # pragma: no cover - a create-only put that left nothing
        raise CorruptStoreError(f"{storage.where(sp.SPOOL_FILE)} vanished right after it was created")
    if found.budget_bytes != budget:
        raise SpoolError(
            f"{storage.url} is a spool with a budget of {found.budget_bytes} bytes ({sp.format_bytes(found.budget_bytes)}); "
            f"this writer asked for {budget} bytes ({sp.format_bytes(budget)}): give every writer the store's budget"
        )
    return found


def spool_gate(
    storage: Storage,
    cfg: StoreConfig,
    shard: int,
    budget: int | None,
    commit_bytes: int,
    keepalive: Callable[[], None],
    spooled: bool = True,
) -> SpoolGate | None:
    """The back-pressure of a writer opened with spool=`budget` (the store becomes a spool),
    or of any writer on a store that is one (its budget); None for a store with no spool.
    `spooled`: whether the store's listing showed a spool folder (False: no record is read)."""
    if budget is None:
        found = read_record(storage) if spooled else None
        if found is None:
            return None
        budget = found.budget_bytes
    rec = open_spool(storage, budget, cfg, commit_bytes)
    return SpoolGate(storage, cfg, shard, rec.budget_bytes, keepalive=keepalive)


# ---- removal ------------------------------------------------------------------------
def _geometries(sh: Storage, cfg: StoreConfig) -> list[ChunkGeometry]:
    """The key geometry of each activation array of one shard (from its Zarr metadata)."""
    out = []
    for seg in cfg.segments:
        rel = keys.acts_array(seg.name)
        meta = catalog.array_meta(sh, rel, cfg.zarr_format)
        fmt, sep = key_scheme(meta)
        shape = array_shape(meta)
        chunks = meta["chunks"] if meta.get("zarr_format") == 2 else meta["chunk_grid"]["configuration"]["chunk_shape"]
        if any(c.get("name") == "sharding_indexed" for c in meta.get("codecs", [])):
            raise SpoolError(f"{sh.where(rel)} is Zarr-sharded: a spool needs {SPOOL_LAYOUTS}")
        out.append(
            ChunkGeometry(
                array=rel,
                zarr_format=fmt,
                separator=sep,
                n_layers=shape[1],
                n_tchunks=-(-shape[2] // chunks[2]),
                t_chunk=chunks[2],
                d_model=shape[3],
                dtype=np.dtype("u1"),
            )
        )
    return out


def activation_keys(geos: list[ChunkGeometry], start: int, stop: int) -> list[str]:
    """The activation files (keys relative to the shard) of examples [start, stop)."""
    return [
        k for geo in geos for ex in range(start, stop) for lp in range(geo.n_layers) for k in geo.chunk_keys_of(ex, lp)
    ]


def delete_keys(storage: Storage, keys_: list[str]) -> None:
    """Delete objects in batches (an object store: one request per DELETE_BATCH keys)."""
    for i in range(0, len(keys_), DELETE_BATCH):
        storage.delete_many(keys_[i : i + DELETE_BATCH])


def remove_blocks(
    storage: Storage, cfg: StoreConfig, state: SpoolState, blocks: list[sp.SpoolBlock], remover: str
) -> int:
    """Remove the activation files of `blocks` (consumed, kept): per shard, the removal
    record of `remover` first (its ranges grown by the blocks), then the files. Returns the
    bytes removed."""
    by_shard: dict[int, list[sp.SpoolBlock]] = {}
    for b in blocks:
        by_shard.setdefault(b.shard, []).append(b)
    freed = 0
    for shard, group in sorted(by_shard.items()):
        old = state.removers.get(shard, {}).get(remover)
        ranges = sp.merge_ranges([*(old.removed if old else ()), *((b.start, b.stop) for b in group)])
        nbytes = (old.bytes if old else 0) + sum(b.nbytes for b in group)
        rec = sp.RemovedRecord(removed=ranges, bytes=nbytes, updated=records.now())
        storage.put(sp.removed_key(shard, remover), sp.dump_removed(rec))  # intent, before any deletion
        state.removers.setdefault(shard, {})[remover] = rec
        sh = catalog.shard_storage(storage, shard)
        geos = _geometries(sh, cfg)  # (one read of each activation array's metadata per shard)
        doomed = [k for b in group for k in activation_keys(geos, b.start, b.stop)]
        delete_keys(sh, doomed)
        freed += sum(b.nbytes for b in group)
    return freed


def remove_consumed(storage: Storage, cfg: StoreConfig, state: SpoolState, remover: str) -> tuple[int, int]:
    """Remove every consumed, kept block of the spool: (blocks, bytes) removed."""
    blocks = state.consumable()
    if not blocks:
        return 0, 0
    return len(blocks), remove_blocks(storage, cfg, state, blocks, remover)


# ---- back-pressure --------------------------------------------------------------------
def waiting_line(state: SpoolState, need: int) -> str:
    """What a waiting writer says: how full the spool is and for whom it waits."""
    kept, budget = state.kept_bytes, state.budget
    head = f"spool full: {sp.format_bytes(kept)} of {sp.format_bytes(budget)} kept, {sp.format_bytes(need)} to write"
    lags = state.lags()
    if not lags:
        if state.consumers:
            return f"{head}; every consumer was dropped, nothing is consumed"
        return f"{head}; no consumer registered yet: waiting for one (TokenStream.follow(..., consumer=NAME))"
    lagging = {n: k for n, k in lags.items() if k}
    who = ", ".join(f"{n} (lagging {k} blocks)" for n, k in sorted(lagging.items())) or ", ".join(sorted(lags))
    return f"{head}; waiting for consumer(s) {who}"


class SpoolGate:
    """One spooled writer's back-pressure and removals.

    Args:
        storage: the store.
        cfg: the store's configuration.
        shard: the writer's shard number (its removal records are `writer-<shard>`).
        budget: the spool's budget in bytes.
        poll_seconds: how often a waiting writer looks again (default POLL_SECONDS).
        keepalive: called while waiting (the writer's lease check).
    """

    def __init__(
        self,
        storage: Storage,
        cfg: StoreConfig,
        shard: int,
        budget: int,
        *,
        poll_seconds: float | None = None,
        keepalive: Callable[[], None] | None = None,
    ):
        self.storage, self.cfg, self.shard, self.budget = storage, cfg, shard, budget
        self.remover = sp.writer_remover(shard)
        self.poll_seconds = POLL_SECONDS if poll_seconds is None else poll_seconds
        self.waiting = threading.Event()  # set while the writer waits for consumers (tests and callers watch it)
        self.keepalive = keepalive
        self._cache = BlockCache()
        self._kept: int | None = None  # the store's kept bytes at the last look (None: no look yet)
        self.waited_seconds = 0.0
        self.removed_blocks = 0
        self.scans = 0

    def removed_here(self) -> sp.Ranges:
        """The removed examples of this writer's shard (all removers')."""
        return removed_ranges(self.storage, self.shard)

    def scan(self) -> SpoolState:
        state = read_state(self.storage, self._cache)
        assert state is not None  # open_spool made the record
        self.scans += 1
        self._kept = state.kept_bytes
        return state

    def committed(self) -> None:
        """After this writer's commit: look at the store again (its block, other writers'
        commits, consumers' acknowledgements, removals)."""
        self.scan()

    def reserve(self, uncommitted: int, nbytes: int, commit: Callable[[], None]) -> None:
        """Return once the store's kept bytes + `uncommitted` (this writer's, since its last
        commit) + `nbytes` (the batch about to be written) fit the budget. `commit` commits
        what the writer holds (so consumers can read it, and it can be removed); called
        only when the batch does not fit beside it. Otherwise removes consumed blocks and
        waits, looking again every `poll_seconds`; never fails for waiting."""
        if nbytes > self.budget:
            raise SpoolError(
                f"a batch of {sp.format_bytes(nbytes)} of activations does not fit the spool's budget of "
                f"{sp.format_bytes(self.budget)}: append smaller batches or give the spool a larger budget"
            )
        if self._kept is not None and self._kept + uncommitted + nbytes <= self.budget:
            return  # the cached estimate says it fits (it only grows between scans by others' commits)
        state = self.scan()
        if state.kept_bytes + uncommitted + nbytes <= self.budget:
            return
        if uncommitted:
            commit()  # what this writer holds becomes readable, hence removable
            uncommitted = 0
            state = self.scan()
        self._wait(state, nbytes)

    def _wait(self, state: SpoolState, nbytes: int) -> None:
        started, bar, last = time.monotonic(), None, ""
        self.waiting.set()
        try:
            while True:
                n, _ = remove_consumed(self.storage, self.cfg, state, self.remover)
                self.removed_blocks += n
                if n:
                    state = self.scan()
                if state.kept_bytes + nbytes <= self.budget:
                    return
                line = waiting_line(state, nbytes)
                if bar is None:
                    bar = progress.bar(total=None, desc=f"shard {self.shard}", unit="poll", leave=False)
                if line != last:
                    bar.set_postfix_str(line)
                    last = line
                bar.update(1)
                if self.keepalive is not None:
                    self.keepalive()
                time.sleep(self.poll_seconds)
                state = self.scan()
        finally:
            self.waiting.clear()
            self.waited_seconds += time.monotonic() - started
            if bar is not None:
                bar.close()


# ---- the commands' operations ----------------------------------------------------------------
def gc(storage: Storage, remover: str | None = None) -> tuple[SpoolState, int, int] | None:
    """Remove every consumed block of the spool at `storage` (`actstore spool gc`, finalize):
    (the state after, blocks removed, bytes removed); None when the store is no spool.
    `remover`: the name its removal records go under (default: `cli-<8 hex>`, new each run)."""
    state = read_state(storage)
    if state is None:
        return None
    cfg = catalog.read_identity(storage)
    n, nbytes = remove_consumed(storage, cfg, state, remover or sp.cli_remover(os.urandom(4).hex()))
    return (read_state(storage) if n else state), n, nbytes


def drop(storage: Storage, name: str, by: str | None = None) -> tuple[SpoolState, int, int]:
    """Drop consumer `name` (`actstore spool drop`): it holds no block back from now on (the
    writers go on), and a consumer of that name that comes back is refused. Then removes
    what is consumed without it."""
    sp.check_name(name)
    if read_record(storage) is None:
        raise SpoolError(f"{storage.url} is not a spool (no {sp.SPOOL_FILE}); nothing to drop")
    known = {r.name for r in read_state(storage).consumers}
    if name not in known:
        raise SpoolError(
            f"no consumer named {name!r} is registered in the spool {storage.url}; registered: {sorted(known) or 'none'}"
        )
    who = by or f"{getpass.getuser()}@{socket.gethostname()} (actstore spool drop)"
    storage.put(sp.dropped_key(name), sp.dump_dropped(sp.DroppedRecord(name=name, dropped=records.now(), by=who)))
    out = gc(storage)
    assert out is not None
    return out
