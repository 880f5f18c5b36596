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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.layout import spec
from actstore.capture.drain import Drain
from actstore.errors import CaptureError, EmptyDatasetError
from actstore.capture.hooks import Capture, resolve_hooks
from actstore.inputs.models import LoadedModel, wrap_module
from actstore.capture.record_inputs import accepts, as_batch, auto_token_ids, device_of
from actstore.capture.record_job import RecordJob
from actstore import catalog
from actstore.storage import open_storage, retry
from actstore.write import ShardWriter
from actstore.write.pipeline import IOStats

DEFAULT_QUEUE = 4
DEFAULT_WRITER_NICE = 10  # the writer thread's priority drop (Linux nice, per thread)


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
        network: the object-store connection failures and retries of this run, by kind
            (actstore.storage.retry.counts).
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
    network: dict[str, int] = field(default_factory=dict)


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
    device = device_of(lm.forward)
    extra = {"use_cache": False} if accepts(lm.forward, "use_cache") else {}
    job = RecordJob(
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
    net0 = retry.counts()
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
                batch = as_batch(raw, lm.forward)
                outs, event = cap.run({**batch.inputs, **extra}, batch.args)
                t_fwd += time.perf_counter() - t1
                if drain is None:  # the writer thread creates the shard while the next batch runs
                    if job.token_ids is None:
                        job.token_ids = auto_token_ids(store, batch)
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
                network=retry.counts_since(net0),
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
        network=retry.counts_since(net0),
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
