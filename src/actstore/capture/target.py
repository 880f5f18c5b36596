"""The store a capture writes to, opened once, and the rules of writing it again.

A `CaptureTarget` answers what the rest of a capture asks of the store before and after
its writers run: what it holds (its identity, each shard's committed examples), whether a
shard may be written (a fresh run refuses an existing shard; no shard a live writer
holds), what a resume keeps (token ids, the text budgets), and the clean-up of a failed
fresh run. The writers (ShardWriter) open their own shard; everything else goes through
here. It pickles as its URL (writer processes and Ray actors open their own).
"""

from __future__ import annotations

import os
from typing import Any

from actstore import catalog
from actstore.errors import CaptureShardExistsError, ShardBusyError
from actstore.layout.config import StoreConfig
from actstore.storage import open_storage


class CaptureTarget:
    """A store as a capture sees it.

    Args:
        store: a folder or an object-store URL (or a CaptureTarget, returned as is by `of`).
    """

    def __init__(self, store: str | os.PathLike):
        self.storage = open_storage(store)
        self.url = self.storage.url
        self.root: Any = self.storage.local_root if self.storage.local_root is not None else self.url
        self._identity: StoreConfig | None = None
        self._leases: dict[int, Any] = {}  # shard -> ShardLease taken before its writer opens

    @classmethod
    def of(cls, store: Any) -> CaptureTarget:
        return store if isinstance(store, CaptureTarget) else cls(store)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CaptureTarget, (str(self.root),))

    def __str__(self) -> str:
        return str(self.root)

    # ---- what the store holds ---------------------------------------------------------
    def identity(self) -> StoreConfig | None:
        """The store's StoreConfig (None before the first writer created it)."""
        if self._identity is None and catalog.has_identity(self.storage):
            self._identity = catalog.read_identity(self.storage)
        return self._identity

    def committed(self, shard: int) -> tuple[int, bool]:
        """(examples committed, complete) of a shard; (0, False) when it does not exist."""
        return catalog.committed(self.storage, shard)

    def committed_total(self, shards: range) -> int:
        return sum(self.committed(r)[0] for r in shards)

    def holds(self, shard: int) -> bool:
        """Whether the store has shard `shard` (committed examples or not)."""
        return catalog.shard_exists(self.storage, shard)

    def left_behind(self, shards: Any, resume: str) -> str | None:
        """What a failed run left in the store and how to go on (`resume`: how the caller
        spells resuming); None when none of `shards` exists."""
        held = [(r, *self.committed(r)) for r in shards if self.holds(r)]
        if not held:
            return None
        what = ", ".join(f"shard {r}: {n} examples committed{', complete' if done else ''}" for r, n, done in held)
        return (
            f"the run left {self.root} unfinalized ({what}); rerun with {resume} to continue it, "
            f"or remove {self.root} to start over"
        )

    # ---- the rules ------------------------------------------------------------------
    def check_fresh(self, shards: Any, resume: str = "--resume") -> None:
        """A run without --resume (`resume`, as the caller spells it) starts no shard that exists."""
        for r in shards:
            if self.holds(r):
                n_done, complete = self.committed(r)
                state = "complete" if complete else "left unfinished by an earlier run"
                raise CaptureShardExistsError(
                    f"{self.url} already holds shard {r} ({n_done} examples committed, {state}); "
                    f"pass {resume} to continue the run, or remove {self.url} or write to a new path to start over"
                )

    def check_lease(self, shard: int) -> None:
        """Refuse a shard that a live writer holds, before any model loads, when the writers
        run in other processes (each takes the lease itself: `take_lease`)."""
        from actstore.write.lease import current, holder_alive

        held = current(self.storage, shard)
        if held is not None and holder_alive(held):
            raise ShardBusyError(
                f"shard {shard} of {self.url} is being written by another writer: {held.holder()}. "
                "Two writers of one shard would interleave their blocks; give this writer another rank, or wait for that one"
            )

    def take_lease(self, shard: int) -> None:
        """Take the lease of `shard` for this process's writer before its model loads: a shard
        a live writer holds is refused now, and the writer adopts the lease (`lease`) instead
        of looking at it again. The taker gives it back with `release_leases` once its run
        ends (a no-op for a lease the writer already gave back; the one way back for a lease
        no writer adopted: the run failed before, or while, the writer opened)."""
        from actstore.write.lease import ShardLease

        if shard not in self._leases:
            self._leases[shard] = ShardLease.acquire(self.storage, shard, f"shard {shard} of {self.root}")

    def lease(self, shard: int) -> Any:
        """The lease taken for `shard` (for its writer to adopt), or None."""
        return self._leases.get(shard)

    def release_leases(self) -> None:
        for held in self._leases.values():
            held.release()
        self._leases.clear()

    def keeps_token_ids(self, batch_has_ids: bool) -> bool:
        """Token ids are kept when the batches carry input_ids, unless the store (resumed) has none."""
        cfg = self.identity()
        return cfg.token_ids if cfg is not None else batch_has_ids

    def stored_budgets(self) -> tuple[int, int, int] | None:
        """(p_max, r_max, text or prompt t_chunk) of the store being resumed, or None (no store yet)."""
        cfg = self.identity()
        if cfg is None:
            return None
        segs = cfg.segments
        return segs[0].t_max, (segs[1].t_max if len(segs) > 1 else 0), segs[0].t_chunk

    def is_empty(self) -> bool:
        return not self.storage.list_dir()

    def remove_if_nothing_committed(self, world: int) -> None:
        """After a failed fresh run: delete the store it created if no writer committed anything."""
        if self.is_empty():
            return
        if any(self.committed(r)[0] for r in range(world)):
            return
        self.storage.delete_prefix("")
