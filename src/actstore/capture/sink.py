"""The writer side of a capture: what one record() call writes, and its writer thread.

`Job` says what the shard holds (layers, segments, texts, labels, metadata) and makes its
StoreConfig from the first captured output. `Sink` runs on the writer thread (a Drain,
actstore.capture.drain): it opens the ShardWriter, then appends each staged batch (the
ring slot's arrays with their statistics, clipped-value counts and per-token fields,
actstore.capture.stage); the ShardWriter commits every `commit_bytes` on its own, where a
Zarr shard file fills (nothing written twice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.capture.devstats import running_stats
from actstore.capture.hooks import HookPoint
from actstore.capture.options import CaptureOptions
from actstore.capture.target import CaptureTarget
from actstore.errors import CaptureError
from actstore.inputs.models import LoadedModel
from actstore.inputs.prepare import FIRST_MEANING, TOKEN_LABEL_MEANING
from actstore.layout import spec
from actstore.layout.config import StoreConfig, default_t_chunk, make_config
from actstore.stats import stats_key
from actstore.write import ShardWriter
from actstore.write.batch import overflow_error
from actstore.write.pipeline import IOStats

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
class Job:
    """What one record() call writes into its shard."""

    target: CaptureTarget
    shard: int
    hooks: list[HookPoint]
    lm: LoadedModel
    opts: CaptureOptions
    segments: dict[str, int] | None = None  # None: one fixed segment of every token
    t_chunk: dict[str, int] | None = None
    token_labels: bool | Mapping[int, str] = False  # True: spec.TOKEN_KIND_NAMES; a mapping: these kinds
    texts: tuple[str, ...] = ()
    model_id: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    token_ids: bool = False  # decided from the first batch (actstore.capture.loop)

    @property
    def kind_names(self) -> dict[int, str] | None:
        """The token kinds the labels mean (None: no labels)."""
        if isinstance(self.token_labels, Mapping):
            return dict(self.token_labels)
        return dict(spec.TOKEN_KIND_NAMES) if self.token_labels else None

    def config(self, b: int, t: int, d: int) -> StoreConfig:
        """The store's configuration for outputs of (b, t, d) (t counted before a dropped CLS)."""
        t -= int(self.opts.drop_cls and self.segments is None)
        seg_kw: dict[str, Any] = {"segments": self.segments} if self.segments else {"tokens": t}
        if self.t_chunk:  # never a chunk above the writer's default size (MAX_CHUNK_BYTES)
            item = np.dtype(spec.ACT_DTYPES[self.opts.dtype]).itemsize
            seg_kw["t_chunk"] = {k: min(v, default_t_chunk(self.segments[k], d, item)) for k, v in self.t_chunk.items()}
        # The capture's labels are token kinds: the store says so (StoreConfig.token_label_names,
        # where the layout has it; the attrs' `token_labels` mark capture-made stores either way).
        names = self.kind_names
        if names is not None:
            seg_kw["token_label_names"] = names
        return make_config(
            layers=[hp.layer for hp in self.hooks],
            d_model=d,
            dtype=self.opts.dtype,
            **seg_kw,
            zarr_format=self.opts.zarr_format,
            shard_examples=self.opts.shard_examples,
            texts=self.texts,
            token_labels=self.token_labels,
            token_ids=self.token_ids,
            model_id=self.model_id,
            attrs=self._attrs(t),
        )

    def _attrs(self, t: int) -> dict[str, Any]:
        attrs = dict(self.attrs)
        attrs["hooks"] = {str(hp.layer): hp.path for hp in self.hooks}
        attrs["hook_names"] = {str(hp.layer): hp.name for hp in self.hooks}  # readers take these names as layers
        attrs["hook_kind"] = (
            "block output (residual stream)" if all(hp.block for hp in self.hooks) else "named hooks (hook_names)"
        )
        if self.token_labels:
            extra = FIRST_MEANING if spec.FIRST_LABEL in (self.kind_names or {}) else {}
            attrs["token_labels"] = {**TOKEN_LABEL_MEANING, **extra}
        im = self.lm.image
        if im is not None:
            grid = im.size // im.patch_size
            attrs["image"] = {
                "size": im.size,
                "patch_size": im.patch_size,
                "grid": [grid, grid],
                "prefix_tokens": t - grid * grid,
                "dropped": ["cls"] if self.opts.drop_cls else [],
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
        return attrs

    def writer(self, cfg: StoreConfig) -> ShardWriter:
        opts = self.opts.writer_options(self.opts.world_size)
        return ShardWriter(self.target.root, shard=self.shard, config=cfg, options=opts)


@dataclass
class Sink:
    """The writer thread's work: open the shard, append staged batches, commit."""

    job: Job
    progress: Callable[[int, int, int], None] | None = None
    io_progress: Callable[[IOStats], None] | None = None
    writer: ShardWriter | None = None
    n_before: int = 0
    n_written: int = 0
    tokens: int = 0
    nbytes: int = 0
    source_tokens: int = 0
    truncated_tokens: int = 0

    def open(self, cfg: StoreConfig) -> None:
        self.writer = self.job.writer(cfg)
        self.n_before = self.writer.n_committed

    def write(self, staged: Any) -> None:
        """Append one staged batch (actstore.capture.stage.Staged); runs on the writer thread."""
        w = self.writer
        cfg = w.cfg
        try:
            packed, overflow = staged.wait()  # the device's copies and statistics have landed
            if any(overflow.values()) and self.job.opts.on_overflow == "raise":
                name = next(s for s, n in overflow.items() if n)
                raise overflow_error(name, overflow[name], staged.source_dtype, cfg.dtype)
            stats = None
            if packed is not None and w.stats is not None:
                stats = running_stats(
                    [stats_key(la, s.name) for la in cfg.layers for s in cfg.segments], cfg.d_model, packed
                )
            # The rows are lent: written from the slot (or the model's outputs), the slot
            # given back once they are (no copy into a staging buffer).
            w.append(**staged.append_kwargs(cfg.texts), batch_stats=stats, overflow=overflow, release=staged.release)
        except BaseException:
            staged.release()
            raise
        b = staged.b
        n_tok = int(sum(int(s.lengths.sum()) for s in staged.segs))
        for s, seg in zip(staged.segs, cfg.segments):  # tokens of the source against tokens kept by the budget
            if s.source_lengths is not None:
                src_n = np.asarray(s.source_lengths, np.int64)
                self.source_tokens += int(src_n.sum())
                self.truncated_tokens += int(np.clip(src_n - seg.t_max, 0, None).sum())
        nbytes = b * cfg.example_bytes()
        self.n_written += b
        self.tokens += n_tok
        self.nbytes += nbytes
        if self.io_progress is not None:
            io = w.io_stats()
            if io is not None:
                self.io_progress(io)
        if self.progress is not None:
            self.progress(b, n_tok, nbytes)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def abandon(self) -> None:
        """After an error: commit what was appended (the shard stays open for a resume)."""
        if self.writer is not None:
            try:
                self.writer.__exit__(CaptureError, None, None)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
