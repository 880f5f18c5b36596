"""The pass's reading: a layer's examples in store order, a group of a few at a time,
made ready on a thread while the previous group is encoded. With each group come its kept
tokens (never padding; the tokens the default mask leaves out unless `keep_special`) as
rows of an array, and their order keys `example << 31 | token` (token: the position in
`store[example, layer]`).

- Mapped (a local store of raw chunks, float16 or float32, the pass on the host): the
  files of the group's units are mapped into one reserved range (storage.mapping's
  FileRegion, as TokenStream maps them) and their pages made resident
  (MADV_POPULATE_READ); the rows are the page cache's own, so the compiled update reads
  the stored rows in place and nothing is copied (populating costs about a fifth of
  copying the same bytes on the benchmark's VM).
- Read (object stores, bfloat16, the torch update): `read_many_into` (an object store
  answers with batched range requests) into a ring of reused buffers (memory written
  before costs no page faults; for a CUDA device the buffers are pinned and copied there
  by actstore.hostmem's DeviceCopy: on a side stream, so that the next group's copy
  overlaps this one's encoding, and handed over to the consumer's stream before it sees it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.dtypes import bf16_bits_to_f32
from actstore.errors import SegmentNotFoundError
from actstore.features.topk.accum import TOKEN_BITS
from actstore.hostmem import DONE, DeviceCopy, HostBuffer, hand_over
from actstore.layout import spec
from actstore.read.api import Reader
from actstore.read.masks import leaves_out_special

READ_BYTES = 16 << 20  # activations read per group of examples (bounds the read buffers)
RING = 3  # group buffers: one being encoded, one being read, one spare


@dataclass(frozen=True)
class _Seg:
    name: str
    t_pad: int  # rows read_into fills: whole chunks


def _geometry(store: Reader) -> dict[str, _Seg]:
    return {s.name: _Seg(s.name, s.t_pad) for s in store.config.segments}


class GroupReader:
    """Iterate (examples, rows (N, d), kept rows, ords) over the layer, groups in store order.

    Args:
        store: the Reader.
        layer: a stored layer number.
        segments: segment names to read (None: all).
        keep_special: keep the tokens the default mask leaves out.
        device: a torch.device: the rows come as a tensor there (float16/bfloat16/float32
            as stored); None: a numpy array (bfloat16 converted to float32).
        mmap: map the store's files when they can be (the host pass); False always reads.
    """

    def __init__(
        self,
        store: Reader,
        layer: int,
        segments: Sequence[str] | str | None,
        keep_special: bool,
        device: Any = None,
        mmap: bool = True,
    ):
        all_geo = _geometry(store)
        names = [segments] if isinstance(segments, str) else list(segments or all_geo)
        unknown = [x for x in names if x not in all_geo]
        if unknown or not names:
            raise SegmentNotFoundError(
                f"segments {unknown or names} are not in this store; it has segments {list(all_geo)}"
            )
        self.store, self.layer, self.device = store, layer, device
        self.segs = [g for x, g in all_geo.items() if x in names]  # store order: order keys increase along the pass
        # the loaders' "content" mask: keep token label 0 (text stores with labels), unless keep_special
        use_mask = leaves_out_special(store) and not keep_special
        self.masks = [
            np.asarray(store.field(s.name + spec.TOKEN_LABELS_SUFFIX)) == 0 if use_mask else None for s in self.segs
        ]
        lens = {name: np.asarray(store.field(name + spec.LEN_SUFFIX), np.int64) for name in all_geo}
        order = list(all_geo)
        zeros = np.zeros(len(store), np.int64)
        self.before = {  # token offset of each segment in store[example, layer]
            s.name: sum((lens[o] for o in order[: order.index(s.name)]), zeros) for s in self.segs
        }
        self.lens = lens
        self.dtype = np.dtype(spec.ACT_DTYPES[store.dtype])  # bfloat16: its bits (uint16)
        self.d = int(store.d_model)
        self.offs = np.cumsum([0] + [s.t_pad for s in self.segs])  # each segment's rows within an example's block
        self.t_all = int(self.offs[-1])
        self.group = max(1, READ_BYTES // max(1, self.t_all * self.d * self.dtype.itemsize))
        self.arange = np.arange(max((s.t_pad for s in self.segs), default=0), dtype=np.int64)
        on_device = device is not None and device.type != "cpu"
        self.copy = DeviceCopy(device) if on_device else None  # the groups' copies to the device
        self.ring = [_Buffer(self.group * self.t_all, self.d, store.dtype, device, self.copy) for _ in range(RING)]
        self.region = _region(store, self.segs, self.d * self.dtype.itemsize) if mmap and device is None else None

    def __iter__(self) -> Iterator[tuple[range, Any, np.ndarray, np.ndarray]]:
        n_ex = len(self.store)
        starts = range(0, n_ex, self.group)
        with ThreadPoolExecutor(1, thread_name_prefix="actstore-features-read") as reader:
            nxt = reader.submit(self._read, 0, 0) if n_ex else None
            try:
                for i, g0 in enumerate(starts):
                    exs, flat, rows, ords, pins, ready = nxt.result()
                    hand_over([flat], ready)  # a device group: safe for this thread's stream
                    # ready the next group while this one is encoded (the kernels hold no GIL)
                    nxt = reader.submit(self._read, g0 + self.group, i + 1) if g0 + self.group < n_ex else None
                    try:
                        yield exs, flat, rows, ords
                    finally:
                        if pins:
                            self.region.unpin(pins)
            finally:
                if nxt is not None and not nxt.cancel():
                    got = nxt.exception() or nxt.result()
                    if not isinstance(got, BaseException) and got[4]:
                        self.region.unpin(got[4])
                if self.region is not None:
                    self.region.close()

    def _read(self, g0: int, i: int) -> tuple[range, Any, np.ndarray, np.ndarray, list[int], Any]:
        exs = range(g0, min(len(self.store), g0 + self.group))
        if self.region is not None:
            mapped = self._map(exs)
            if mapped is not None:
                return mapped
        ring = self.ring[i % RING]
        buf = ring.host(len(exs) * self.t_all).reshape(len(exs), self.t_all, self.d)
        items = [
            (e, self.layer, s.name, buf[j, self.offs[si] : self.offs[si] + s.t_pad])
            for j, e in enumerate(exs)
            for si, s in enumerate(self.segs)
        ]
        self.store.read_many_into(items)
        rows, ords = self._tokens(exs)
        flat, ready = ring.rows(len(exs) * self.t_all)
        return exs, flat, rows, ords, [], ready

    def _map(self, exs: range) -> tuple[range, Any, np.ndarray, np.ndarray, list[int], Any] | None:
        """The group mapped: its units' files pinned in the region and made resident; the
        kept tokens' rows are region rows. None (nothing pinned) when a unit cannot be mapped."""
        region = self.region
        pins: list[int] = []
        starts = []  # per segment: (examples, chunks) region row of each token chunk
        spans: dict[int, list[int]] = {}  # per file slot: the byte span the group reads
        try:
            for s in self.segs:
                seg = self.store.config.segment(s.name)
                st = np.empty((len(exs), seg.n_chunks), np.int64)
                for j, e in enumerate(exs):
                    chunks = self.store.map_unit(region, e, self.layer, s.name)
                    if chunks is None:
                        region.unpin(pins)
                        return None
                    for c in chunks:
                        pins.append(c.slot)
                        span = spans.setdefault(c.slot, [c.offset, c.offset + c.nbytes])
                        span[0], span[1] = min(span[0], c.offset), max(span[1], c.offset + c.nbytes)
                    st[j] = [c.row for c in chunks]
                starts.append((st, seg.t_chunk))
            # one populate per file (a group's units of one shard file are neighbours in it)
            for slot, offset, nbytes in region.to_populate([(k, a, b - a) for k, (a, b) in spans.items()]):
                region.populate(slot, offset, nbytes)
        except BaseException:
            region.unpin(pins)
            raise
        rows, ords = self._tokens(exs, starts)
        return exs, self.flat, rows, ords, pins, DONE

    def _tokens(self, exs: range, mapped: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The kept tokens of a group: their rows in its buffer (or, `mapped` (per segment the
        region row of each token chunk, t_chunk), in the region) and their order keys
        (store order: by example, then segment, then position)."""
        e = np.arange(exs.start, exs.stop, dtype=np.int64)
        rows, ords = [], []
        for j, s in enumerate(self.segs):
            keep = self.arange[None, : s.t_pad] < self.lens[s.name][e][:, None]  # real tokens, never padding
            if self.masks[j] is not None:
                w = min(s.t_pad, self.masks[j].shape[1])
                keep[:, :w] &= self.masks[j][e, :w]
            r, c = np.nonzero(keep)
            if mapped is None:
                rows.append(r * self.t_all + int(self.offs[j]) + c)
            else:
                st, t_chunk = mapped[j]
                rows.append(st[r, c // t_chunk] + c % t_chunk)
            ords.append((e[r] << TOKEN_BITS) + self.before[s.name][e[r]] + c)
        if len(self.segs) == 1:
            return rows[0], ords[0]
        ords_all = np.concatenate(ords)
        order = np.argsort(ords_all, kind="stable")  # store order: by example, then segment, then position
        return np.concatenate(rows)[order], ords_all[order]

    @property
    def flat(self) -> np.ndarray:
        """The region's rows as an (R, d) array of the stored dtype (only mapped rows are read)."""
        return self.region.rows.view(self.dtype).reshape(-1, self.d)


def _region(store: Reader, segs: list[_Seg], row_bytes: int) -> Any:
    """A FileRegion for the store's files, or None when they cannot be mapped (another
    storage, bfloat16 (converted as read), zarr-python's codecs, no address space)."""
    if store.dtype == "bfloat16" or not hasattr(store, "mappable_files"):
        return None
    from actstore.storage.mapping import FileRegion

    if not FileRegion.supported():
        return None
    files = store.mappable_files([s.name for s in segs])
    if files is None:
        return None
    try:
        return FileRegion(row_bytes, files[1], files[0])
    except OSError:
        return None  # no address space to reserve (ulimit -v): read instead


class _Buffer:
    """One group buffer, reused: a numpy array, or (for a torch device) a tensor, pinned
    when the device is CUDA, copied there by the reader's DeviceCopy and reused only once
    that copy has completed (its event)."""

    def __init__(self, n_rows: int, d: int, kind: str, device: Any, copy: DeviceCopy | None):
        self.device, self.kind, self.copy, self.event = device, kind, copy, None
        if device is None:
            self.buf = np.empty((n_rows, d), spec.ACT_DTYPES[kind])
            return
        import torch

        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[kind]
        host = HostBuffer(n_rows * d * dtype.itemsize, "pinned" if copy is not None else "plain")
        (self.tensor,) = host.carve([((n_rows, d), dtype)])
        bits = self.tensor.view(torch.int16) if kind == "bfloat16" else self.tensor
        self.buf = bits.numpy().view(np.uint16) if kind == "bfloat16" else bits.numpy()  # the reader's view

    def host(self, n_rows: int) -> np.ndarray:
        """The buffer's first n_rows for the reader (waits for an earlier copy out of it)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.buf[:n_rows]

    def rows(self, n_rows: int) -> tuple[Any, Any]:
        """(the group's rows as the consumer takes them: numpy (bfloat16 as float32), or
        on the device; the event after their copy there, DONE when there was none)."""
        if self.device is None:
            flat = self.buf[:n_rows]
            return (bf16_bits_to_f32(flat) if self.kind == "bfloat16" else flat), DONE
        t = self.tensor[:n_rows]
        if self.copy is None:
            return t, DONE  # a CPU torch device: the buffer itself
        (out,), self.event = self.copy.to_device([t])  # from pinned memory: an asynchronous copy
        return out, self.event
