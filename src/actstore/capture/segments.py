"""Which of a batch's token positions each segment stores: the plan the device side gathers by.

For a fixed segment every token is stored (less a dropped CLS); for a zero-padded segment
the batch says which positions go where (CaptureBatch.select, else its attention_mask,
else every token), cut to the segment's budget. Per segment the plan holds the gather
index and validity (b, T_pad) on the model's device, the statistics' mask (real tokens;
of those only content, label 0, when the capture stores token kinds), and the per-example
fields the writer stores (lengths, source lengths, labels, token ids) on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.errors import CaptureError
from actstore.inputs.prepare import CaptureBatch
from actstore.layout.config import SegmentSpec, StoreConfig


@dataclass
class SegPlan:
    """One segment of one batch."""

    seg: SegmentSpec
    t_pad: int  # the chunk grid's tokens: what the writer stores per example
    lengths: np.ndarray  # (b,) int32
    drop_first: bool = False  # fixed segment: token 0 (a ViT's CLS) not stored
    idx: Any = None  # (b, T_pad) int64 positions on the device; None: a fixed segment
    valid: Any = None  # (b, T_pad) bool on the device
    all_valid: bool = True
    keep: Any = None  # (b, T_pad) bool on the device: the vectors statistics count (None: all)
    source_lengths: np.ndarray | None = None
    labels: np.ndarray | None = None  # (b, t_max) uint8
    token_ids: np.ndarray | None = None  # (b, t_max) int64

    def source(self, out: Any) -> Any:
        """The segment's values of a hooked output (B, T, D), in the model's dtype."""
        import torch

        if self.idx is None:
            return out[:, 1:] if self.drop_first else out
        return torch.gather(out, 1, self.idx[:, :, None].expand(-1, -1, out.shape[2]))


def plan_segments(
    cfg: StoreConfig, batch: CaptureBatch, b: int, t: int, job: Any, n: int, device: Any
) -> list[SegPlan]:
    """The plans of every segment of batch number `n` (1-based, for messages) of b examples of t tokens."""
    ids = _input_ids(batch) if cfg.token_ids else None
    if cfg.segments[0].fixed:
        seg = cfg.segments[0]
        drop = job.opts.drop_cls
        if t - drop != seg.t_max:
            raise CaptureError(_length_fix(n, t - drop, seg.t_max))
        return [
            SegPlan(
                seg=seg,
                t_pad=seg.t_pad,
                lengths=np.full(b, seg.t_max, np.int32),
                drop_first=drop,
                token_ids=ids[:, int(drop) :] if ids is not None else None,
            )
        ]
    import torch

    select = batch.select or _select_from_mask(batch, cfg, b, t)
    plans = []
    for seg in cfg.segments:
        t_pad = seg.t_pad
        sel = [np.asarray(s[: seg.t_max], np.int64) for s in select[seg.name]]
        lengths = np.asarray([len(s) for s in sel], np.int32)
        idx = np.zeros((b, t_pad), np.int64)
        valid = np.arange(t_pad)[None, :] < lengths[:, None]
        for j, s in enumerate(sel):
            idx[j, : len(s)] = s
        labels = None
        if job.contents.token_labels:
            labels = np.zeros((b, seg.t_max), np.uint8)
            for j, lab in enumerate(batch.labels[seg.name]):
                labels[j, : lengths[j]] = lab[: seg.t_max]
        keep = valid.copy()
        if labels is not None:  # the capture's labels are token kinds: statistics count content only
            keep[:, : seg.t_max] &= labels == 0
        tid = None
        if ids is not None:
            tid = np.zeros((b, seg.t_max), np.int64)
            for j, s in enumerate(sel):
                tid[j, : len(s)] = ids[j, s]
        src = batch.source_lengths[seg.name] if batch.source_lengths else [len(s) for s in select[seg.name]]
        plans.append(
            SegPlan(
                seg=seg,
                t_pad=t_pad,
                lengths=lengths,
                idx=torch.from_numpy(idx).to(device),
                valid=torch.from_numpy(valid).to(device),
                all_valid=bool(valid.all()),
                keep=None if keep.all() else torch.from_numpy(keep).to(device),
                source_lengths=np.asarray(src, np.int64),
                labels=labels,
                token_ids=tid,
            )
        )
    return plans


def _length_fix(n: int, t: int, t_max: int) -> str:
    return (
        f"batch {n} holds {t} tokens per example but the store keeps {t_max} (the first batch's length): "
        "plain token batches are stored as one fixed-length segment. For batches of varying length pass "
        "segments={'tokens': T_MAX} with an attention_mask in each batch (its 1s mark the real tokens; without "
        "one every token is real): each example is then stored with its own length, zero-padded to T_MAX"
    )


def check_lengths(batches: Any, drop_cls: bool) -> None:
    """Before anything is written: plain token batches (a list) must all have one length."""
    seen: dict[int, int] = {}
    for n, raw in enumerate(batches, 1):
        ids = raw.get("input_ids") if isinstance(raw, dict) else raw
        if hasattr(ids, "is_floating_point") and not ids.is_floating_point() and ids.ndim == 2:
            seen.setdefault(int(ids.shape[1]), n)
    if len(seen) > 1:
        (t0, _), (t1, n1) = sorted(seen.items(), key=lambda kv: kv[1])[:2]
        raise CaptureError(_length_fix(n1, t1 - drop_cls, t0 - drop_cls) + " (nothing was written)")


def _input_ids(batch: CaptureBatch) -> np.ndarray:
    ids = batch.inputs.get("input_ids")
    if ids is None:
        raise CaptureError(
            "this store keeps token ids, but the batch has no input_ids: pass input_ids (or record(token_ids=False))"
        )
    return ids.cpu().numpy() if hasattr(ids, "cpu") else np.asarray(ids)


def _select_from_mask(batch: CaptureBatch, cfg: StoreConfig, b: int, t: int) -> dict[str, list[np.ndarray]]:
    if len(cfg.segments) != 1:
        raise CaptureError("several segments need CaptureBatch objects that say which tokens go where (select)")
    mask = batch.inputs.get("attention_mask")
    if mask is None:  # every token is real: each example stored with all its tokens (cut to the budget)
        return {cfg.segments[0].name: [np.arange(t) for _ in range(b)]}
    m = mask.detach().cpu().numpy()
    return {cfg.segments[0].name: [np.flatnonzero(row) for row in m]}
