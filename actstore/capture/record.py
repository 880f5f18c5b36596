"""record(): run a model over batches and write the hooked activations to one store shard.

The forward pass runs on the calling thread; a background thread drains a bounded queue
into a ShardWriter (conversion to the stored dtype, statistics, chunk writes, commits).
The forward pass waits only when the queue is full. On CUDA, hooks copy each output to
pinned host memory with non_blocking=True as soon as it is produced.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actstore.layout import spec
from actstore.layout.config import default_t_chunk
from actstore.capture.drain import Drain
from actstore.errors import CaptureError, EmptyDatasetError
from actstore.capture.hooks import Capture, HookPoint, resolve_hooks
from actstore.capture.models import LoadedModel, wrap_module
from actstore.capture.prepare import TOKEN_LABEL_MEANING, CaptureBatch
from actstore.stats import stats_key
from actstore import catalog
from actstore.storage import open_storage
from actstore.write import ShardWriter
from actstore.write.pipeline import IOStats

DEFAULT_QUEUE = 4
DEFAULT_WRITER_NICE = 10  # the writer thread's priority drop (Linux nice, per thread)
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


@dataclass(frozen=True)
class RecordResult:
    """What one record() call did.

    Attributes:
        shard: the shard written.
        n_before: examples already committed when the run started (resume).
        n_written: examples written by this run.
        tokens: token vectors stored per layer by this run.
        nbytes: activation bytes written by this run.
        seconds: wall time of the run.
        forward_seconds: time spent in forward passes (and input preparation).
        wait_seconds: time the forward loop waited for the writer (queue full).
        writer_seconds: time the writer thread spent converting, writing and committing.
        writer_cpu_seconds: CPU time of that work (what it takes from the model's cores;
            the rest of writer_seconds is waiting on the disk).
        source_tokens: tokens the data held for what was stored (before truncation; text segments).
        truncated_tokens: of those, the tokens cut by the segments' budgets.
    """

    shard: int
    n_before: int
    n_written: int
    tokens: int
    nbytes: int
    seconds: float
    forward_seconds: float
    wait_seconds: float
    writer_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0
    source_tokens: int = 0
    truncated_tokens: int = 0


def committed(store: str | os.PathLike, shard: int = 0) -> tuple[int, bool]:
    """(examples committed, shard complete) of a writer shard; (0, False) if it does not exist."""
    return catalog.committed(open_storage(store), shard)


def record(
    model: Any,
    batches: Iterable[Any],
    store: str | os.PathLike,
    *,
    layers: Sequence[int | str],
    shard: int = 0,
    dtype: str = spec.DEFAULT_DTYPE,
    segments: Mapping[str, int] | None = None,
    t_chunk: Mapping[str, int] | None = None,
    token_labels: bool = False,
    texts: Sequence[str] = (),
    resume: bool = False,
    model_id: str | None = None,
    attrs: Mapping[str, Any] | None = None,
    stats: bool = True,
    on_overflow: str = "raise",
    commit_bytes: int = spec.DEFAULT_COMMIT_BYTES,
    queue_size: int = DEFAULT_QUEUE,
    stop_early: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
    io_progress: Callable[[IOStats], None] | None = None,
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT,
    shard_examples: int | str | None = spec.SHARD_EXAMPLES_AUTO,
    writer_nice: int = DEFAULT_WRITER_NICE,
    world_size: int | None = None,
    token_ids: bool | None = None,
    drop_cls: bool = False,
    engine: str = "local",
    workers: int = 1,
    ray_address: str | None = None,
    cpus_per_worker: float = 1.0,
    gpus_per_worker: float = 0.0,
) -> RecordResult | list[RecordResult]:
    """Record the residual stream (or named modules) of `model` over `batches` into a shard.

    Args:
        model: a torch module (HF transformers model) or a LoadedModel from load_model.
        batches: CaptureBatch objects, dicts of forward kwargs, or tensors (float:
            pixel_values, int: input_ids). Plain batches store every token (a fixed
            segment) unless `segments` is given, in which case `attention_mask` marks the
            tokens kept.
        store: the store root.
        layers: block numbers (layer N = output of block N = hidden_states[N + 1]) or
            module paths such as "model.layers.6.mlp".
        shard: this writer's shard number.
        dtype: stored dtype ("float16", "bfloat16", "float32").
        segments: {name: T_max} of zero-padded segments (texts); None for one fixed segment.
        t_chunk: {segment: token chunk length} for some of `segments` (each capped to the
            writer's default chunk size); the others get the writer's default.
        token_labels, texts: as in ShardWriter (CaptureBatch supplies the values).
        resume: continue the shard after its committed examples; `batches` must start
            after them (see committed()).
        model_id, attrs: metadata for the store.
        stats: keep running statistics per (layer, segment).
        on_overflow: "raise" or "clip" values beyond the stored dtype's range.
        commit_bytes: commit a block after this many activation bytes.
        queue_size: batches the writer thread may lag behind the forward pass.
        stop_early: stop the forward pass after the last hooked module.
        progress: called with (examples, tokens, bytes) after each batch is written.
        io_progress: called with the writer's IOStats (bytes queued for and written or
            uploaded by its write pipeline) after each batch is written.
        zarr_format, shard_examples: the store's layout, as in ShardWriter: Zarr format 3
            with Zarr shard files of `shard_examples` examples ("auto", the default: about
            256 MiB each), or format 2 (one file per chunk).
        writer_nice: lower the writer thread's priority by this much (0..19; Linux nice,
            per thread) so that it yields the cores to the model and runs in its gaps;
            0 keeps the normal priority. Not permitted or not supported: ignored.
        world_size: the number of ranks of a distributed run (this shard is rank `shard`);
            recorded so that finalize refuses while a rank is missing.
        token_ids: keep the vocabulary id of every stored token (int32). None: when the
            batches carry `input_ids` (text models), unless resuming a store without them.
        drop_cls: do not store token 0 of a fixed-length (image) segment: a ViT's CLS token.
        engine: "local" (this process writes shard `shard`) or "ray": `workers` writer
            actors on a Ray cluster (`ray_address`, else RAY_ADDRESS, else a local one; each
            reserving `cpus_per_worker` CPUs and `gpus_per_worker` GPUs) write shards
            0..workers-1, writer r recording the contiguous slice r of `batches` (a list);
            `model` may then be a model spec for load_model or a callable returning the
            model, so that each actor loads its own. An actor that dies is restarted and
            resumes its shard. Finalize afterwards (docs/distributed.md).

    Returns:
        A RecordResult (with engine="ray", one per writer, in rank order). The shard is
        closed (complete) when every batch was written.
    """
    if engine == "ray":
        return _record_ray(locals())
    if engine != "local":
        raise ValueError(f"engine must be 'local' or 'ray'. Got {engine!r}.")
    if isinstance(writer_nice, bool) or not isinstance(writer_nice, int) or not 0 <= writer_nice <= 19:
        raise ValueError(f"writer_nice must be an int in 0..19. Got {writer_nice!r}.")
    lm = model if isinstance(model, LoadedModel) else wrap_module(model, model_id=model_id)
    hooks = resolve_hooks(lm.forward, layers)  # unknown layers fail before anything is written
    device = _device_of(lm.forward)
    extra = {"use_cache": False} if _accepts(lm.forward, "use_cache") else {}
    job = _Job(
        store=store if isinstance(store, str) else Path(store),
        shard=shard,
        hooks=hooks,
        lm=lm,
        dtype=dtype,
        segments=dict(segments) if segments else None,
        t_chunk=dict(t_chunk) if t_chunk else None,
        token_labels=token_labels,
        texts=tuple(texts),
        resume=resume,
        model_id=model_id or lm.model_id,
        attrs=dict(attrs or {}),
        stats=stats,
        on_overflow=on_overflow,
        commit_bytes=int(commit_bytes),
        progress=progress,
        io_progress=io_progress,
        zarr_format=zarr_format,
        shard_examples=shard_examples,
        world_size=world_size,
        token_ids=token_ids,
        drop_cls=drop_cls,
    )
    t0 = time.perf_counter()
    t_fwd = 0.0
    drain: Drain | None = None
    try:
        with Capture(
            lm.forward, hooks, stop_early=stop_early, to_host=device.type == "cuda", half=dtype == "float16"
        ) as cap:
            it = iter(batches)
            while True:
                t1 = time.perf_counter()
                try:
                    raw = next(it)
                except StopIteration:
                    break
                batch = _as_batch(raw, lm.forward)
                outs, event = cap.run({**batch.inputs, **extra}, batch.args)
                t_fwd += time.perf_counter() - t1
                if drain is None:  # the writer thread creates the shard while the next batch runs
                    if job.token_ids is None:
                        job.token_ids = _auto_token_ids(store, batch)
                    drain = Drain(job.write, queue_size, start=lambda o=outs: job.open_writer(o), nice=writer_nice)
                drain.put((outs, event, batch))
        if drain is None:
            n0, complete = committed(store, shard)
            if not (resume and (n0 or complete)):
                raise EmptyDatasetError("no batches to record: the data is empty (nothing was written)")
            if not complete:
                ShardWriter(store, shard=shard, resume=True, **job.writer_kwargs_from_store()).close()
            return RecordResult(
                shard=shard,
                n_before=n0,
                n_written=0,
                tokens=0,
                nbytes=0,
                seconds=time.perf_counter() - t0,
                forward_seconds=0.0,
                wait_seconds=0.0,
            )
        drain.close()
        job.writer.close()
    except BaseException:
        if drain is not None:
            drain.abort()
        if job.writer is not None:
            try:
                job.writer.__exit__(CaptureError, None, None)  # commit what was written; the shard stays open
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        raise
    return RecordResult(
        shard=shard,
        n_before=job.n_before,
        n_written=job.n_written,
        tokens=job.tokens,
        nbytes=job.nbytes,
        seconds=time.perf_counter() - t0,
        forward_seconds=t_fwd,
        wait_seconds=drain.wait_seconds,
        writer_seconds=drain.busy_seconds,
        writer_cpu_seconds=drain.cpu_seconds,
        source_tokens=job.source_tokens,
        truncated_tokens=job.truncated_tokens,
    )


def _record_ray(args: dict[str, Any]) -> list[RecordResult]:
    """record(..., engine="ray"): the writers as Ray actors (actstore.capture.engines)."""
    from actstore.capture.engines import RaySettings, record_ray

    if args["shard"] != 0 or args["world_size"] is not None:
        raise ValueError(
            "record(engine='ray') writes shards 0..workers-1 (world size `workers`): leave shard and world_size out"
        )
    settings = RaySettings(
        workers=args["workers"],
        address=args["ray_address"],
        cpus_per_worker=args["cpus_per_worker"],
        gpus_per_worker=args["gpus_per_worker"],
        progress=False,
    )
    local = (
        "model",
        "batches",
        "store",
        "shard",
        "world_size",
        "resume",
        "progress",
        "io_progress",
        "engine",
        "workers",
        "ray_address",
        "cpus_per_worker",
        "gpus_per_worker",
    )
    results = record_ray(
        record,
        args["model"],
        args["batches"],
        args["store"],
        settings,
        resume=args["resume"],
        callback=args["progress"],
        **{k: v for k, v in args.items() if k not in local},
    )
    return [
        res
        if isinstance(res, RecordResult)
        else RecordResult(
            shard=r, n_before=res, n_written=0, tokens=0, nbytes=0, seconds=0.0, forward_seconds=0.0, wait_seconds=0.0
        )  # a complete shard
        for r, res in enumerate(results)
    ]


@dataclass
class _Job:
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
        """ShardWriter arguments equal to the store's identity (to reopen a shard to close it)."""
        cfg = catalog.read_identity(open_storage(self.store))
        seg = (
            {"tokens": cfg.segments[0].t_max}
            if cfg.segments[0].fixed
            else {"segments": {s.name: s.t_max for s in cfg.segments}}
        )
        return dict(
            layers=cfg.layers,
            d_model=cfg.d_model,
            dtype=cfg.dtype,
            **seg,
            t_chunk={s.name: s.t_chunk for s in cfg.segments},
            texts=cfg.texts,
            token_labels=cfg.token_labels,
            token_ids=cfg.token_ids,
            model_id=cfg.model_id,
            stats=self.stats,
            zarr_format=cfg.zarr_format,
            shard_examples=cfg.shard_examples,
        )

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


def _auto_token_ids(store: str | os.PathLike, batch: CaptureBatch) -> bool:
    """Keep token ids when the batches carry input_ids, unless the store (resumed) has none."""
    storage = open_storage(store)
    if catalog.has_identity(storage):
        return catalog.read_identity(storage).token_ids
    return "input_ids" in batch.inputs


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


def _as_batch(raw: Any, module: Any) -> CaptureBatch:
    if isinstance(raw, CaptureBatch):
        return raw
    if isinstance(raw, Mapping):
        return CaptureBatch(inputs=dict(raw), keys=[])
    if hasattr(raw, "dtype") and hasattr(raw, "is_floating_point"):
        name = "pixel_values" if raw.is_floating_point() else "input_ids"
        if _accepts(module, name):
            return CaptureBatch(inputs={name: raw}, keys=[])
        return CaptureBatch(inputs={}, keys=[], args=(raw,))  # a plain module: positional input
    raise CaptureError(
        f"a batch must be a CaptureBatch, a dict of forward arguments or a tensor; got {type(raw).__name__}"
    )


def _device_of(module: Any) -> Any:
    import torch

    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _accepts(module: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
