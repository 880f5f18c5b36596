"""A simulated spool consumer for the writer-side tests: it registers, reads each kept block
its rank owns (actstore.layout.spool.block_owner) and acknowledges it, as SPOOL.md says a
consumer does; `paused` holds it back. It also samples the activation bytes on disk."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from actstore import catalog
from actstore.layout import keys, records, spec
from actstore.layout import spool as sp
from actstore.layout.records import ShardEntry
from actstore.read.shard import ShardReader
from actstore.spoolstate import read_state
from actstore.storage import open_storage


def activation_bytes(storage: Any) -> int:
    """Bytes of every activation file of the store (kept, or written and not yet removed)."""
    total = 0
    for e in storage.list(keys.SHARDS):
        parts = e.key.split("/")
        if len(parts) >= 5 and parts[2] == keys.ARRAYS and parts[3].endswith("_activations"):
            if not keys.is_temporary(parts[-1]) and parts[-1] not in keys.ZARR_NAMES:
                total += e.size
    return total


class SimConsumer:
    """Consumer `name`, rank `rank` of `world_size`, of the spool at `url`."""

    def __init__(self, url: str, name: str, rank: int = 0, world_size: int = 1):
        self.storage = open_storage(url)
        self.name, self.rank, self.world_size = name, rank, world_size
        self.acked: dict[int, sp.Ranges] = {}
        self.got: dict[tuple[int, int], np.ndarray] = {}  # (shard, example) -> (L, T, D)
        self.paused = threading.Event()
        self.idle = threading.Event()  # set when a look found nothing to read (or it is paused)
        self.stop = threading.Event()
        self.max_disk = 0
        self.error: BaseException | None = None
        self.key = sp.consumer_key(name, rank)
        self.registered = records.now()

    def register(self) -> None:
        self._put(create=True)

    def _put(self, create: bool = False) -> None:
        rec = sp.ConsumerRecord(
            name=self.name,
            rank=self.rank,
            world_size=self.world_size,
            acked=self.acked,
            registered=self.registered,
            updated=records.now(),
        )
        if create:
            assert self.storage.put_if_absent(self.key, sp.dump_consumer(rec))
        else:
            self.storage.put(self.key, sp.dump_consumer(rec))

    def look(self) -> int:
        """Read and acknowledge every kept block this rank owns and has not acked: how many."""
        self.max_disk = max(self.max_disk, activation_bytes(self.storage))
        state = read_state(self.storage)
        if state is None:
            return 0
        cfg = catalog.read_identity(self.storage)
        n = 0
        for b in state.kept():
            if sp.block_owner(b.shard, b.index, b.start, self.world_size) != self.rank:
                continue
            if sp.covers(self.acked.get(b.shard, ()), b.start, b.stop):
                continue
            self._read(cfg, b)
            self.acked[b.shard] = sp.add_range(self.acked.get(b.shard, ()), b.start, b.stop)
            n += 1
        if n:
            self._put()
        return n

    def _read(self, cfg: Any, b: sp.SpoolBlock) -> None:
        entry = ShardEntry(
            shard=b.shard,
            name=keys.shard_name(b.shard),
            start=0,
            n_examples=b.stop,
            complete=False,
            n_blocks=b.index + 1,
            crc32c=0,
            nbytes=0,
        )
        reader = ShardReader(self.storage, entry, cfg)
        dtype = np.dtype(spec.ACT_DTYPES[cfg.dtype])
        for ex in range(b.start, b.stop):
            parts = []  # each segment's stored tokens, as ActStore[ex, layer] joins them
            for seg in cfg.segments:
                out = np.empty((len(cfg.layers), seg.t_pad, cfg.d_model), dtype)
                for lp in range(len(cfg.layers)):
                    reader.read_padded(seg, ex, lp, out[lp])
                parts.append(out[:, : int(reader.lengths(seg)[ex])])
            self.got[(b.shard, ex)] = np.concatenate(parts, axis=1)

    def run(self) -> None:
        """Look until stopped (a thread's target); while paused, read nothing."""
        try:
            while not self.stop.is_set():
                if self.paused.is_set():
                    self.max_disk = max(self.max_disk, activation_bytes(self.storage))
                    self.idle.set()
                    self.stop.wait(0.005)
                    continue
                if self.look() == 0:
                    self.idle.set()
                    self.stop.wait(0.005)
                else:
                    self.idle.clear()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e

    def start(self) -> threading.Thread:
        self.register()
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        return t


__all__ = ["SimConsumer", "activation_bytes", "records"]
