"""write(): the whole capture job behind `actstore write`, in one process or many.

The data (cut to --max-examples) is split into contiguous, deterministic slices, one per
writer: writer r of w takes examples [n*r//w, n*(r+1)//w) into shard r. Since finalize
orders examples shard-major, the finalized store lists the examples in data order
whatever the number of writers.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import replace
from typing import Any

from actstore.inputs.data import Source, absolute_data, load_source
from actstore.capture import ranks
from actstore.capture.progress import Progress
from actstore.capture.ranks import split
from actstore.errors import CaptureError
from actstore.inputs.models import LoadedModel, load_model
from actstore.inputs.textdecode import Decoding
from actstore.inputs.prepare import image_batches, text_batches
from actstore.capture.record import RecordResult, committed, record
from actstore.capture.text_budgets import DEFAULT_QUANTILE, MIN_T_CHUNK, measured_t_chunk, text_plan
from actstore.capture.workers import run_workers
from actstore.capture.write_options import DROPPABLE, ENGINES, WriteOptions, check_options
from actstore.dtypes import require_torch
from actstore import catalog
from actstore.storage import open_storage, retry

__all__ = [
    "DEFAULT_QUANTILE",
    "DROPPABLE",
    "ENGINES",
    "MIN_T_CHUNK",
    "WriteOptions",
    "check_lease",
    "check_options",
    "measured_t_chunk",
    "run_shard",
    "write",
]


def write(o: WriteOptions) -> dict[str, Any]:
    """Run the capture job; returns a summary (examples, tokens, bytes, seconds, shards).

    With --workers N, N processes write shards 0..N-1 and the store is finalized; with
    --rank r --world-size w this process writes shard r only (finalize once every rank
    is done); otherwise one writer writes shard 0 and the store is finalized.
    """
    if importlib.util.find_spec("torch") is None:  # (found, not imported: the checks below come first, fast)
        require_torch("actstore write (actstore.capture.write)", "capture")
    check_options(o)
    multi = o.workers > 1 or o.engine == "ray"  # actstore starts the writers: ranks 0..workers-1
    if not multi:
        r = ranks.resolve(o.rank, o.world_size, os.environ)
        if r.source.startswith(("SLURM", "RANK")):  # printed even with --quiet: a job log should say it
            print(f"rank {r.rank} of {r.world_size} (from {r.source})", file=sys.stderr, flush=True)
        o = replace(o, rank=r.rank, world_size=r.world_size)
    from actstore.capture import preflight

    # Everything that can be known before a model loads fails here, in about a second:
    # nothing above imports torch.
    storage = open_storage(o.store)
    storage.check_access(write=True)  # a missing bucket or refused credentials fail now, not after the model ran
    modality = preflight.check_model(o, catalog.read_identity(storage) if catalog.has_identity(storage) else None)
    decoding = Decoding(o.encoding, o.errors)
    source = load_source(o.data, o.text_field, decoding).limit(
        o.max_examples
    )  # empty data fails before anything is written
    if decoding.report():  # printed even with --quiet: the data changed
        print(decoding.report(), file=sys.stderr, flush=True)
    preflight.check_data(o, source, modality)
    world = o.workers if multi else o.world_size
    assert world is not None
    if world > len(source) and not (o.pack or o.chunk):  # (windows are counted by each writer)
        raise CaptureError(f"{world} writers for {len(source)} examples: use at most {len(source)} writers")
    root = storage.url
    here = range(world) if multi else [o.rank]
    for r in here:
        check_lease(storage, r)  # another live writer of a shard: refused before any model loads
    if not o.resume:
        for r in here:
            if catalog.shard_exists(storage, r):
                n_done, complete = committed(root, r)
                raise CaptureError(
                    f"{root} already holds shard {r} ({n_done} examples committed{', complete' if complete else ''}); "
                    "pass --resume to continue the run, or write to a new path"
                )
    created = not storage.list_dir()
    whole = multi or world == 1  # this call writes every rank: it may clean up and finalize
    t0 = time.perf_counter()
    net0 = retry.counts()
    try:
        if o.engine == "ray":
            from actstore.capture.engines import run_ray

            results = run_ray(o, len(source), run_shard)
        elif o.workers > 1:
            results = run_workers(o, len(source), run_shard)
        else:
            results = [run_shard(o, o.rank or 0, world, source=source)]
    except BaseException:
        if created and whole:
            _remove_if_nothing_committed(storage, world)
        raise
    summary = {
        "store": str(root),
        "examples": sum(r.n_before + r.n_written for r in results),
        "written": sum(r.n_written for r in results),
        "tokens": sum(r.tokens for r in results),
        "bytes": sum(r.nbytes for r in results),
        "seconds": time.perf_counter() - t0,
        "capture_seconds": max(r.seconds for r in results),
        "wait_seconds": sum(r.wait_seconds for r in results),
        "source_tokens": sum(r.source_tokens for r in results),
        "truncated_tokens": sum(r.truncated_tokens for r in results),
        "shards": [r.shard for r in results],
        "finalized": False,
    }
    if o.finalize and whole:
        from actstore.write.finalize import finalize

        finalize(root)
        summary["finalized"] = True
    # connection failures and retries: this process's, and those of writers in other processes
    apart = [r.network for r in results] if o.engine == "ray" or o.workers > 1 else []
    summary["network"] = retry.counts_since(net0, *apart)
    return summary


def run_shard(
    o: WriteOptions, rank: int, world: int, *, source: Source | None = None, progress: Any = None
) -> RecordResult:
    """Load the model and write shard `rank`'s slice of the data (one writer process)."""
    import torch

    if o.threads:
        torch.set_num_threads(o.threads)
    source = source or load_source(o.data, o.text_field, Decoding(o.encoding, o.errors)).limit(o.max_examples)
    check_lease(open_storage(o.store), rank)
    n_done, complete = committed(o.store, rank) if o.resume else (0, False)
    if complete:  # a finished shard: nothing to do, no model to load
        return RecordResult(
            shard=rank,
            n_before=n_done,
            n_written=0,
            tokens=0,
            nbytes=0,
            seconds=0.0,
            forward_seconds=0.0,
            wait_seconds=0.0,
        )
    if o.pack or o.chunk:
        return _run_windows(o, rank, world, source, progress, n_done)
    start, stop = split(len(source), world, rank)
    if o.progress and progress is None:
        print(f"loading {o.model} ...", file=sys.stderr, flush=True)
    lm = load_model(o.model, device=o.device, torch_dtype=o.model_dtype)
    _check_modality(lm, source)
    if lm.modality == "text" and o.generate and source.kind == "text":
        source = _as_prompts(source)  # texts become the prompts to respond to
    plan = text_plan(o, lm, source) if lm.modality == "text" else None
    first = min(start + n_done, stop)
    if plan is None:
        batches = image_batches(source, first, stop, lm.image, o.batch_size, lm.device)
    else:
        batches = text_batches(source, first, stop, lm.tokenizer, plan, o.batch_size, lm.device, model=lm.model)
    attrs = {
        "source": source.name,
        "dataset": absolute_data(o.data),
        "capture": {
            "batch_size": o.batch_size,
            "model_dtype": o.model_dtype,
            "special": o.special if plan else None,
            "chat_template": o.chat_template,
            "generate": o.generate,
            "world_size": world,
        },
    }
    bar = progress
    own_bar = None
    if bar is None and o.progress:
        own_bar = bar = Progress(total=stop - first, desc=f"shard {rank}")
    try:
        return record(
            lm,
            batches,
            o.store,
            layers=o.layers,
            shard=rank,
            dtype=o.dtype,
            segments=plan.segments if plan else None,
            t_chunk=plan.t_chunks if plan else None,
            token_labels=bool(plan and o.special == "mask"),
            texts=plan.texts if plan else ("image",),
            **_writer_kwargs(o, attrs, bar, world),
            drop_cls="cls" in o.drop,
        )
    finally:
        if own_bar is not None:
            own_bar.close()


def _run_windows(o: WriteOptions, rank: int, world: int, source: Source, progress: Any, n_done: int) -> RecordResult:
    """--pack / --chunk: this rank's slice of the corpus's windows (actstore.inputs.packing)."""
    from actstore.inputs.packing import RUNS_TEXT, plan_windows, window_batches

    if o.progress and progress is None:
        print(f"loading {o.model} ...", file=sys.stderr, flush=True)
    lm = load_model(o.model, device=o.device, torch_dtype=o.model_dtype)
    if lm.modality != "text":
        raise CaptureError(f"--pack and --chunk take a language model; {lm.model_id} takes {lm.modality} input")
    if lm.max_tokens and o.context > lm.max_tokens:
        raise CaptureError(f"--context {o.context} exceeds {lm.model_id}'s context of {lm.max_tokens} tokens")
    windows = plan_windows(source, lm.tokenizer, o.context, "pack" if o.pack else "chunk", window_bos=o.window_bos)
    start, stop = split(len(windows), world, rank)
    if start == stop:
        raise CaptureError(
            f"the corpus makes {len(windows)} windows of {o.context} tokens: too few for {world} writers; use fewer writers"
        )
    first = min(start + n_done, stop)
    attrs = {
        "source": source.name,
        "dataset": absolute_data(o.data),
        "capture": {"batch_size": o.batch_size, "model_dtype": o.model_dtype, "world_size": world},
        "packing": {
            "mode": windows.mode,
            "context": o.context,
            "documents": len(source),
            "tokens": windows.n_tokens,
            "windows": len(windows),
            "separator": lm.tokenizer.eos_token,
            "window_bos": windows.bos,
            "runs": f"text field {RUNS_TEXT!r}: [document, key, offset, length]",
        },
    }
    bar = progress
    own_bar = Progress(total=stop - first, desc=f"shard {rank}") if bar is None and o.progress else None
    bar = bar or own_bar
    try:
        return record(
            lm,
            window_batches(
                source, windows, first, stop, lm.tokenizer, o.batch_size, lm.device, drop_bos="bos" in o.drop
            ),
            o.store,
            layers=o.layers,
            shard=rank,
            dtype=o.dtype,
            segments={"tokens": o.context},
            token_labels=True,
            texts=(RUNS_TEXT,),
            **_writer_kwargs(o, attrs, bar, world),
        )
    finally:
        if own_bar is not None:
            own_bar.close()


def check_lease(storage: Any, rank: int) -> None:
    """Refuse a shard that a live writer holds, before the model loads (the writer takes
    the lease itself when it opens the shard)."""
    from actstore.errors import ShardBusyError
    from actstore.write.lease import current, holder_alive

    held = current(storage, rank)
    if held is not None and holder_alive(held):
        raise ShardBusyError(
            f"shard {rank} of {storage.url} is being written by another writer: {held.holder()}. "
            "Two writers of one shard would interleave their blocks; give this writer another rank, or wait for that one"
        )


def _check_modality(lm: LoadedModel, source: Source) -> None:
    want = "image" if source.kind == "image" else "text"
    if lm.modality != want:
        raise CaptureError(
            f"model {lm.model_id} takes {lm.modality} input but --data {source.name} holds {source.kind} examples"
        )


def _as_prompts(source: Source) -> Source:
    get = source.get

    def as_pair(i: int) -> dict[str, Any]:
        r = get(i)
        return {"key": r["key"], "prompt": r["text"], "response": None} if "text" in r else r

    return Source(kind="pair", name=source.name, n=source.n, get=as_pair)


def _remove_if_nothing_committed(storage, world: int) -> None:
    """After a failed fresh run: delete the store it created if no writer committed anything."""
    if not storage.list_dir():
        return
    if any(catalog.committed(storage, r)[0] for r in range(world)):
        return
    storage.delete_prefix("")


def _writer_kwargs(o: WriteOptions, attrs: dict[str, Any], bar: Any, world: int) -> dict[str, Any]:
    """The record() keywords every `actstore write` capture passes alike (images, text, packed)."""
    return dict(
        resume=o.resume,
        attrs=attrs,
        stats=o.stats,
        on_overflow=o.on_overflow,
        commit_bytes=int(o.commit_mb * 2**20),
        queue_size=o.queue_size,
        progress=bar.update if bar is not None else None,
        io_progress=getattr(bar, "io", None),
        zarr_format=o.zarr_format,
        shard_examples=o.shard_examples,
        writer_nice=o.writer_nice,
        world_size=world,
    )
