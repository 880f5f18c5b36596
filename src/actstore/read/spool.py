"""A reader's view of a spool: which published examples had their activation files removed
(actstore.layout.spool), so that reading one raises ExampleRemovedError instead of
returning the zeros a missing chunk reads as.

The removed sets are read when the store opens and again when older than REFRESH_SECONDS;
`ActStore[ex, layer]` also looks at the shard's removal records again after its read (a
removal writes its record before it deletes a file, so a read that met deleted files
always finds the record then)."""

from __future__ import annotations

import time

import numpy as np

from actstore.errors import ExampleRemovedError
from actstore.index import ExampleIndex
from actstore.layout import spool as sp
from actstore.layout.records import Manifest
from actstore.spoolstate import read_removed, removed_ranges
from actstore.storage import Storage

REFRESH_SECONDS = 1.0


class RemovedExamples:
    """The removed examples of a spool's shards, by shard number."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.by_shard: dict[int, sp.Ranges] = {}
        self.read_at = 0.0
        self.refresh()

    @classmethod
    def of(cls, storage: Storage, manifest: Manifest) -> RemovedExamples | None:
        """The view of the store at `storage`; None when its manifest says it is no spool
        (finalize records the spool's budget there: opening any other store costs no request)."""
        return cls(storage) if manifest.spool_budget is not None else None

    def refresh(self) -> None:
        self.by_shard = {s: sp.removed_union(r.values()) for s, r in read_removed(self.storage).items()}
        self.read_at = time.monotonic()

    def check(self, ex: int, shard: int, local: int, *, fresh: bool = False) -> None:
        """Raise ExampleRemovedError when example `ex` (local example `local` of shard
        `shard`) was removed; `fresh` reads the shard's removal records again first."""
        if fresh:
            self.by_shard[shard] = removed_ranges(self.storage, shard)
        elif time.monotonic() - self.read_at > REFRESH_SECONDS:
            self.refresh()
        if sp.contains(self.by_shard.get(shard, ()), local):
            raise ExampleRemovedError(
                f"example {ex} (local example {local} of shard {shard}) of {self.storage.url} was removed from the "
                "spool after every consumer read it: its activations are gone (its per-sample fields and texts are "
                "kept). Read a spool's activations as they are written (TokenStream.follow(path, consumer=NAME)), "
                "or capture without --spool to keep every token"
            )

    def n_removed(self) -> int:
        return sum(sp.range_count(r) for r in self.by_shard.values())

    def kept(self, index: ExampleIndex, manifest: Manifest, examples: np.ndarray) -> np.ndarray:
        """The examples of `examples` (global numbers of the store `index` and `manifest`
        describe) whose activations are kept."""
        self.refresh()
        out = []
        for ex in examples.tolist():
            pos, local = index.locate(ex)
            if not sp.contains(self.by_shard.get(manifest.shards[pos].shard, ()), local):
                out.append(ex)
        return np.asarray(out, np.int64)
