"""TokenPipeline: one consumer's background reading and batch assembly for TokenStream.

A reader thread fills window buffers through a thread pool (whole-chunk reads, which
release the GIL) while an assembler thread gathers batches from the previous window into
a ring of reused buffers and queues them, so the training loop finds a batch waiting.
Buffers are handed back to the stream at the end and reused by the next epoch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from actstore.dtypes import TORCH_GRAIN
from actstore.loaders.buffers import TORCH_DTYPES, BufferRing
from actstore.loaders.plan import EpochPlan, WindowSlice
from actstore.loaders.source import TokenUnits, reader

if TYPE_CHECKING:
    from actstore.loaders.tokens import TokenStream

_STOP = object()


class TokenPipeline:
    """One consumer's reader and assembler threads, with bounded queues between them."""

    def __init__(self, ts: TokenStream, plan: EpochPlan, windows: range, skip: int, in_worker: bool):
        self.ts, self.plan = ts, plan
        spare, ts._spare = ts._spare, {}
        if "pending" in spare:  # the last epoch's reader, reading this epoch's first window
            spare = spare["pending"].finish()
        # Batches go into a ring of reused buffers: the queue holds 2, the loop one or two.
        self.ring = spare.get("ring") or BufferRing(6, ts.dtype, pin=ts.pin_memory and not in_worker, shared=in_worker)
        self.gather = spare.get("gather")
        if self.gather is None:
            self.gather = torch.empty((ts.batch_size, ts.d_model), dtype=TORCH_DTYPES[ts.store.dtype])
        self.read = reader(ts.store)
        self.cached = getattr(ts.store, "read_cached", None)  # page-cache-only reads, where the store has them
        n_buf = ts.prefetch + 2  # one being served, one being read, `prefetch` waiting
        self.free: queue.Queue = queue.Queue()
        cap = plan.window_tokens + max(s.t_pad for s in ts.segments)
        # Skip whole windows already consumed; `first` batches of the next are skipped too.
        todo = list(windows)
        while todo and skip >= plan.window_n_batches(todo[0]):
            skip -= plan.window_n_batches(todo.pop(0))
        self.windows, self.first_skip = todo, skip
        # The last epoch's reader may have read this epoch's first window already.
        ahead = spare.get("ahead")
        self.in_main = not in_worker
        use_ahead = ahead is not None and self.in_main and ahead[0] == _plan_key(ts, plan) and todo[:1] == [0] and skip == 0
        windows_spare = [b for b in spare.get("windows", []) if b.shape == (cap, ts.d_model) and not (use_ahead and b is ahead[2])]
        self.buffers = [windows_spare.pop() if windows_spare else np.empty((cap, ts.d_model), ts.stored_dtype)
                        for _ in range(min(n_buf, max(len(windows), 1)) - (1 if use_ahead else 0))]
        for b in self.buffers:
            self.free.put(b)
        self.full: queue.Queue = queue.Queue(maxsize=ts.prefetch + 1)
        if use_ahead:
            self.buffers.append(ahead[2])
            self.full.put((ahead[1], ahead[2]))
            self.windows = todo[1:]
        self.ahead: tuple | None = None
        self.epoch_read = False  # the reader has read every window of this epoch
        self.served = False  # the loop has taken every batch of this epoch
        self.out: queue.Queue = queue.Queue(maxsize=2)
        self.stop = threading.Event()
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(ts.threads, thread_name_prefix="actstore-read")
        self.threads = [
            threading.Thread(target=self._guard, args=(self._read_windows, self.full), daemon=True, name="actstore-reader"),
            threading.Thread(target=self._guard, args=(self._assemble, self.out), daemon=True, name="actstore-batches"),
        ]
        for t in self.threads:
            t.start()

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._get(self.out)
            if item is _STOP:
                self.served = not self.stop.is_set()  # every batch of the epoch went out
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        if self.served and self.epoch_read and not self.stop.is_set():
            # The whole epoch was served: the reader may still be reading the next epoch's
            # first window. Let it finish in the background; the next pipeline of this
            # stream waits for it (finish) and takes its buffers.
            self.threads[1].join(timeout=30)
            if not self.threads[1].is_alive():
                self.ts._spare = {"pending": self}
                return
        self.stop.set()
        self.finish()

    def finish(self) -> dict:
        """Wait for the threads and hand the buffers back to the stream (and return them)."""
        for t in self.threads:
            t.join(timeout=30)
        self.pool.shutdown(wait=True, cancel_futures=True)
        spare = {}
        if not any(t.is_alive() for t in self.threads):
            spare = {"windows": self.buffers, "ring": self.ring, "gather": self.gather, "ahead": self.ahead}
        if self.ts._spare.get("pending") is self:
            self.ts._spare = spare
        return spare

    # ---- threads ------------------------------------------------------------------
    def _get(self, q: queue.Queue) -> Any:
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return _STOP

    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _guard(self, target: Any, q: queue.Queue) -> None:
        try:
            signalled = target()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(q, e)
        else:
            if not signalled:
                self._put(q, _STOP)

    def _read_windows(self) -> bool:
        for j in self.windows:
            buf = self._get(self.free)
            if buf is _STOP:
                return False
            w = self.plan.window(j)
            self._fill(w, buf)
            if not self._put(self.full, (w, buf)):
                return False
        if not self.in_main:
            return False
        # This epoch is read: tell the assembler, then read the next epoch's first window
        # while the last batches are served, so the next epoch starts without waiting.
        self.epoch_read = True  # before the assembler can end the epoch: close() reads it
        self._put(self.full, _STOP)
        nxt = self.ts.plan(self.plan.epoch + 1)
        if nxt.n_windows and not self.stop.is_set():
            buf = self._get(self.free)
            if buf is not _STOP:
                w = nxt.window(0)
                self._fill(w, buf)
                self.ahead = (_plan_key(self.ts, nxt), w, buf)
        return True

    def _fill(self, w: WindowSlice, buf: np.ndarray) -> None:
        """Read every unit of window w into buf[dest:dest+n], in store order (closer to
        sequential on disk; the window is permuted in memory anyway). Units already in
        the page cache are copied here, on this one thread: they are memory copies, and
        more threads copying on a few cores only crowd out batch assembly and the training
        loop. The others go to the I/O thread pool, many at a time, as they are found."""
        order = np.argsort(w.units, kind="stable")
        n = len(order)
        step = max(1, -(-n // (self.ts.threads * 4)))
        futures, pending = [], []
        ex, li, si = self.ts.units.decode(w.units[order])
        for k, i in enumerate(order.tolist()):
            if self.cached is None or not self._read_unit(w, buf, i, int(ex[k]), int(li[k]), int(si[k]), self.cached):
                pending.append(i)
                if len(pending) == step:
                    futures.append(self.pool.submit(self._read_units, w, buf, np.asarray(pending)))
                    pending = []
        if pending:
            futures.append(self.pool.submit(self._read_units, w, buf, np.asarray(pending)))
        for f in futures:
            f.result()

    def _read_units(self, w: WindowSlice, buf: np.ndarray, which: np.ndarray) -> None:
        ex, li, si = self.ts.units.decode(w.units[which])
        for k, i in enumerate(which.tolist()):
            self._read_unit(w, buf, i, int(ex[k]), int(li[k]), int(si[k]), self.read)

    def _read_unit(self, w: WindowSlice, buf: np.ndarray, i: int, e: int, li: int, s: int, read: Any) -> bool:
        """Unit i of window w into its rows of buf with `read` (a read_into, or read_cached,
        which may decline: then False and nothing is taken)."""
        units = self.ts.units
        seg = units.segments[s]
        lo, hi, dest = int(w.lo[i]), int(w.hi[i]), int(w.dest[i])
        rows = units.kept_rows(e, s)
        layer = units.layers[li]
        if rows is None and lo == 0 and hi == seg.t_pad:
            # The unit fills t_pad rows of the window exactly: read straight into it.
            return read(e, layer, seg.name, buf[dest : dest + seg.t_pad]) is not False
        scratch = self._scratch(seg.t_pad)
        if read(e, layer, seg.name, scratch) is False:
            return False
        # One copy: the kept rows of this unit into the window.
        buf[dest : dest + hi - lo] = scratch[lo:hi] if rows is None else scratch[rows[lo:hi]]
        return True

    def _scratch(self, t_pad: int) -> np.ndarray:
        s = getattr(self.local, "buf", None)
        if s is None or s.shape[0] < t_pad:
            s = np.empty((t_pad, self.ts.d_model), self.ts.stored_dtype)
            self.local.buf = s
        return s[:t_pad]

    def _assemble(self) -> None:
        ts = self.ts
        first = self.first_skip
        while True:
            item = self._get(self.full)
            if item is _STOP or isinstance(item, BaseException):
                if isinstance(item, BaseException):
                    raise item
                return
            w, buf = item
            perm = self.plan.window_permutation(w)
            win = buf[: w.n_tokens]
            keys = index = None
            if (ts._norm is not None and len(ts._norm[0]) > 1) or ts.return_index:
                index = _window_index(ts.units, w)
                keys = index[1] * ts.units.n_segments + index[2]
            for b in range(first, w.n_batches):
                rows = perm[b * ts.batch_size : (b + 1) * ts.batch_size]
                batch = self._batch(win, rows, keys)
                if ts.return_index:
                    batch = _index_dict(batch, ts.units, index, rows)
                if not self._put(self.out, batch):
                    return
            first = 0
            self.free.put(buf)
            if self.stop.is_set():
                return

    def _batch(self, win: np.ndarray, rows: np.ndarray, keys: np.ndarray | None) -> torch.Tensor:
        ts = self.ts
        out = self.ring.take((len(rows), ts.d_model))
        same = out.dtype == self.gather.dtype
        dst = _numpy_view(out) if same else _numpy_view(self.gather)[: len(rows)]
        # copy: the batch's rows out of the window. numpy's take runs on one core without
        # the GIL (torch's index_select would spin up its OpenMP pool); rows are in range.
        np.take(win, rows, axis=0, out=dst, mode="clip")
        if same and ts._norm is None:
            return out
        shift, scale = (torch.from_numpy(t) for t in ts._norm) if ts._norm is not None else (None, None)
        k_rows = torch.from_numpy(keys[rows]) if keys is not None and shift is not None else None
        # Row blocks under torch's parallel grain: each op runs on this thread, inline.
        # (Whole-batch ops would wake torch's OpenMP pool, whose spinning threads cost
        # several times the work itself, on the cores the reader and the trainer use.)
        step = max(1, TORCH_GRAIN // ts.d_model)
        src = self.gather[: len(rows)]
        for i in range(0, len(rows), step):
            o = out[i : i + step]
            if not same:
                o.copy_(src[i : i + step])  # copy: dtype conversion
            if shift is not None:
                if k_rows is None:
                    o.sub_(shift[0]).mul_(scale[0])
                else:
                    k = k_rows[i : i + step]
                    o.sub_(shift[k]).mul_(scale[k])
        return out


def _plan_key(ts: TokenStream, plan: EpochPlan) -> tuple[int, int]:
    """What fixes an epoch's windows for one stream (whose store, layers, sizes and ranks
    never change): a window read ahead serves only the same seed and epoch."""
    return (ts.seed, plan.epoch)


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """The numpy array sharing `t`'s memory (bfloat16 as its uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _window_index(units: TokenUnits, w: WindowSlice) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(example, layer position, segment position, token row) of every row of window w."""
    n = (w.hi - w.lo).astype(np.int64)
    ex, li, si = units.decode(w.units)
    rep = lambda a: np.repeat(a, n)  # noqa: E731
    offs = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    tok = rep(w.lo.astype(np.int64)) + offs
    for i in range(len(w.units)):
        rows = units.kept_rows(int(ex[i]), int(si[i]))
        if rows is not None:
            d = int(w.dest[i])
            tok[d : d + n[i]] = rows[w.lo[i] : w.hi[i]]
    return rep(ex), rep(li), rep(si), tok


def _index_dict(acts: torch.Tensor, units: TokenUnits, index: tuple, rows: np.ndarray) -> dict[str, torch.Tensor]:
    ex, li, si, tok = (a[rows] for a in index)
    layers = np.asarray(units.layers, dtype=np.int64)
    return {
        "acts": acts,
        "example": torch.from_numpy(ex),
        "layer": torch.from_numpy(layers[li]),
        "segment": torch.from_numpy(si),
        "token": torch.from_numpy(tok),
    }
