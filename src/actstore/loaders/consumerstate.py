"""A named consumer's progress over a store's blocks, as plain values (docs/loaders.md,
"Consumers: durable, resumable, every token once").

- A block (one line of a shard's meta/blocks.jsonl: examples start..stop) is *completed*
  once every kept token vector of it was handed to the training loop. Completed blocks are
  merged example ranges per shard (actstore.layout.spool's Ranges), the shape of the store's consumer record.
- A block *in flight* has some of its kept rows handed over: `InFlight` holds a bitmap of
  them (rows numbered in the order the stream reads a block: layer, segment, example,
  token), so that a restarted stream yields exactly the others.
- `Progress` is the two together, updated by the loop's thread as batches are handed
  over (each batch row carries a tag: the block's id in flight and the row's number) and
  read by state_dict(); `state()` / `restore()` are its JSON form.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.errors import CorruptStoreError
from actstore.layout.spool import Ranges, add_range, covers, merge_ranges

ROW_BITS = 32  # a tag is (block id << ROW_BITS) | row
STATE_FORMAT = "actstore.ConsumerStream"
STATE_VERSION = 1


def ranges_of(triples: Iterable[Iterable[int]]) -> dict[int, Ranges]:
    """[[shard, start, stop], ...] as merged ranges per shard (the consumer record's form)."""
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for shard, start, stop in triples:
        by_shard.setdefault(int(shard), []).append((int(start), int(stop)))
    return {s: merge_ranges(r) for s, r in sorted(by_shard.items())}


def triples_of(ranges: Mapping[int, Ranges]) -> list[list[int]]:
    """Merged ranges per shard as sorted [[shard, start, stop], ...]."""
    return [[s, a, b] for s in sorted(ranges) for a, b in ranges[s]]


def not_covered(a: Mapping[int, Ranges], b: Mapping[int, Ranges]) -> list[list[int]]:
    """The ranges of `a` (as [shard, start, stop]) that `b` does not cover whole."""
    return [[s, x, y] for s, x, y in triples_of(a) if not covers(b.get(s, ()), x, y)]


@dataclass
class InFlight:
    """A block whose kept rows are in the pool, some of them handed over (`yielded`)."""

    shard: int
    start: int
    stop: int
    yielded: np.ndarray  # bool, one per kept row of the block
    left: int = -1  # rows not yet yielded (counted when made)

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = int(len(self.yielded) - np.count_nonzero(self.yielded))


def _pack(bits: np.ndarray) -> str:
    return base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")


def _unpack(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8), count=n).astype(bool)


class Progress:
    """Completed blocks and blocks in flight (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self.completed: dict[int, Ranges] = {}
        self.flying: dict[int, InFlight] = {}
        self.resumed: dict[tuple[int, int, int], np.ndarray] = {}  # restored in-flight bitmaps, by block
        self._next_id = 0
        self.lock = threading.Lock()

    def begin(self, shard: int, start: int, stop: int, n_rows: int) -> tuple[int, np.ndarray]:
        """A block read into the pool: its id, and the rows of it still to hand over (bool).
        A block restored in flight keeps its bitmap; a block with nothing left is completed."""
        with self.lock:
            yielded = self.resumed.pop((shard, start, stop), None)
            if yielded is None:
                yielded = np.zeros(n_rows, bool)
            elif len(yielded) != n_rows:
                raise CorruptStoreError(
                    f"block {start}..{stop} of shard {shard} holds {n_rows} kept token vectors, but the state this "
                    f"stream was restored from counted {len(yielded)}: the shard was rewritten since"
                )
            block_id = self._next_id
            self._next_id += 1
            if yielded.all():
                self._complete(shard, start, stop)
            else:
                self.flying[block_id] = InFlight(shard, start, stop, yielded)
            return block_id, ~yielded

    def rewind(self) -> None:
        """A new iteration: the blocks in flight are read again, keeping what was yielded."""
        with self.lock:
            for f in self.flying.values():
                self.resumed[(f.shard, f.start, f.stop)] = f.yielded
            self.flying = {}

    def mark(self, tags: np.ndarray) -> None:
        """The rows `tags` (each once; sorted here, in place) were handed to the loop."""
        if not len(tags):
            return
        tags.sort()  # (in place: the batch's own copy) grouped by block, the id being the high bits
        ids = tags >> ROW_BITS
        rows = tags & ((1 << ROW_BITS) - 1)
        cuts = [0, *(np.flatnonzero(np.diff(ids)) + 1).tolist(), len(tags)]
        with self.lock:
            for a, b in zip(cuts[:-1], cuts[1:]):
                block_id = int(ids[a])
                f = self.flying[block_id]
                f.yielded[rows[a:b]] = True
                f.left -= b - a
                if not f.left:
                    self._complete(f.shard, f.start, f.stop)
                    del self.flying[block_id]

    def _complete(self, shard: int, start: int, stop: int) -> None:
        self.completed[shard] = add_range(self.completed.get(shard, ()), start, stop)

    def completed_now(self) -> dict[int, Ranges]:
        with self.lock:
            return dict(self.completed)

    def is_completed(self, shard: int, start: int, stop: int) -> bool:
        with self.lock:
            return covers(self.completed.get(shard, ()), start, stop)

    def state(self) -> dict[str, Any]:
        """completed and in_flight, JSON-serialisable (blocks with no row handed over are
        left out: a restarted stream reads them whole)."""
        with self.lock:
            flying = [f for f in self.flying.values() if f.yielded.any()]
            flying += [InFlight(*k, v) for k, v in self.resumed.items()]  # restored, not read again yet
            return {
                "completed": triples_of(self.completed),
                "in_flight": [
                    {"block": [f.shard, f.start, f.stop], "rows": len(f.yielded), "yielded": _pack(f.yielded)}
                    for f in sorted(flying, key=lambda f: (f.shard, f.start))
                ],
            }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Stand where `state` (checked by check_state) says; blocks in flight are read again."""
        with self.lock:
            self.completed = ranges_of(state["completed"])
            self.flying = {}
            self.resumed = {tuple(f["block"]): _unpack(f["yielded"], int(f["rows"])) for f in state["in_flight"]}


def check_state(state: Any, want: Mapping[str, Any]) -> None:
    """Refuse a state that is not a consumer stream's, or whose fields in `want` (consumer,
    rank, world_size, layers, segments, token_mask) differ: its rows would not be the same."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"not a consumer stream's state_dict (format {got!r}, expected {STATE_FORMAT!r})")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"consumer state version {state.get('version')!r} is not supported (this release reads {STATE_VERSION})"
        )
    diff = [f"{k}={state.get(k)!r} (this stream: {v!r})" for k, v in want.items() if state.get(k) != v]
    if diff:
        raise ValueError(
            "this state_dict was saved by another consumer or with other options: "
            + ", ".join(diff)
            + "; make the stream with the same consumer, rank, world_size, layers, segments and token_mask"
        )
    try:
        ranges_of(state["completed"])
        for f in state["in_flight"]:
            s, a, b = (int(v) for v in f["block"])
            if len(_unpack(f["yielded"], int(f["rows"]))) != int(f["rows"]):
                raise ValueError("bitmap shorter than its rows")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"a consumer state_dict's completed/in_flight fields are malformed ({e})") from None
