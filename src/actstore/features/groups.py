"""The pass's reading: a layer's examples in store order, a group of a few at a time
(`read_many_into`, so an object store answers with batched range requests), read ahead
on a thread while the previous group is encoded, into a ring of reused buffers (memory
written before costs no page faults; on a CUDA device the buffers are pinned and copied
there asynchronously). With each group come its kept tokens (never padding; the tokens
the default mask leaves out unless `keep_special`) as rows of the group's buffer, and
their order keys `example << 31 | token` (token: the position in `store[example, layer]`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.dtypes import bf16_bits_to_f32
from actstore.errors import SegmentNotFoundError
from actstore.features.accum import TOKEN_BITS
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
    return {s.name: _Seg(s.name, -(-s.t_max // s.t_chunk) * s.t_chunk) for s in store.config.segments}


class GroupReader:
    """Iterate (examples, rows (N, d), kept rows, ords) over the layer, groups in store order.

    Args:
        store: the Reader.
        layer: a stored layer number.
        segments: segment names to read (None: all).
        keep_special: keep the tokens the default mask leaves out.
        device: a torch.device: the rows come as a tensor there (float16/bfloat16/float32
            as stored); None: a numpy array (bfloat16 converted to float32).
    """

    def __init__(
        self, store: Reader, layer: int, segments: Sequence[str] | str | None, keep_special: bool, device: Any = None
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
        self.ring = [_Buffer(self.group * self.t_all, self.d, store.dtype, device) for _ in range(RING)]

    def __iter__(self) -> Iterator[tuple[range, Any, np.ndarray, np.ndarray]]:
        n_ex = len(self.store)
        starts = range(0, n_ex, self.group)
        with ThreadPoolExecutor(1, thread_name_prefix="actstore-features-read") as reader:
            nxt = reader.submit(self._read, 0, 0) if n_ex else None
            for i, g0 in enumerate(starts):
                exs, rows, ords = nxt.result()
                # read ahead while this one is encoded (the kernels hold no GIL)
                nxt = reader.submit(self._read, g0 + self.group, i + 1) if g0 + self.group < n_ex else None
                yield exs, self.ring[i % RING].rows(len(exs) * self.t_all), rows, ords

    def _read(self, g0: int, i: int) -> tuple[range, np.ndarray, np.ndarray]:
        exs = range(g0, min(len(self.store), g0 + self.group))
        buf = self.ring[i % RING].host(len(exs) * self.t_all).reshape(len(exs), self.t_all, self.d)
        items = [
            (e, self.layer, s.name, buf[j, self.offs[si] : self.offs[si] + s.t_pad])
            for j, e in enumerate(exs)
            for si, s in enumerate(self.segs)
        ]
        self.store.read_many_into(items)
        return exs, *self._tokens(exs)  # on the read-ahead thread too

    def _tokens(self, exs: range) -> tuple[np.ndarray, np.ndarray]:
        """The kept tokens of a group: their rows in its buffer and their order keys (store
        order: by example, then segment, then position)."""
        e = np.arange(exs.start, exs.stop, dtype=np.int64)
        rows, ords = [], []
        for j, s in enumerate(self.segs):
            keep = self.arange[None, : s.t_pad] < self.lens[s.name][e][:, None]  # real tokens, never padding
            if self.masks[j] is not None:
                w = min(s.t_pad, self.masks[j].shape[1])
                keep[:, :w] &= self.masks[j][e, :w]
            r, c = np.nonzero(keep)
            rows.append(r * self.t_all + int(self.offs[j]) + c)
            ords.append((e[r] << TOKEN_BITS) + self.before[s.name][e[r]] + c)
        if len(self.segs) == 1:
            return rows[0], ords[0]
        order = np.argsort(np.concatenate(rows), kind="stable")  # buffer rows run in store order
        return np.concatenate(rows)[order], np.concatenate(ords)[order]


class _Buffer:
    """One group buffer, reused: a numpy array, or (for a torch device) a tensor pinned
    when the device is CUDA, copied there with non_blocking and reused only once that copy
    has completed (an event)."""

    def __init__(self, n_rows: int, d: int, kind: str, device: Any):
        self.device, self.kind, self.event = device, kind, None
        if device is None:
            self.buf = np.empty((n_rows, d), spec.ACT_DTYPES[kind])
            return
        import torch

        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[kind]
        self.tensor = torch.empty((n_rows, d), dtype=dtype, pin_memory=device.type == "cuda")
        bits = self.tensor.view(torch.int16) if kind == "bfloat16" else self.tensor
        self.buf = bits.numpy().view(np.uint16) if kind == "bfloat16" else bits.numpy()  # the reader's view

    def host(self, n_rows: int) -> np.ndarray:
        """The buffer's first n_rows for the reader (waits for an earlier copy out of it)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.buf[:n_rows]

    def rows(self, n_rows: int) -> Any:
        """The group's rows as the sink takes them: numpy (bfloat16 as float32), or on the device."""
        if self.device is None:
            flat = self.buf[:n_rows]
            return bf16_bits_to_f32(flat) if self.kind == "bfloat16" else flat
        t = self.tensor[:n_rows]
        if self.device.type == "cpu":
            return t
        import torch

        out = t.to(self.device, non_blocking=True)  # from pinned memory: an asynchronous copy
        self.event = torch.cuda.Event()
        self.event.record()
        return out
