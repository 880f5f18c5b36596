"""The writer side of a capture: what one record() call writes, and its writer thread.

`Job` says what the shard holds (layers, segments, texts, labels, metadata) and makes its
StoreConfig from the first captured output. `WriteSide` runs on the writer thread (a
Drain, actstore.capture.drain): it opens the ShardWriter, then hands it each staged batch
(the ring slot's arrays with their statistics, clipped-value counts and per-token fields,
actstore.capture.stage) as a checked `Batch` it builds itself (actstore.capture.tobatch:
the capture made every array, so nothing is checked or screened again) through the
writer's internal door, `append_batch`; the ShardWriter commits every `commit_bytes` on
its own, where a Zarr shard file fills (nothing written twice).
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
from actstore.dtypes import count_nonfinite, to_numpy
from actstore.errors import CaptureError
from actstore.inputs.models import LoadedModel
from actstore.inputs.prepare import FIRST_MEANING, TOKEN_LABEL_MEANING
from actstore.layout import keys, spec
from actstore.layout.config import StoreConfig, default_t_chunk, make_config
from actstore.stats import stats_key
from actstore.write import ShardWriter
from actstore.write.batch import Batch, LayerList, overflow_error, sample_rows
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


@dataclass(frozen=True)
class ShardContents:
    """What a capture's shard holds beside its layers: one value from the job that plans it
    (actstore.capture.shares, record()'s keywords) to the store's configuration (Job.config).

    Attributes:
        segments: {name: T_max} of zero-padded segments; None: one fixed segment of every token.
        t_chunk: {segment: token chunk length} for some of `segments`.
        token_labels: True: spec.TOKEN_KIND_NAMES; a mapping: these kinds; False: no labels.
        texts: names of the per-example text fields.
        attrs: free-form metadata recorded with the store.
    """

    segments: dict[str, int] | None = None
    t_chunk: dict[str, int] | None = None
    token_labels: bool | Mapping[int, str] = False
    texts: tuple[str, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def kind_names(self) -> dict[int, str] | None:
        """The token kinds the labels mean (None: no labels)."""
        if isinstance(self.token_labels, Mapping):
            return dict(self.token_labels)
        return dict(spec.TOKEN_KIND_NAMES) if self.token_labels else None


@dataclass
class Job:
    """What one record() call writes into its shard: the one meaning of "job" in a capture."""

    target: CaptureTarget
    shard: int
    hooks: list[HookPoint]
    lm: LoadedModel
    opts: CaptureOptions
    contents: ShardContents = field(default_factory=ShardContents)
    model_id: str | None = None
    token_ids: bool = False  # decided from the first batch (actstore.capture.loop)

    def config(self, b: int, t: int, d: int) -> StoreConfig:
        """The store's configuration for outputs of (b, t, d) (t counted before a dropped CLS)."""
        c = self.contents
        t -= int(self.opts.drop_cls and c.segments is None)
        seg_kw: dict[str, Any] = {"segments": c.segments} if c.segments else {"tokens": t}
        if c.t_chunk:  # never a chunk above the writer's default size (MAX_CHUNK_BYTES)
            item = np.dtype(spec.ACT_DTYPES[self.opts.dtype]).itemsize
            seg_kw["t_chunk"] = {k: min(v, default_t_chunk(c.segments[k], d, item)) for k, v in c.t_chunk.items()}
        # The capture's labels are token kinds: the store says so (StoreConfig.token_label_names,
        # where the layout has it; the attrs' `token_labels` mark capture-made stores either way).
        names = c.kind_names
        if names is not None:
            seg_kw["token_label_names"] = names
        return make_config(
            layers=[hp.layer for hp in self.hooks],
            d_model=d,
            dtype=self.opts.dtype,
            **seg_kw,
            zarr_format=self.opts.zarr_format,
            shard_examples=self.opts.store_shard_examples(),
            texts=c.texts,
            token_labels=c.token_labels,
            token_ids=self.token_ids,
            model_id=self.model_id,
            attrs=self._attrs(t),
        )

    def _attrs(self, t: int) -> dict[str, Any]:
        c = self.contents
        attrs = dict(c.attrs)
        attrs["hooks"] = {str(hp.layer): hp.path for hp in self.hooks}
        attrs["hook_names"] = {str(hp.layer): hp.name for hp in self.hooks}  # readers take these names as layers
        attrs["hook_kind"] = (
            "block output (residual stream)" if all(hp.block for hp in self.hooks) else "named hooks (hook_names)"
        )
        if c.token_labels:
            extra = FIRST_MEANING if spec.FIRST_LABEL in (c.kind_names or {}) else {}
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
        lease = self.target.lease(self.shard)  # taken before the model loaded, if it was
        return ShardWriter(self.target.root, shard=self.shard, config=cfg, options=opts, lease=lease)


@dataclass
class WriteSide:
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
            batch = to_batch(staged, cfg, w.shard, w.n_written)
            batch.stats, batch.overflow = stats, overflow
            # The rows are lent: written from the slot (or the model's outputs), the slot
            # given back once they are (no copy into a staging buffer).
            batch.release = staged.release
            w.append_batch(batch)
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


def to_batch(staged: Any, cfg: StoreConfig, shard: int, first_index: int) -> Batch:
    """The writer's checked Batch of a staged batch (actstore.write.batch): the device side
    made every array in its stored form (layers as one LayerList per segment, each
    (b, T_pad, D); lengths, labels and token ids per segment), so nothing is checked
    again; each value is screened for inf/NaN once (here, unless the device side did)."""
    segs = staged.segs
    batch = Batch(b=staged.b, acts={}, aliased={}, lengths={})
    for si, sp in enumerate(segs):
        name = sp.seg.name
        layers = [to_numpy(a, name)[0] for a in staged.acts[name]]  # views of the slot (or outputs)
        known = staged.nonfinite or [None] * (len(layers) * len(segs))
        batch.acts[name] = LayerList(layers)
        batch.aliased[name] = True  # the slot's memory: lent, never kept past its release
        batch.lengths[name] = sp.lengths
        batch.nonfinite[name] = sum(
            count_nonfinite(a) if known[lp * len(segs) + si] is None else known[lp * len(segs) + si]
            for lp, a in enumerate(layers)
        )
        src = sp.source_lengths
        batch.truncated[name] = 0 if src is None else int(np.count_nonzero(np.asarray(src) > sp.seg.t_max))
        batch.per_sample[keys.len_array(name)] = sp.lengths
        if cfg.token_labels:
            assert sp.labels is not None  # (b, t_max) uint8: actstore.capture.segments
            batch.per_sample[keys.labels_array(name)] = sp.labels
        if cfg.token_ids:
            assert sp.token_ids is not None  # (b, t_max), padding 0: actstore.capture.segments
            batch.per_sample[keys.token_ids_array(name)] = sp.token_ids.astype(np.int32)
    texts = {t: staged.batch.texts[t] for t in cfg.texts}
    sample_rows(cfg, batch, staged.batch.keys or None, texts, first_index, shard)
    return batch
