"""The device side of a capture: each hooked output, as its module fires, becomes stored bytes.

On the model's device, on the forward thread, a `Stage` takes every hooked output (B, T, D)
of a batch and: gathers each segment's stored tokens (zero-padded to the segment's chunk
grid), casts them to the stored dtype (counting, clipping or refusing values beyond its
range), reduces them to the batch's statistics (actstore.capture.devstats), and copies them
once into a slot of a pool of host buffers (actstore.hostmem), laid out (L, b, T_pad, D) per
segment. What the writer thread needs comes out of `finish()` as a `Staged` batch.

On a CUDA device every step is a kernel on the model's stream except the copy, one
non-blocking device-to-host copy per (layer, batch) into pinned memory on a side stream
(actstore.hostmem.DeviceCopy), after which an event tells the writer thread the bytes have landed; nothing here waits for
the GPU. On a CPU the same steps write straight into the slot, and the statistics run on a
small pool of threads (one torch thread each) beside the forward pass. The CUDA-only lines
are marked `# CUDA`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.capture import devstats
from actstore.capture.segments import SegPlan, plan_segments
from actstore.errors import CaptureError
from actstore.hostmem import DeviceCopy, HostBuffer, Lent, SlotPool, Spare, carve_bytes
from actstore.inputs.prepare import CaptureBatch
from actstore.layout import spec
from actstore.layout.config import StoreConfig
from actstore.write.shardfiles import lent_bytes

_RANGE = {"float16": spec.FLOAT16_MAX, "bfloat16": 3.3895313892515355e38, "float32": float(np.finfo(np.float32).max)}
SPARE = Spare(4 * 2**30)  # slots kept for this process's next capture (allocating pinned memory is slow)
_WIDER = {"float16": ("bfloat16", "float32", "float64"), "bfloat16": ("float32", "float64"), "float32": ("float64",)}


@dataclass
class Staged:
    """One batch on its way to the writer thread: its slot's arrays, statistics and fields."""

    b: int
    segs: list[SegPlan]
    acts: dict[str, list[Any]]  # segment -> L tensors (b, T_pad, D): views of the slot, or hooked outputs
    batch: CaptureBatch
    source_dtype: str
    lent: Lent | None  # the slot, handed back to the pool once the writer is done with it
    event: Any = None  # CUDA: the copies have landed once it completes
    packed: Any = None  # CUDA: (K, W) float64 in the slot; CPU: K futures (or tensors)
    overflow_counts: Any = None  # per (layer, segment): ints (CPU) or in packed[:, 2] (CUDA)

    def wait(self) -> tuple[np.ndarray | None, dict[str, int]]:
        """(statistics (K, W) or None, overflowing values per segment), once available."""
        if self.event is not None:
            self.event.synchronize()  # CUDA
        rows = self.packed
        if isinstance(rows, list):
            rows = np.stack([(r.result() if isinstance(r, Future) else r).numpy() for r in rows])
        elif rows is not None:
            rows = rows.numpy()
        if rows is None:
            counts = self.overflow_counts
        elif rows.shape[1] == 1:  # CUDA without statistics: the counts alone
            counts, rows = rows[:, 0], None
        else:
            counts = rows[:, 2]
        names = [s.seg.name for s in self.segs]
        over = dict.fromkeys(names, 0)
        for k, n in enumerate(counts):
            over[names[k % len(names)]] += int(n)
        return rows, over

    def append_kwargs(self, texts: tuple[str, ...]) -> dict[str, Any]:
        """ShardWriter.append's arguments: the activations as each segment's list of layers,
        and the store's `texts` of the batch."""
        kw: dict[str, Any] = {s.seg.name: self.acts[s.seg.name] for s in self.segs}
        kw["sample_keys"] = self.batch.keys or None
        kw["texts"] = {name: self.batch.texts[name] for name in texts}
        if not self.segs[0].seg.fixed:
            kw["lengths"] = {s.seg.name: s.lengths for s in self.segs}
            kw["source_lengths"] = {s.seg.name: s.source_lengths for s in self.segs}
        if self.segs[0].labels is not None:
            kw["token_labels"] = {s.seg.name: s.labels for s in self.segs}
        if self.segs[0].token_ids is not None:
            kw["token_ids"] = {s.seg.name: s.token_ids for s in self.segs}
        return kw

    def release(self) -> None:
        """Give the slot back (once: the writer calls this when its rows are written)."""
        lent, self.lent = self.lent, None
        if lent is not None:
            lent.done()


class Stage:
    """The device side of a capture (see the module docstring).

    Args:
        job: what the shard holds (actstore.capture.sink.Job).
        device: the model's device.
        on_config: called with the StoreConfig made from the first output.

    A writer thread that fails wakes a wait for a free slot with its error (`ring.fail`).
    """

    def __init__(self, job: Any, device: Any, on_config: Callable[[StoreConfig], None]):
        import torch

        self.job, self.opts = job, job.opts
        self.device = device
        self.cuda = device.type == "cuda"
        self.dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[self.opts.dtype]
        self.on_config = on_config
        self.ring = SlotPool(self.opts.queue_size + 2, "pinned" if self.cuda else "plain", SPARE)
        self.copy = DeviceCopy(device)
        self.pool: ThreadPoolExecutor | None = None
        if not self.cuda and self.opts.stats:
            from actstore.capture.options import default_writer_threads

            self.pool = ThreadPoolExecutor(
                default_writer_threads(), "actstore-stats", initializer=_pool_thread, initargs=(self.opts.writer_nice,)
            )
        self.pos = {hp.layer: i for i, hp in enumerate(job.hooks)}
        self.cfg: StoreConfig | None = None
        self._cur: dict[str, Any] | None = None
        self._n = 0

    # ---- per batch -----------------------------------------------------------------
    def begin(self, batch: CaptureBatch) -> None:
        self.batch = batch
        self._cur = None
        self._n += 1

    def take(self, layer: int, out: Any) -> None:
        """A hooked output (B, T, D) of the current batch (called from the hook)."""
        if out.ndim != 3:
            raise CaptureError(f"recorded outputs must be (batch, tokens, d_model); got shape {tuple(out.shape)}")
        if self._cur is None:
            self._start(out)
        cur = self._cur
        if tuple(out.shape) != cur["shape"]:
            raise CaptureError(
                f"recorded outputs must all be (batch, tokens, d_model) of one shape; got {tuple(out.shape)} "
                f"beside {cur['shape']}"
            )
        lp = self.pos[layer]
        for si, sp in enumerate(cur["segs"]):
            k = lp * len(cur["segs"]) + si
            view = cur["views"][sp.seg.name][lp]
            if self._direct(out, sp, lp):  # CPU, already as stored: the output itself goes on
                y, n_over = out, 0
            else:
                y, n_over = self._fill(out, sp, view, self.job.hooks[lp].block)
            cur["acts"][sp.seg.name][lp] = view if self.cuda else y
            if self.cuda:  # CUDA: statistics on the device, the copy on the side stream
                if self.opts.stats:
                    cur["packed"][k] = devstats.moments(y, sp.keep, n_over)
                else:
                    cur["packed"][k] = n_over.reshape(1).double()
                self.copy.to_host(y, view)
            else:
                cur["over"][k] = n_over
                if self.pool is not None:
                    cur["packed"][k] = self.pool.submit(_moments, y, sp.keep, n_over)

    def finish(self) -> Staged:
        """The batch, for the writer thread (after its forward pass)."""
        import torch

        cur, self._cur = self._cur, None
        staged = Staged(
            b=cur["shape"][0],
            segs=cur["segs"],
            acts=cur["acts"],
            batch=self.batch,
            source_dtype=cur["src_dtype"],
            lent=_lend(self.ring, cur["slot"]),
            overflow_counts=cur["over"],
        )
        if self.cuda:  # CUDA: the statistics follow the activations; one event covers them all
            host = cur["stats_view"]
            self.copy.to_host(torch.stack(cur["packed"]), host)
            staged.event = self.copy.record()
            staged.packed = host
        elif self.pool is not None:
            staged.packed = cur["packed"]
        return staged

    def abort(self) -> None:
        if self._cur is not None:
            self.ring.give_back(self._cur["slot"])
            self._cur = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.copy.synchronize()  # CUDA: no copy into a slot is still under way
        self.ring.close()

    # ---- inside ------------------------------------------------------------------
    def _start(self, out: Any) -> None:
        """The batch's first hooked output: its plan and its slot (the store's config first)."""
        b, t, d = out.shape
        if self.cfg is None:
            self.cfg = self.job.config(b, t, d)
            if self.cfg.shard_examples:  # slots are lent until their shard files are written:
                # as many as the writer may hold lent (+1: a batch split over two files)
                batch_bytes = b * self.cfg.example_bytes()
                self.ring.n += -(-lent_bytes(self.cfg) // max(batch_bytes, 1)) + 1
            self.on_config(self.cfg)
        cfg = self.cfg
        segs = plan_segments(cfg, self.batch, b, t, self.job, self._n, self.device)
        L, n_seg = cfg.n_layers, len(cfg.segments)
        shapes = [((L, b, sp.t_pad, d), self.dtype) for sp in segs]
        if self.cuda:
            import torch

            shapes.append(((L * n_seg, devstats.width(d) if self.opts.stats else 1), torch.float64))
        slot = self.ring.take(carve_bytes([int(np.prod(s)) * d.itemsize for s, d in shapes]))
        views = slot.carve(shapes)
        self._cur = {
            "shape": (b, t, d),
            "segs": segs,
            "slot": slot,
            "views": {sp.seg.name: v for sp, v in zip(segs, views)},
            "acts": {sp.seg.name: [None] * L for sp in segs},
            "stats_view": views[-1] if self.cuda else None,
            "packed": [None] * (L * n_seg),
            "over": [0] * (L * n_seg),
            "src_dtype": str(out.dtype).removeprefix("torch."),
        }

    def _direct(self, out: Any, sp: SegPlan, lp: int) -> bool:
        """Whether a CPU output is stored as it is (no copy into the slot): a block's output
        (never changed in place afterwards) in the stored dtype, every token, no padding."""
        return (
            not self.cuda
            and self.job.hooks[lp].block
            and sp.idx is None
            and not sp.drop_first
            and out.dtype == self.dtype
            and out.shape[1] == sp.t_pad
            and out.is_contiguous()
        )

    def _fill(self, out: Any, sp: SegPlan, view: Any, block: bool) -> tuple[Any, Any]:
        """The segment's stored values (b, T_pad, D) and the count of values beyond the stored
        range (CPU: written into `view`, an int; CUDA: a new device tensor, a device scalar)."""
        import torch

        src = sp.source(out)  # (b, T_pad, D) in the model's dtype, or (b, T, D) of a fixed segment
        narrowing = str(src.dtype).removeprefix("torch.") in _WIDER[self.opts.dtype]  # values may overflow
        if not self.cuda:
            t = src.shape[1]
            view[:, :t].copy_(src)  # the one copy (and cast), into the slot
            if t < view.shape[1]:
                view[:, t:].zero_()
            if sp.valid is not None and not sp.all_valid:
                view.masked_fill_(~sp.valid[:, :, None], 0)
            n_over = 0
            if narrowing and _any_nonfinite(view):
                n_over = self._overflow(src, view[:, :t])
            return view, n_over
        y = src.to(self.dtype)  # CUDA: every step a kernel, nothing waits
        if self.opts.on_overflow == "clip" and narrowing:
            y = _clip(src, self.dtype, _RANGE[self.opts.dtype])
        n_over = (
            ((~torch.isfinite(src.to(self.dtype))) & torch.isfinite(src)).sum()
            if narrowing
            else src.new_zeros((), dtype=torch.long)
        )
        if y.shape[1] < view.shape[1]:
            y = torch.nn.functional.pad(y, (0, 0, 0, view.shape[1] - y.shape[1]))
        if sp.valid is not None and not sp.all_valid:
            y = y.masked_fill(~sp.valid[:, :, None], 0)
        if not block and y.data_ptr() == out.data_ptr():
            y = y.clone()  # an arbitrary module's output may be changed in place later
        return y, n_over

    def _overflow(self, src: Any, stored: Any) -> int:
        """CPU, rare: count finite values whose cast overflowed; clip them when asked."""
        import torch

        over = torch.isfinite(src) & ~torch.isfinite(stored)
        n = int(over.sum())
        if n and self.opts.on_overflow == "clip":
            stored.copy_(_clip(src, self.dtype, _RANGE[self.opts.dtype]))
        return n


def _any_nonfinite(x: Any) -> bool:
    """Whether a CPU tensor in a stored dtype holds an inf or NaN (16-bit: by exponent bits,
    two integer reductions; torch's isfinite on float16 is far slower)."""
    import torch

    from actstore.dtypes import count_nonfinite_16

    if x.dtype == torch.float32:
        a = x.numpy()
        return not (np.isfinite(a.max(initial=0)) and np.isfinite(a.min(initial=0)))
    bits = x.view(torch.int16).numpy().view(np.uint16 if x.dtype == torch.bfloat16 else np.float16)
    return count_nonfinite_16(bits) > 0


def _clip(src: Any, dtype: Any, hi: float) -> Any:
    """`src` cast to `dtype` with finite values saturated to +-hi (non-finite ones kept)."""
    import torch

    wide = src.to(torch.float64 if src.dtype == torch.float64 else torch.float32)  # (bfloat16 cannot hold 65504)
    return torch.where(torch.isfinite(wide), wide.clamp(-hi, hi), wide).to(dtype)


def _lend(pool: SlotPool, slot: HostBuffer) -> Lent:
    """The slot lent to the writer: back to the pool once every holder is done."""
    return Lent(lambda: pool.give_back(slot))


def _moments(y: Any, keep: Any, n_over: int) -> Any:
    import torch

    with torch.inference_mode():
        return devstats.moments(y, keep, n_over)


def _pool_thread(nice: int) -> None:
    """A statistics thread: one torch thread (no OpenMP team of its own), lowered priority."""
    import torch

    from actstore.capture.drain import lower_priority

    torch.set_num_threads(1)
    lower_priority(nice)
