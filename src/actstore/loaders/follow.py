"""FollowStream (`TokenStream.follow(path)`): training while capturing.

It streams the committed blocks of a store that writers are still filling, and ends once
the store is finalized and every example it publishes has been streamed. A reader thread
looks at the writer shards' commit records every `poll_s` seconds; the examples a commit
adds are read at once (their shard read through a ShardReader of the committed prefix,
which is what finalize would publish) into a pool of `buffer_bytes` of token vectors (up
to half a pool more waits beside it, read ahead, to fill the room each batch makes). A batch is drawn at random from the pool once the pool is full, or when the
store is finalized (the pool is then drained): each batch mixes a window of the most
recently committed tokens. Every kept token vector is yielded exactly once, and only
rows of the shard generations the store publishes: a shard rewritten or deleted under the
stream, a store deleted, or a writer that died end it with an error naming them
(actstore.loaders.followcheck says how each is seen).

What a plain follow stream cannot do, and says so when asked: resume (the order depends
on when blocks were committed) and ranks: a named consumer does both
(`TokenStream.follow(path, consumer="name")`, actstore.loaders.consumer, which builds on
this pool); DataLoader workers (one process reads the growing store) and normalisation
(the store's statistics exist once it is finalized) neither does.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import fields
from types import SimpleNamespace
from typing import Any, Unpack

import numpy as np
import torch

from actstore import catalog
from actstore.errors import ActstoreError, NotFinalizedError, SegmentNotFoundError
from actstore.layout import keys, spec
from actstore.layout.config import StoreConfig
from actstore.layout.records import ShardEntry
from actstore.loaders.base import BaseTokenStream
from actstore.loaders.buffers import TORCH_DTYPES
from actstore.loaders.feed import DeviceFeeder
from actstore.loaders.followcheck import (
    LEASE_CHECK_S,
    Taken,
    all_published_taken,
    check_seconds,
    check_writers,
    gone,
    same_generation,
    vanished,
)
from actstore.loaders.spec import StreamOptions, StreamSpec, make_spec
from actstore.read.interface import Reader
from actstore.read.layers import resolve_layer
from actstore.read.masks import CONTENT, effective_token_mask
from actstore.read.shard import ShardReader
from actstore.storage import Storage, open_storage

READ_EXAMPLES = 64  # examples of a shard read together
READ_TRIES = 3  # looks at a shard whose read failed with its block records unchanged, before it is damage
NO_RESUME = (
    "a follow stream cannot be resumed: its order depends on when each block was committed; "
    "make it a named consumer (TokenStream.follow(path, consumer='name')), which resumes from its state_dict(), "
    "or train on TokenStream(store) once the store is finalized"
)


class FollowStream(BaseTokenStream):
    """Batches (batch_size, D) of the token vectors of a store being written (see the
    module docstring).

    Args:
        store: the store's location (a folder, a URL, a Storage; or a Reader of it, whose
            storage is followed); it may not exist yet.
        poll_s: how often the commit records are read (seconds, > 0).
        idle_timeout_s: give up (NotFinalizedError) when no block was committed for this
            long and the store is not finalized (seconds, >= 0; None: wait forever). A
            writer found dead (its lease) ends the stream sooner, as does a store deleted
            (StoreNotFoundError) or a shard rewritten under it (ShardRewrittenError).
        **options: a TokenStream's (StreamSpec's fields), of which it uses batch_size,
            layers, segments, seed, buffer_bytes (the pool a batch is drawn from), dtype,
            device, prefetch_batches and token_mask ("default", "all" (None), "content" or
            a per-token field name); the reading knobs (threads, prefetch, mmap,
            gather_threads) are ignored, and the others refused unless at their defaults.
    """

    def __init__(
        self,
        store: str | os.PathLike | Storage | Reader,
        *,
        poll_s: float = 0.1,
        idle_timeout_s: float | None = 600.0,
        **options: Unpack[StreamOptions],
    ):
        _refuse(options)
        self.spec = spec = make_spec(None, options, "TokenStream.follow()")
        token_mask = spec.token_mask
        if not (isinstance(token_mask, str) or token_mask is None):
            raise ValueError(
                "a follow stream takes token_mask 'default', 'all', 'content' or a per-token field name "
                f"(examples are numbered only once the store is finalized). Got {type(token_mask).__name__}."
            )
        self.location = getattr(store, "storage", store)
        self.batch_size, self.seed, self.buffer_bytes = spec.batch_size, spec.seed, spec.buffer_bytes
        self.layers_asked, self.segments_asked, self.token_mask = spec.layers, spec.segments, token_mask
        self.dtype, self.device, self.prefetch_batches = spec.dtype, spec.device, spec.prefetch_batches
        self.poll_s = check_seconds("poll_s", poll_s, positive=True)
        self.idle_timeout_s = check_seconds("idle_timeout_s", idle_timeout_s, positive=False, none_means="wait forever")
        self.blocks_read: list[tuple[int, int, int, float]] = []  # (shard, first, stop, time.monotonic()) per read
        self._iterations = 0
        self.position = None  # no epochs, no resume (BaseTokenStream)

    def loader(self, num_workers: int = 0, **kwargs: Any) -> FollowStream:
        """The stream itself: a growing store is read by one process."""
        if num_workers:
            raise ValueError(
                "a follow stream reads the growing store in this process: num_workers must be 0 "
                "(its reader thread keeps up with capture); iterate the stream itself"
            )
        return self

    def state_dict(self) -> dict[str, Any]:
        """Refused: a follow stream cannot resume (see the message)."""
        raise ValueError(NO_RESUME)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refused: a follow stream cannot resume (see the message)."""
        raise ValueError(NO_RESUME)

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._iterations += 1
        batches = self._batches()
        if self.device is None:
            return batches
        return iter(DeviceFeeder(batches, self.device, prefetch=self.prefetch_batches))

    def _batches(self) -> Iterator[torch.Tensor]:
        storage = open_storage(self.location)
        cfg = self._wait_for_identity(storage)
        pool = self._pool(cfg)
        reader = threading.Thread(target=pool.run, args=(storage,), daemon=True, name="actstore-follow")
        reader.start()
        try:
            yield from pool.serve()
        finally:
            pool.stop.set()
            with pool.cond:
                pool.cond.notify_all()
            reader.join()

    def _pool(self, cfg: StoreConfig) -> _Pool:
        return _Pool(self, cfg)

    def _wait_for_identity(self, storage: Storage) -> StoreConfig:
        t0 = time.monotonic()
        while not catalog.has_identity(storage):
            if self.idle_timeout_s is not None and time.monotonic() - t0 > self.idle_timeout_s:
                raise NotFinalizedError(
                    f"{storage.url} holds no store after {self.idle_timeout_s:g} s: start its writers, or check the path"
                )
            time.sleep(self.poll_s)
        return catalog.read_identity(storage)


class _Pool:
    """The reader thread's state and the pool of token vectors it fills."""

    HEADROOM = 1  # room kept above a full pool: the rows of one read (a consumer's pool: none, see there)

    def __init__(self, fs: FollowStream, cfg: StoreConfig):
        self.fs, self.cfg = fs, cfg
        names: dict[str, int] = {}
        asked = fs.layers_asked
        asked = list(cfg.layers) if asked is None else [asked] if isinstance(asked, (int, str)) else list(asked)
        self.layers = [resolve_layer(x, cfg.layers, names) for x in asked]
        seg_names = [s.name for s in cfg.segments]
        picked = (
            seg_names
            if fs.segments_asked is None
            else [fs.segments_asked]
            if isinstance(fs.segments_asked, str)
            else list(fs.segments_asked)
        )
        missing = [s for s in picked if s not in seg_names]
        if missing or not picked:
            raise SegmentNotFoundError(
                f"segments {missing or picked} are not in this store; it has segments {seg_names}"
            )
        self.segs = [cfg.segment(s) for s in picked]
        self.mask = effective_token_mask(SimpleNamespace(config=cfg), fs.token_mask)
        self.np_dtype = np.dtype(spec.ACT_DTYPES[cfg.dtype])
        self.d = int(cfg.d_model)
        row_bytes = self.d * self.np_dtype.itemsize
        self.unit_max = self.HEADROOM * READ_EXAMPLES * len(self.layers) * sum(s.t_max for s in self.segs)
        self.cap = max(fs.buffer_bytes // row_bytes, 2 * fs.batch_size) + self.unit_max
        self.rows = np.empty((self.cap, self.d), self.np_dtype)
        self.tags: np.ndarray | None = None  # a consumer's pool: each row's tag (loaders/consumerstate.py)
        self.drawn: deque[np.ndarray] = deque()  # with tags: the tags of each batch drawn, in order
        self.starved = False  # draw before the pool is full: its writers wait for what it holds
        self.staged: deque[tuple[np.ndarray, np.ndarray | None]] = deque()  # read, waiting for room in the pool
        self.staged_rows = 0
        self.n = 0
        self.done = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.piece_bytes = max(fs.buffer_bytes // 4, 1)  # rows read before the shard is checked and they are taken
        self.rng = np.random.default_rng([fs.seed, fs._iterations])
        self.out_dtype = TORCH_DTYPES[cfg.dtype] if fs.dtype is None else fs.dtype

    # ---- the reader thread ---------------------------------------------------------
    def run(self, storage: Storage) -> None:
        try:
            self._follow(storage)
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()
        else:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def _follow(self, storage: Storage) -> None:
        taken: dict[int, Taken] = {}
        last_new = time.monotonic()
        next_writers_check = last_new
        while not self.stop.is_set():
            if not catalog.has_identity(storage):
                raise vanished(storage, taken)
            manifest = _manifest(storage)  # read before the commits: it covers no more than they do
            numbers = catalog.shard_numbers(storage)
            for number in sorted(set(taken) - set(numbers)):
                if taken[number].n:
                    raise gone(storage, number, taken, "its folder is gone")
            grew = False
            for number in numbers:
                grew |= self._poll_shard(storage, number, taken)
            if manifest is not None and manifest.partial is None and all_published_taken(storage, manifest, taken):
                return  # finalized, and every published example was streamed (each exactly the published one)
            now = time.monotonic()
            if grew:
                last_new = now
                continue
            self._nothing_new(storage)
            if now >= next_writers_check:
                self._check_writers(storage, taken)
                next_writers_check = now + LEASE_CHECK_S
            if self.fs.idle_timeout_s is not None and now - last_new > self.fs.idle_timeout_s:
                raise NotFinalizedError(
                    f"no block was committed to {storage.url} for {self.fs.idle_timeout_s:g} s and it is not finalized: "
                    "are its writers running? (finalize it when they are done)" + self._idle_hint()
                )
            self.stop.wait(self.fs.poll_s)

    def _check_writers(self, storage: Storage, taken: dict[int, Taken]) -> None:
        check_writers(storage, taken)

    def _nothing_new(self, storage: Storage) -> None:
        """A look found no new block (a consumer of a spool then serves a pool not yet full)."""

    def _idle_hint(self) -> str:
        """More to say when the stream gives up waiting (a consumer's pending acknowledgements)."""
        return ""

    def _poll_shard(self, storage: Storage, number: int, taken: dict[int, Taken]) -> bool:
        """Take the rows a shard committed since the last look; whether there were any."""
        t = taken.setdefault(number, Taken())
        try:
            return self._take(storage, number, t)
        except _Changed as c:
            if not catalog.has_identity(storage):
                raise vanished(storage, taken) from None
            if t.n:
                raise gone(storage, number, taken, str(c)) from None
            return False  # it changed before anything was taken from it: look again at the next poll

    def _take(self, storage: Storage, number: int, t: Taken) -> bool:
        shard = catalog.shard_storage(storage, number)
        try:
            if shard.kind(keys.COMMIT) is None:
                raise _Changed("its commit record is gone")
            rec = catalog.read_commit(shard)
            if rec == t.commit:
                return False
            blocks = catalog.read_blocks(shard, rec.n_blocks)
        except (ActstoreError, OSError) as e:
            if t.n or not catalog.has_identity(storage) or shard.kind(keys.COMMIT) is None:
                raise _Changed(f"reading its records failed: {e}") from None
            raise
        if rec.n_committed < t.n or blocks[: len(t.blocks)] != t.blocks:
            raise _Changed("its block records changed")
        if rec.n_committed == t.n:
            t.commit = rec
            return False
        try:
            self._read(storage, number, rec, blocks, t)
        except (ActstoreError, OSError) as e:
            if not same_generation(shard, blocks):
                raise _Changed(f"reading it failed: {e}") from None
            t.failed += 1  # a file replaced whole between two reads of it (an object store's
            if t.failed < READ_TRIES:  # Zarr shard file as it grows): read again at the next look
                return False
            raise  # damage, not a change
        t.commit, t.failed = rec, 0  # (only now: a read given up is tried again at the next look)
        return True

    def _open(self, storage: Storage, number: int, rec: Any) -> tuple[ShardReader, dict, dict]:
        """A reader of a shard's committed prefix, its segments' lengths and kept-token masks."""
        entry = ShardEntry(
            shard=number,
            name=keys.shard_name(number),
            start=0,
            n_examples=rec.n_committed,
            complete=rec.complete,
            n_blocks=rec.n_blocks,
            crc32c=0,
            nbytes=0,
        )
        reader = ShardReader(storage, entry, self.cfg)
        lens = {s.name: reader.lengths(s) for s in self.segs}
        keep = {s.name: self._keep(reader, s.name) for s in self.segs}
        return reader, lens, keep

    def _read(self, storage: Storage, number: int, rec: Any, blocks: list[Any], t: Taken) -> None:
        """Take the examples t.n..rec.n_committed of a shard into the pool, a piece of about
        piece_bytes at a time, each once the shard holds the same block records after it was read."""
        reader, lens, keep = self._open(storage, number, rec)
        shard = catalog.shard_storage(storage, number)
        piece: list[np.ndarray] = []
        units: list[tuple[int, int, int, float]] = []
        for lo in range(t.n, rec.n_committed, READ_EXAMPLES):
            hi = min(rec.n_committed, lo + READ_EXAMPLES)
            piece.append(self._read_unit(reader, lens, keep, lo, hi))
            units.append((number, lo, hi, time.monotonic()))
            if hi < rec.n_committed and sum(p.nbytes for p in piece) < self.piece_bytes:
                continue
            if not same_generation(shard, blocks):  # the rows read are this generation's: only then taken
                raise _Changed("its block records changed while it was read")
            for rows in piece:
                self._add(rows)
            t.n, t.blocks = hi, blocks
            self.fs.blocks_read.extend(units)
            piece, units = [], []

    def _read_unit(self, reader: ShardReader, lens: dict, keep: dict, lo: int, hi: int) -> np.ndarray:
        """The kept token vectors of examples lo..hi-1 (a copy)."""
        parts = []
        for layer in self.layers:
            lp = self.cfg.layers.index(layer)
            for seg in self.segs:
                t_pad = seg.t_pad
                buf = np.empty((hi - lo, t_pad, self.d), self.np_dtype)
                reader.read_many(seg, [(e, lp, buf[e - lo]) for e in range(lo, hi)])
                within = np.arange(t_pad)[None, :] < lens[seg.name][lo:hi, None]
                if keep[seg.name] is not None:
                    within[:, : seg.t_max] &= keep[seg.name][lo:hi]
                parts.append(
                    buf.reshape(-1, self.d) if within.all() else buf[within]
                )  # (a copy only if some are left out)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _keep(self, reader: ShardReader, seg: str) -> np.ndarray | None:
        if self.mask is None:
            return None
        name = f"{seg}{spec.TOKEN_LABELS_SUFFIX}" if self.mask == CONTENT else f"{seg}_{self.mask}"
        arr = np.asarray(reader.per_sample(name))
        return arr == 0 if self.mask == CONTENT else arr != 0

    def _add(self, rows: np.ndarray, tags: np.ndarray | None = None) -> None:
        """Rows (and their tags, in a consumer's pool) into the pool, in order: what does not
        fit waits in `staged` (views, no copy) for the loop to move it in after a draw; the
        reader waits only while more than half a pool is staged."""
        with self.cond:
            k = 0 if self.staged else min(len(rows), self.cap - self.n)
            self._put(rows[:k], None if tags is None else tags[:k])
            if k < len(rows):
                self.staged.append((rows[k:], None if tags is None else tags[k:]))
                self.staged_rows += len(rows) - k
            self.cond.notify_all()
            while self.staged_rows > self.cap // 2 and not self.stop.is_set():
                self.cond.wait(0.1)

    def _put(self, rows: np.ndarray, tags: np.ndarray | None) -> None:
        """Rows into the pool's free room (the caller holds the lock and checked it fits)."""
        k = len(rows)
        self.rows[self.n : self.n + k] = rows  # copy: into the pool
        if tags is not None:
            self.tags[self.n : self.n + k] = tags
        self.n += k

    def _refill(self) -> None:
        """Staged rows into the room a draw made, first staged first (the lock held)."""
        k = min(self.cap - self.n, self.staged_rows)
        if k > 0:
            self._fill(np.arange(self.n, self.n + k))
            self.n += k

    # ---- the loop's side -----------------------------------------------------------
    def serve(self) -> Iterator[torch.Tensor]:
        b = self.fs.batch_size
        full = self.cap - self.unit_max  # the reader cannot be sure to add a read's rows beyond this
        while True:
            with self.cond:
                while not (self.error or self.n >= full or self.done or (self.starved and self.n)):
                    self.cond.wait(0.1)
                if self.error is not None:
                    raise self.error
                self._refill()
                if self.done and not self.n:
                    return
                batch = self._draw(min(b, self.n))
                self._refill()
                self.cond.notify_all()
            yield batch

    def _draw(self, b: int) -> torch.Tensor:
        """b rows drawn at random from the pool (a copy), the pool compacted."""
        n = self.n
        take = self.rng.choice(n, b, replace=False)
        out = torch.from_numpy(self.rows[take])  # copy: the batch
        if self.tags is not None:
            self.drawn.append(self.tags[take])  # (a copy) before the batch is yielded: the loop pops it
        if self.staged_rows >= b:
            self._fill(take)  # staged rows straight into the holes: no compaction
            return self._cast(out)
        drawn = np.zeros(n, bool)
        drawn[take] = True
        holes = take[take < n - b]
        tail = np.arange(n - b, n)[~drawn[n - b :]]
        self.rows[holes] = self.rows[tail]  # copy: the pool's last rows into the holes
        if self.tags is not None:
            self.tags[holes] = self.tags[tail]
        self.n = n - b
        return self._cast(out)

    def _fill(self, holes: np.ndarray) -> None:
        """The first len(holes) staged rows into the pool's rows `holes` (the lock held)."""
        at = 0
        while at < len(holes):
            rows, tags = self.staged[0]
            k = min(len(rows), len(holes) - at)
            self.rows[holes[at : at + k]] = rows[:k]  # copy: into the pool
            if tags is not None:
                self.tags[holes[at : at + k]] = tags[:k]
            at += k
            self.staged_rows -= k
            if k == len(rows):
                self.staged.popleft()
            else:
                self.staged[0] = (rows[k:], None if tags is None else tags[k:])

    def _cast(self, out: torch.Tensor) -> torch.Tensor:
        if self.cfg.dtype == "bfloat16":
            out = out.view(torch.bfloat16)
        return out if out.dtype == self.out_dtype else out.to(self.out_dtype)


class _Changed(Exception):
    """A shard changed under a look or a read (raised and caught in _Pool only)."""


def _manifest(storage: Storage) -> Any:
    if not storage.exists(keys.MANIFEST):
        return None
    return catalog.read_manifest(storage)


def _refuse(options: dict[str, Any]) -> None:
    """Options a follow stream cannot honour, refused by name (StreamSpec's defaults pass, and
    rank 0 of world size 1; unknown names are make_spec's to refuse)."""
    why = {
        "normalize": "the store's statistics exist once it is finalized; normalise in your loop",
        "rank": "one process reads the growing store (a named consumer takes ranks: consumer='name')",
        "world_size": "one process reads the growing store (a named consumer takes ranks: consumer='name')",
        "return_index": "examples are numbered only once the store is finalized",
        "shuffle": "its order is the order of the commits, mixed in the pool",
        "drop_last": "the last batch is what is left when the store is finalized",
        "run_bytes": "units are read as they are committed",
        "pin_memory": "pass device='cuda' for batches copied there from pinned memory",
    }
    defaults = {f.name: f.default for f in fields(StreamSpec)}
    fine = {k: {defaults[k]} for k in why} | {"rank": {None, 0}, "world_size": {None, 1}}
    for k, v in options.items():
        if k in why and v not in fine[k]:
            raise ValueError(f"TokenStream.follow(...) cannot take {k}={v!r}: {why[k]}")
