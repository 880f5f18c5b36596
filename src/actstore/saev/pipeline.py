"""The export's data path: store chunks -> float32 shard files, at disk speed, in bounded memory.

Worker threads read chunks (store.read_into) and convert them to float32 into a small pool
of reusable buffers; the calling thread writes the buffers in order with plain sequential
writes; a closer thread pads (sparse), fsyncs and seals each finished shard file. Memory
is the buffer pool, whatever the store's size.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from actstore.layout import saevspec as P
from actstore.layout import spec
from actstore.read.store import ActStore
from actstore.saev.checksums import FileCrc
from actstore.saev.plan import ExportPlan
from actstore.storage.durable import write_all

READ_ONLY = 0o444
# float16 -> float32: numpy's cast runs at ~2 GB/s per core, torch's (F16C) at ~10 GB/s.
# torch's is used when torch is already imported (a capture or training process), or for
# exports of at least this many bytes, where its import (1-4 s here, on the critical
# path) pays off; both give the same (exact) values.
TORCH_HALF_MIN_BYTES = 16 * 2**30


class ShardPipeline:
    """Reads/converts work units on worker threads; writes them in order on the caller's thread.

    A work unit is a run of consecutive (example, layer) rows of one shard: every row is
    one (T, D) float32 block, contiguous in the output file.
    """

    def __init__(
        self,
        store: ActStore,
        plan: ExportPlan,
        out_dir: Path,
        *,
        workers: int,
        batch_bytes: int,
        fsync: bool,
        progress: bool,
    ):
        self.plan = plan
        self.fsync = fsync
        self.dir = out_dir
        self.workers = workers
        self.progress = progress
        g = plan.geometry
        self.row_shape = (g.tokens_per_example, g.d_model)
        row_bytes = g.tokens_per_example * g.d_model * P.ITEMSIZE
        self.rows_per_unit = max(1, int(batch_bytes) // row_bytes)
        if plan.offsets is not None:  # packed: a unit is whole exported examples (every layer)
            self.rows_per_unit = max(g.n_layers, self.rows_per_unit // g.n_layers * g.n_layers)
        self.store_path = store.path
        self._local = threading.local()
        self._stored = np.dtype(spec.ACT_DTYPES[plan.stored_dtype])
        self._d_model = g.d_model
        self._half = _half_converter(g.n_examples * g.example_nbytes) if plan.stored_dtype == "float16" else None
        self.checksums: dict[
            str, dict[str, int]
        ] = {}  # acts file -> size and crc32c (padding included), for the sidecar

    def units(self) -> list[tuple[int, int, int]]:
        """(shard, first row, end row) with rows counted within the shard, in file order."""
        g = self.plan.geometry
        out = []
        for s, n in enumerate(g.shard_counts()):
            rows = n * g.n_layers
            out += [(s, r, min(r + self.rows_per_unit, rows)) for r in range(0, rows, self.rows_per_unit)]
        return out

    def run(self) -> None:
        from actstore.progress import bar as progress_bar

        g = self.plan.geometry
        units = self.units()
        n_bufs = self.workers + 2
        free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(min(n_bufs, len(units))):
            free.put(np.empty((self.rows_per_unit, *self.row_shape), dtype=np.float32))
        pending: deque = deque()
        todo = iter(units)
        fd, shard, path, crc = -1, -1, self.dir, FileCrc()
        closing = []
        with (
            ThreadPoolExecutor(self.workers, thread_name_prefix="saev-read") as pool,
            ThreadPoolExecutor(1, thread_name_prefix="saev-close") as closer,
            progress_bar(
                total=g.n_examples * g.example_nbytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"export saev {self.plan.hash[:8]}",
                disable=not self.progress,
            ) as bar,
        ):
            try:

                def submit() -> None:
                    unit = next(todo, None)
                    if unit is not None:
                        buf = free.get()
                        pending.append((unit, buf, pool.submit(self._fill, unit, buf)))

                for _ in range(n_bufs):
                    submit()
                while pending:
                    (s, r0, r1), buf, fut = pending.popleft()
                    fut.result()
                    if s != shard:
                        if fd >= 0:
                            closing.append(closer.submit(_seal, fd, g.shard_nbytes, self.fsync, path))
                            self._sum(path, crc)
                        path = self.dir / P.SHARD_NAME_FORMAT.format(s)
                        fd, shard, crc = _create(path), s, FileCrc()
                    with _naming(path):
                        write_all(fd, (buf[: r1 - r0],))
                    crc.update(buf[: r1 - r0])
                    bar.update((r1 - r0) * buf[0].nbytes)
                    free.put(buf)
                    submit()
                if fd >= 0:
                    closing.append(closer.submit(_seal, fd, g.shard_nbytes, self.fsync, path))
                    self._sum(path, crc)
                    fd = -1
                for c in closing:
                    c.result()
            except BaseException:
                for _, _, f in pending:
                    f.cancel()
                if fd >= 0:
                    os.close(fd)
                raise

    def _sum(self, path: Path, crc: FileCrc) -> None:
        crc.pad_to(self.plan.geometry.shard_nbytes)  # the zero padding _seal leaves (a sparse hole)
        self.checksums[path.name] = crc.record()

    def _reader(self) -> tuple[Any, dict[str, np.ndarray]]:
        """This thread's own ActStore (its caches are not shared) and scratch buffers."""
        loc = self._local
        if not hasattr(loc, "store"):  # (a thread-local, not a store)
            loc.store = ActStore(self.store_path)
            loc.scratch = {
                p.segment: np.empty((self.rows_per_unit, p.n_pad, self._d_model), dtype=self._stored)
                for p in self.plan.parts
            }
        return loc.store, loc.scratch

    def _fill(self, unit: tuple[int, int, int], buf: np.ndarray) -> None:
        """Fill buf[:rows] with float32 rows of one work unit (runs on a worker thread)."""
        if self.plan.offsets is not None:
            return self._fill_packed(unit, buf)
        store, scratch = self._reader()
        plan = self.plan
        g = plan.geometry
        L = g.n_layers
        s, r0, r1 = unit
        base = s * g.examples_per_shard * L + r0  # global row of the unit's first row
        rows = r1 - r0
        out = buf[:rows]
        lens = np.empty(rows, dtype=np.int64)
        for part in plan.parts:
            dst = out[:, part.dst : part.dst + part.count]
            direct = plan.stored_dtype == "float32" and part.skip == 0 and part.n_pad == part.count
            sc = scratch[part.segment]
            for j in range(rows):
                ex, lp = divmod(base + j, L)
                target = dst[j] if direct else sc[j]
                lens[j] = store.read_into(ex, plan.layers[lp], part.segment, target)
            if not direct:
                src = sc[:rows, part.skip : part.skip + part.count]
                if plan.stored_dtype == "bfloat16":
                    bits = dst.view(np.uint32)
                    bits[...] = src  # widen the 16 stored bits, then move them to the top half
                    bits <<= np.uint32(16)
                elif self._half is not None:
                    self._half(dst, src)
                else:
                    dst[...] = src  # the float16 -> float32 (or float32 copy) conversion
            if not part.fixed:
                short = np.flatnonzero(lens < part.skip + part.count)
                for j in short:  # tokens past a segment's length do not exist: zeros
                    dst[j, max(int(lens[j]) - part.skip, 0) :] = 0

    def _fill_packed(self, unit: tuple[int, int, int], buf: np.ndarray) -> None:
        """Fill buf with exported examples [a, b) of a packed export: the real tokens
        [a*T, b*T) of the stream, read example by example (each segment once per layer)."""
        store, scratch = self._reader()
        plan, offsets = self.plan, self.plan.offsets
        g = plan.geometry
        L, T = g.n_layers, g.tokens_per_example
        s, r0, r1 = unit
        a = s * g.examples_per_shard + r0 // L
        b = a + (r1 - r0) // L
        lo, hi = a * T, b * T
        out = buf[: r1 - r0]
        ex = int(np.searchsorted(offsets, lo, side="right")) - 1
        while ex < len(offsets) - 1 and offsets[ex] < hi:
            first = int(offsets[ex])  # stream index of this example's first real token
            for lp, layer in enumerate(plan.layers):
                k = first
                for part in plan.parts:
                    sc = scratch[part.segment][0]
                    rows_read = plan.rows(part, ex, store.read_into(ex, layer, part.segment, sc))
                    n = len(rows_read)
                    t0, t1 = max(k, lo), min(k + n, hi)  # the part's tokens inside this unit
                    if t1 > t0:
                        src = sc[rows_read[t0 - k : t1 - k]]  # a copy (fancy index) of the exported rows
                        idx = np.arange(t0, t1) - lo
                        rows, pos = (idx // T) * L + lp, idx % T
                        if plan.stored_dtype == "bfloat16":
                            out[rows, pos] = (src.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
                        else:
                            out[rows, pos] = src
                    k += n
            ex += 1


def _half_converter(nbytes: int):
    """torch's float16 -> float32 copy when worth it and available, else None (numpy)."""
    if "torch" not in sys.modules and nbytes < TORCH_HALF_MIN_BYTES:
        return None
    try:
        import torch
    except ImportError:
        return None

    def convert(dst: np.ndarray, src: np.ndarray) -> None:
        torch.from_numpy(dst).copy_(torch.from_numpy(src))

    return convert


def _create(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


@contextlib.contextmanager
def _naming(path: Path | None) -> Iterator[None]:
    """An OSError inside names `path` (os.write's and os.fsync's name no file)."""
    try:
        yield
    except OSError as e:
        e.filename = e.filename or (str(path) if path else None)
        raise


def _seal(fd: int, size: int, fsync: bool, path: Path | None = None) -> None:
    """Pad a shard file to full size (a sparse hole), flush it and make it read-only."""
    try:
        with _naming(path):
            os.ftruncate(fd, size)
            if fsync:
                os.fsync(fd)
            os.fchmod(fd, READ_ONLY)
    finally:
        os.close(fd)


def write_small(path: Path, data: bytes, fsync: bool) -> None:
    fd = _create(path)
    try:
        with _naming(path):
            write_all(fd, (data,))
            if fsync:
                os.fsync(fd)
        os.fchmod(fd, READ_ONLY)
    finally:
        os.close(fd)


def write_labels(store: ActStore, plan: ExportPlan, path: Path, fsync: bool) -> None:
    """labels.bin: uint8 (n_examples, content tokens), CLS excluded, zeros past a segment's length
    (a packed export: the labels of its real tokens, in the same stream order)."""
    if plan.offsets is not None:
        g = plan.geometry
        per_part = []
        for part in plan.parts:
            lab = np.asarray(store.field(part.segment + spec.TOKEN_LABELS_SUFFIX))
            lens = (
                np.full(len(lab), part.count + part.skip)
                if part.fixed
                else np.asarray(store.field(part.segment + spec.LEN_SUFFIX))
            )
            per_part.append((part, lab, lens))
        stream = np.concatenate(
            [lab[e, plan.rows(part, e, int(lens[e]))] for e in range(len(store)) for part, lab, lens in per_part]
        )
        _write_labels(stream[: g.n_examples * g.tokens_per_example].astype(np.uint8), path, fsync)
        return
    cols = []
    for part in plan.parts:
        lab = np.asarray(store.field(part.segment + spec.TOKEN_LABELS_SUFFIX))[:, part.skip : part.skip + part.count]
        if not part.fixed:
            lens = np.asarray(store.field(part.segment + spec.LEN_SUFFIX)) - part.skip
            lab = np.where(np.arange(part.count)[None, :] < lens[:, None], lab, 0)
        cols.append(lab.astype(np.uint8))
    labels = np.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]
    if plan.cls == "keep":
        labels = labels[:, 1:]  # labels.bin covers content tokens only
    _write_labels(labels, path, fsync)


def _write_labels(labels: np.ndarray, path: Path, fsync: bool) -> None:
    fd = _create(path)
    try:
        with _naming(path):
            write_all(fd, (np.ascontiguousarray(labels),))
            if fsync:
                os.fsync(fd)
        os.fchmod(fd, READ_ONLY)
    finally:
        os.close(fd)
