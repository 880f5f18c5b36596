"""How a TokenStream window gets its tokens: mapped (one copy) or read (two copies).

A window slot describes where each of the window's tokens is, as rows of a gather source:

- mapped (local raw chunks, `FileRegion`): the files of the window's units are mapped
  read-only and their pages made resident (by the I/O threads: the page cache's own
  pages, nothing copied); `index[r]` is the region row of window row r. A batch is then
  one gather from the page cache straight into its buffer: one copy per token.
- read (object stores, a local cache, saev directories, or when mapping is not possible):
  the units are read into the slot's window buffer (the first copy), cached ones on the
  reader thread, the others through the I/O threads, the units of one object together
  (`read_many_into`: one batched request per Zarr shard file on an object store).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from actstore.errors import CorruptChunkError
from actstore.loaders.plan import WindowSlice
from actstore.loaders.source import request_objects
from actstore.loaders.state import StreamState
from actstore.storage.mapping import FileRegion

TASK_BYTES = 128 * 2**20  # most bytes one I/O task reads (the reads of one object stay together up to this)
KNOWN_UNITS = 1 << 20  # units whose mapped rows are remembered (about 200 bytes each)


class WindowSlot:
    """One window in flight: its gather source (`rows`) and, when mapped, `index` (window
    row -> source row) and the pinned region slots. `buf` is kept for reuse."""

    def __init__(self, buf: np.ndarray | None = None):
        self.buf = buf
        self.rows: np.ndarray | None = None
        self.index: np.ndarray | None = None
        self.pins: list[int] = []
        self.region: FileRegion | None = None

    def release(self) -> None:
        """The window was served: unpin its files (its buffer stays for the next window)."""
        if self.region is not None and self.pins:
            self.region.unpin(self.pins)
        self.pins, self.index, self.rows, self.region = [], None, None, None


def void_rows(a: np.ndarray) -> np.ndarray:
    """A C-contiguous (n, D) array as n opaque rows: numpy gathers those fastest."""
    return a.reshape(a.shape[0], -1).view(np.dtype((np.void, a.shape[1] * a.dtype.itemsize))).reshape(-1)


def order_of(w: WindowSlice, n_segments: int) -> np.ndarray:
    """The window's units in store order, segment by segment (each segment is its own
    array: its chunk files and shard files in turn)."""
    return np.lexsort((w.units, w.units % n_segments))


def unit_tokens(ts: StreamState, w: WindowSlice, i: int, e: int, s: int) -> np.ndarray | None:
    """Token numbers unit i of window w contributes (in window order); None when they are
    lo..hi of an unmasked unit."""
    rows = ts.units.kept_rows(e, s)
    return None if rows is None else rows[int(w.lo[i]) : int(w.hi[i])]


class MappedFill:
    """Fills window slots by mapping (see the module docstring)."""

    def __init__(self, ts: StreamState, region: FileRegion, pool: ThreadPoolExecutor):
        self.ts, self.region, self.pool = ts, region, pool
        self.known = region.known_units

    def fill(self, w: WindowSlice, slot: WindowSlot) -> bool:
        """Map every unit of w; False (nothing kept) when some unit cannot be mapped."""
        ts, region = self.ts, self.region
        units = ts.units
        ex, li, si = units.decode(w.units)
        found: list = [None] * len(w.units)
        pins: list[int] = []
        try:
            for i in order_of(w, self.ts.units.n_segments).tolist():  # store order: files in turn
                chunks = self._unit(int(w.units[i]), int(ex[i]), int(li[i]), int(si[i]))
                if chunks is None:
                    region.unpin(pins)
                    return False
                found[i] = chunks
                pins += [c.slot for c in chunks]
            self._populate(region.to_populate([(c.slot, c.offset, c.nbytes) for ch in found for c in ch]))
            index = self._index(w, found, ex, si)
        except BaseException:
            region.unpin(pins)
            raise
        slot.rows, slot.index, slot.pins, slot.region = region.rows, index, pins, region
        return True

    def _unit(self, u: int, e: int, layer_i: int, s: int) -> list | None:
        """The mapped chunks of unit u, pinned: as remembered while their files stay mapped
        (a lookup), else mapped now through the store."""
        region = self.region
        known = self.known.get(u)
        if known is not None:
            slots = [c.slot for c in known[0]]
            if region.repin(slots, known[1]):
                return known[0]
        units = self.ts.units
        chunks = self.ts.store.map_unit(region, e, units.layers[layer_i], units.segments[s].name)
        if chunks is not None:
            if len(self.known) >= KNOWN_UNITS:
                self.known.clear()
            self.known[u] = (chunks, [region.generation(c.slot) for c in chunks])
        return chunks

    def _index(self, w: WindowSlice, found: list, ex: np.ndarray, si: np.ndarray) -> np.ndarray:
        """Region row of every window row: for a unit of one chunk and no mask, its rows
        lo..hi from the chunk's first row (all such units at once); others unit by unit."""
        units = self.ts.units
        n = (w.hi - w.lo).astype(np.int64)
        first = np.array([ch[0].row for ch in found], np.int64)
        index = np.repeat(first + w.lo - w.dest, n) + np.arange(w.n_tokens, dtype=np.int64)
        for i in range(len(found)):
            chunks, s = found[i], int(si[i])
            toks = unit_tokens(self.ts, w, i, int(ex[i]), s)
            if len(chunks) == 1 and toks is None:
                continue
            lo, hi, dest = int(w.lo[i]), int(w.hi[i]), int(w.dest[i])
            toks = np.arange(lo, hi) if toks is None else toks
            starts = np.array([c.row for c in chunks], np.int64)
            t_chunk = units.segments[s].t_pad // len(chunks)
            index[dest : dest + hi - lo] = starts[toks // t_chunk] + toks % t_chunk
        return index

    def _populate(self, todo: list[tuple[int, int, int]]) -> None:
        """Make the ranges resident and mapped, on the I/O threads (disk reads when cold)."""
        if not todo:
            return
        step = max(1, -(-len(todo) // (self.ts.threads * 2)))
        futures = [self.pool.submit(self._populate_some, todo[k : k + step]) for k in range(0, len(todo), step)]
        _wait(futures)

    def _populate_some(self, ranges: list[tuple[int, int, int]]) -> None:
        for slot, offset, nbytes in ranges:
            try:
                self.region.populate(slot, offset, nbytes)
            except OSError as e:
                path = self.region.path_of(slot)
                raise CorruptChunkError(
                    f"{path}: reading bytes {offset}..{offset + nbytes} failed ({e.strerror or e}); the file changed "
                    "while mapped (truncated in place?) or the disk failed: run `actstore verify --deep`"
                ) from None


class ReadFill:
    """Fills window slots by reads (see the module docstring)."""

    def __init__(self, ts: StreamState, pool: ThreadPoolExecutor, cap: int):
        self.ts, self.pool, self.cap = ts, pool, cap
        self.cached = ts.store.read_cached  # page-cache-only reads (a reader without them declines each)
        self.many = ts.store.read_many_into
        self.object_of = request_objects(ts.store)  # local: no request to save
        self.read = ts.store.read_into
        self.row_bytes = ts.d_model * ts.stored_dtype.itemsize
        self.local = threading.local()

    def fill(self, w: WindowSlice, slot: WindowSlot) -> None:
        """Read every unit of window w into slot.buf[dest:dest+n], in store order. Units
        already in the page cache are copied here, on this one thread: memory copies, and
        more threads copying on a few cores only crowd out batch assembly and the loop.
        The others go to the I/O threads as they are found, in tasks of neighbouring
        units, the units of one object together (`read_many_into`: one request)."""
        if slot.buf is None:
            slot.buf = np.empty((self.cap, self.ts.d_model), self.ts.stored_dtype)
        buf = slot.buf
        units = self.ts.units
        order = order_of(w, self.ts.units.n_segments)
        ex, li, si = units.decode(w.units[order])
        nbytes = [units.segments[s].t_pad * self.row_bytes for s in si.tolist()]
        tasks = TaskPacker(sum(nbytes), self.ts.threads)
        futures: list[Future] = []
        for k, i in enumerate(order.tolist()):
            e, layer_i, s = int(ex[k]), int(li[k]), int(si[k])
            if self._unit(w, buf, i, e, layer_i, s, self.cached):
                continue
            obj = self.object_of(e, self.ts.units.layers[layer_i], units.segments[s].name) if self.object_of else k
            full = tasks.add((i, e, layer_i, s), obj, nbytes[k])
            if full:
                futures.append(self.pool.submit(self._read_units, w, buf, full))
        if tasks.items:
            futures.append(self.pool.submit(self._read_units, w, buf, tasks.items))
        _wait(futures)
        slot.rows, slot.index = void_rows(buf), None

    def _read_units(self, w: WindowSlice, buf: np.ndarray, units: list[tuple[int, int, int, int]]) -> None:
        if len(units) == 1:
            for i, e, layer_i, s in units:
                self._unit(w, buf, i, e, layer_i, s, self.read)
            return
        ts = self.ts
        items, copies = [], []
        partial = [u for u in units if not self._whole(w, *u)]
        scratch = self._scratch(sum(ts.units.segments[u[3]].t_pad for u in partial))
        at = 0
        for i, e, layer_i, s in units:
            seg = ts.units.segments[s]
            lo, hi, dest = int(w.lo[i]), int(w.hi[i]), int(w.dest[i])
            if self._whole(w, i, e, layer_i, s):
                out = buf[dest : dest + seg.t_pad]  # the unit fills t_pad rows of the window: straight in
            else:
                out, at = scratch[at : at + seg.t_pad], at + seg.t_pad
                copies.append((out, dest, lo, hi, unit_tokens(ts, w, i, e, s)))
            items.append((e, ts.units.layers[layer_i], seg.name, out))
        self.many(items)
        for out, dest, lo, hi, toks in copies:  # copy: the kept rows into the window
            buf[dest : dest + hi - lo] = out[lo:hi] if toks is None else out[toks]

    def _unit(self, w: WindowSlice, buf: np.ndarray, i: int, e: int, layer_i: int, s: int, read: Any) -> bool:
        """Unit i of window w into its rows of buf with `read` (a read_into, or read_cached,
        which may decline: then False and nothing is taken)."""
        ts = self.ts
        seg = ts.units.segments[s]
        lo, hi, dest = int(w.lo[i]), int(w.hi[i]), int(w.dest[i])
        layer = ts.units.layers[layer_i]
        if self._whole(w, i, e, layer_i, s):
            return read(e, layer, seg.name, buf[dest : dest + seg.t_pad]) is not False
        scratch = self._scratch(seg.t_pad)
        if read(e, layer, seg.name, scratch) is False:
            return False
        toks = unit_tokens(ts, w, i, e, s)
        buf[dest : dest + hi - lo] = scratch[lo:hi] if toks is None else scratch[toks]  # copy: the kept rows
        return True

    def _whole(self, w: WindowSlice, i: int, e: int, layer_i: int, s: int) -> bool:
        """Unit i fills t_pad rows of the window exactly (read straight into the window)."""
        return self.ts.units.masks[s] is None and int(w.lo[i]) == 0 and int(w.hi[i]) == self.ts.units.segments[s].t_pad

    def _scratch(self, n_rows: int) -> np.ndarray:
        """This thread's reused scratch rows (written before: no page faults)."""
        s = getattr(self.local, "buf", None)
        if s is None or s.shape[0] < n_rows:
            s = self.local.buf = np.empty((max(n_rows, 1), self.ts.d_model), self.ts.stored_dtype)
        return s[:n_rows]


class TaskPacker:
    """Cuts a run of reads (in store order) into I/O tasks: the reads of one object stay
    together up to TASK_BYTES (an object store then fetches them in one request); reads
    of different objects are packed up to about total / (2 x threads) bytes, so that
    every thread has work."""

    def __init__(self, total_bytes: int, threads: int):
        self.small = max(1, min(TASK_BYTES, total_bytes // (2 * threads)))
        self.items: list = []
        self.held, self.obj = 0, None

    def add(self, item: Any, obj: Any, nbytes: int) -> list | None:
        """Queue `item`; returns the finished task it closed (without it), if any."""
        done = None
        if self.items and (self.held + nbytes > TASK_BYTES or (obj != self.obj and self.held >= self.small)):
            done, self.items, self.held = self.items, [], 0
        self.items.append(item)
        self.held += nbytes
        self.obj = obj
        return done


def _wait(futures: list[Future]) -> None:
    """Wait for every task; raise the first failure once all have ended (none still
    writes into a buffer the caller may reuse)."""
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
