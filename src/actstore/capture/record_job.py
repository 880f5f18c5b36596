"""The writer side of a record() run: turns captured tensors into ShardWriter appends.

`RecordJob` opens the shard (attrs describing the hooks and the image preprocessing), then,
on the writer thread (actstore.capture.drain), stacks the layers of each batch, gathers
the tokens of each segment, appends them and commits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actstore import catalog
from actstore.capture.hooks import HookPoint
from actstore.inputs.models import LoadedModel
from actstore.inputs.prepare import TOKEN_LABEL_MEANING, CaptureBatch
from actstore.errors import CaptureError
from actstore.layout import spec
from actstore.layout.config import default_t_chunk
from actstore.stats import stats_key
from actstore.storage import open_storage
from actstore.write import ShardWriter
from actstore.write.pipeline import IOStats

_NEVER = 2**62  # the writer never commits on its own: record() commits after stats are whole


# HF model_type -> the saev family name of the vision transformer.
_SAEV_FAMILIES = {
    "dinov2": "dinov2",
    "dinov3_vit": "dinov3",
    "clip": "clip",
    "clip_vision_model": "clip",
    "siglip": "siglip",
    "siglip_vision_model": "siglip",
}


@dataclass
class RecordJob:
    """The writer side of a record() run: turns captured tensors into ShardWriter appends."""

    store: Path | str  # a folder, or an object-store URL
    shard: int
    hooks: list[HookPoint]
    lm: LoadedModel
    dtype: str
    segments: dict[str, int] | None
    t_chunk: dict[str, int] | None
    token_labels: bool
    texts: tuple[str, ...]
    resume: bool
    model_id: str
    attrs: dict[str, Any]
    stats: bool
    on_overflow: str
    commit_bytes: int
    progress: Callable[[int, int, int], None] | None
    io_progress: Callable[[IOStats], None] | None = None
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT
    shard_examples: int | str | None = spec.SHARD_EXAMPLES_AUTO
    world_size: int | None = None
    token_ids: bool | None = None
    drop_cls: bool = False
    writer: ShardWriter | None = None
    n_before: int = 0
    n_written: int = 0
    tokens: int = 0
    nbytes: int = 0
    source_tokens: int = 0
    truncated_tokens: int = 0
    _since_commit: int = 0
    _buf: np.ndarray | None = None

    def open_writer(self, outs: dict[int, Any]) -> None:
        first = outs[self.hooks[0].layer]
        b, t, d = first.shape
        t -= int(self.drop_cls and self.segments is None)
        attrs = dict(self.attrs)
        attrs["hooks"] = {str(hp.layer): hp.path for hp in self.hooks}
        attrs["hook_names"] = {str(hp.layer): hp.name for hp in self.hooks}  # readers take these names as layers
        attrs["hook_kind"] = (
            "block output (residual stream)" if all(hp.block for hp in self.hooks) else "named hooks (hook_names)"
        )
        if self.token_labels:
            attrs["token_labels"] = TOKEN_LABEL_MEANING
        if self.lm.image is not None:
            im = self.lm.image
            grid = im.size // im.patch_size
            attrs["image"] = {
                "size": im.size,
                "patch_size": im.patch_size,
                "grid": [grid, grid],
                "prefix_tokens": t - grid * grid,
                "dropped": ["cls"] if self.drop_cls else [],
                "mean": list(im.mean),
                "std": list(im.std),
                "preprocess": "shorter side resized to size (bicubic), centre crop",
            }
            # What saev export needs (docs/export.md): token 0 is CLS when it is the only
            # prefix token (registers would make it ambiguous: left to --cls), and the family.
            if t - grid * grid in (0, 1):
                attrs.setdefault("cls_token", t - grid * grid == 1)
            family = _SAEV_FAMILIES.get(getattr(getattr(self.lm.model, "config", None), "model_type", None))
            if family is not None:
                attrs.setdefault("family", family)
        seg_kw = {"segments": self.segments} if self.segments else {"tokens": t}
        if self.t_chunk:  # never a chunk above the writer's default size (MAX_CHUNK_BYTES)
            item = np.dtype(spec.ACT_DTYPES[self.dtype]).itemsize
            seg_kw["t_chunk"] = {k: min(v, default_t_chunk(self.segments[k], d, item)) for k, v in self.t_chunk.items()}
        self.writer = ShardWriter(
            self.store,
            shard=self.shard,
            layers=[hp.layer for hp in self.hooks],
            d_model=d,
            dtype=self.dtype,
            **seg_kw,
            texts=self.texts,
            token_labels=self.token_labels,
            model_id=self.model_id,
            attrs=attrs,
            resume=self.resume,
            commit_bytes=_NEVER,
            on_overflow=self.on_overflow,
            stats=self.stats,
            zarr_format=self.zarr_format,
            shard_examples=self.shard_examples,
            world_size=self.world_size,
            token_ids=bool(self.token_ids),
        )
        self.n_before = self.writer.n_committed

    def writer_kwargs_from_store(self) -> dict[str, Any]:
        """ShardWriter arguments equal to the store's identity (to reopen a shard to close it):
        its StoreConfig, read back whole."""
        return {"config": catalog.read_identity(open_storage(self.store)), "stats": self.stats}

    def write(self, item: tuple[dict[int, Any], Any, CaptureBatch]) -> None:
        """Runs on the writer thread: stack layers, gather segments, append, commit."""
        outs, event, batch = item
        if event is not None:
            event.synchronize()  # the pinned host copies have landed
        w = self.writer
        arrs = [_numpy(outs[hp.layer]) for hp in self.hooks]  # (B, T, D) each, zero-copy on CPU
        b = arrs[0].shape[0]
        kw: dict[str, Any] = {"sample_keys": batch.keys if batch.keys else None}
        kw["texts"] = {name: batch.texts[name] for name in self.texts}
        cfg = w.cfg
        seg_x: dict[str, np.ndarray] = {}
        if self.segments is None:
            if self.drop_cls:
                arrs = [a[:, 1:] for a in arrs]  # token 0 (CLS) is not stored
            seg_x[cfg.segments[0].name] = self._stack(arrs)
            n_tok = b * arrs[0].shape[1]
            before = dict(w.overflow)
            if cfg.token_ids:
                kw["token_ids"] = _input_ids(batch)
            w.append(seg_x[cfg.segments[0].name], **kw)
        else:
            select = batch.select or _select_from_mask(batch, cfg)
            lengths, src, labels, ids = {}, {}, {}, {}
            all_ids = _input_ids(batch) if cfg.token_ids else None
            for seg in cfg.segments:
                sel = [s[: seg.t_max] for s in select[seg.name]]
                seg_x[seg.name] = _gather(arrs, sel)
                lengths[seg.name] = np.asarray([len(s) for s in sel], np.int32)
                src[seg.name] = (
                    batch.source_lengths[seg.name]
                    if batch.source_lengths
                    else np.asarray([len(s) for s in select[seg.name]])
                )
                if self.token_labels:
                    lab = np.zeros((b, seg_x[seg.name].shape[2]), np.uint8)
                    for j, l in enumerate(batch.labels[seg.name]):
                        lab[j, : lengths[seg.name][j]] = l[: seg.t_max]
                    labels[seg.name] = lab
                if all_ids is not None:
                    tid = np.zeros((b, seg_x[seg.name].shape[2]), np.int64)
                    for j, s in enumerate(sel):
                        tid[j, : len(s)] = all_ids[j, s]
                    ids[seg.name] = tid
            n_tok = int(sum(v.sum() for v in lengths.values()))
            for seg in cfg.segments:  # tokens of the source against tokens kept by the budget
                src_n = np.asarray(src[seg.name], np.int64)
                self.source_tokens += int(src_n.sum())
                self.truncated_tokens += int(np.clip(src_n - seg.t_max, 0, None).sum())
            before = dict(w.overflow)
            w.append(
                **seg_x, lengths=lengths, source_lengths=src, token_labels=labels or None, token_ids=ids or None, **kw
            )
        if w.stats is not None and w.overflow != before:
            self._count_overflow(seg_x)
        nbytes = b * cfg.example_bytes()
        self.n_written += b
        self.tokens += n_tok
        self.nbytes += nbytes
        self._since_commit += nbytes
        if self._since_commit >= self.commit_bytes:
            w.commit()
            self._since_commit = 0
        if self.io_progress is not None:
            io = w.io_stats()
            if io is not None:
                self.io_progress(io)
        if self.progress is not None:
            self.progress(b, n_tok, nbytes)

    def _stack(self, arrs: list[np.ndarray]) -> np.ndarray:
        """(B, L, T, D) from L arrays (B, T, D): the one copy, into a buffer kept between
        batches when the writer writes chunk files at once (no fresh pages each batch)."""
        shape = (arrs[0].shape[0], len(arrs), *arrs[0].shape[1:])
        dt = np.result_type(*arrs)
        buf = self._buf
        if buf is None or buf.shape != shape or buf.dtype != dt:
            buf = np.empty(shape, dt)
            if self.writer.engine == "direct":  # the zarr engine keeps appended arrays until commit
                self._buf = buf
        return np.stack(arrs, axis=1, out=buf)

    def _count_overflow(self, seg_x: dict[str, np.ndarray]) -> None:
        """Per-layer counts of values clipped to the stored dtype's range (rare path)."""
        hi = spec.FLOAT16_MAX if self.dtype == "float16" else float(np.finfo(np.float32).max)
        for name, x in seg_x.items():
            for lp, hp in enumerate(self.hooks):
                xl = x[:, lp]
                n = int(np.count_nonzero(np.isfinite(xl) & (np.abs(xl) > hi)))
                if n:
                    self.writer.stats.add_overflow(stats_key(hp.layer, name), n)


def _input_ids(batch: CaptureBatch) -> np.ndarray:
    ids = batch.inputs.get("input_ids")
    if ids is None:
        raise CaptureError(
            "this store keeps token ids, but the batch has no input_ids: pass input_ids (or record(token_ids=False))"
        )
    return ids.cpu().numpy() if hasattr(ids, "cpu") else np.asarray(ids)


def _numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype in (torch.float32, torch.float16):
        return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()
    return t.float().cpu().numpy()  # bfloat16 and others: widened (exact for bfloat16)


def _gather(arrs: list[np.ndarray], select: list[np.ndarray]) -> np.ndarray:
    """(B, L, T_b, D) of the selected token positions, zero-padded to the longest."""
    b, _, d = arrs[0].shape
    t_b = max((len(s) for s in select), default=0)
    out = np.zeros((b, len(arrs), t_b, d), dtype=arrs[0].dtype)
    for j, s in enumerate(select):
        n = len(s)
        if not n:
            continue
        idx: Any = slice(int(s[0]), int(s[0]) + n) if int(s[-1]) - int(s[0]) + 1 == n else s
        for lp, a in enumerate(arrs):
            out[j, lp, :n] = a[j, idx]
    return out


def _select_from_mask(batch: CaptureBatch, cfg: Any) -> dict[str, list[np.ndarray]]:
    mask = batch.inputs.get("attention_mask")
    if mask is None:
        raise CaptureError("a store with padded segments needs CaptureBatch.select or an attention_mask in each batch")
    if len(cfg.segments) != 1:
        raise CaptureError("several segments need CaptureBatch objects that say which tokens go where (select)")
    m = mask.detach().cpu().numpy()
    return {cfg.segments[0].name: [np.flatnonzero(row) for row in m]}
