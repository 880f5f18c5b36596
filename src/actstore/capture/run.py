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

from actstore.capture import ranks
from actstore.capture.capture_bar import CaptureBar
from actstore.capture.loop import RecordResult
from actstore.capture.options import CaptureOptions, check_job
from actstore.capture.record import record_shard
from actstore.capture.runner_local import run_workers
from actstore.capture.target import CaptureTarget
from actstore.dtypes import require_torch
from actstore.errors import CaptureError
from actstore.inputs.data import Source, load_source
from actstore.inputs.models import load_model
from actstore.inputs.textdecode import Decoding

__all__ = ["run_shard", "write"]


def write(o: CaptureOptions) -> dict[str, Any]:
    """Run the capture job; returns a summary (examples, tokens, bytes, seconds, shards).

    With --workers N, N processes write shards 0..N-1 and the store is finalized; with
    --rank r --world-size w this process writes shard r only (finalize once every rank
    is done); otherwise one writer writes shard 0 and the store is finalized.
    """
    if importlib.util.find_spec("torch") is None:  # (found, not imported: the checks below come first, fast)
        require_torch("actstore write (actstore.capture.write)", "capture")
    check_job(o)
    multi = o.workers > 1 or o.runner == "ray"  # actstore starts the writers: ranks 0..workers-1
    if not multi:
        r = ranks.resolve(o.rank, o.world_size, os.environ)
        if r.source.startswith(("SLURM", "RANK")):  # printed even with --quiet: a job log should say it
            print(f"rank {r.rank} of {r.world_size} (from {r.source})", file=sys.stderr, flush=True)
        o = replace(o, rank=r.rank, world_size=r.world_size)
    from actstore.capture import preflight

    # Everything that can be known before a model loads fails here, in about a second:
    # nothing above imports torch.
    target = CaptureTarget(o.store)
    target.storage.check_access(write=True)  # a missing bucket or refused credentials fail now, not after the model ran
    modality = preflight.check_model(o, target.identity())
    decoding = Decoding(o.encoding, o.errors)
    source = load_source(o.data, o.text_field, decoding).limit(o.max_examples)  # empty data fails first
    if decoding.report():  # printed even with --quiet: the data changed
        print(decoding.report(), file=sys.stderr, flush=True)
    preflight.check_data(o, source, modality)
    if source.kind == "image" and o.special == "drop":
        o = replace(o, drop=(*o.drop, "cls"))  # an image's special token: a ViT's CLS (token 0)
    world = o.workers if multi else o.world_size
    assert world is not None
    if world > len(source) and not (o.pack or o.chunk):  # (windows are counted by each writer)
        raise CaptureError(f"{world} writers for {len(source)} examples: use at most {len(source)} writers")
    here = range(world) if multi else [o.rank]
    if multi:  # the writers' processes take their leases; a live writer of a shard: refused now
        for r in here:
            target.check_lease(r)
    if not o.resume:
        target.check_fresh(here)
    created = target.is_empty()
    whole = multi or world == 1  # this call writes every rank: it may clean up and finalize
    t0 = time.perf_counter()
    from actstore.storage import retry

    net0 = retry.counts()
    try:
        if o.runner == "ray":
            from actstore.capture.runner_ray import run_ray

            results = run_ray(o, len(source), run_shard)
        elif o.workers > 1:
            results = run_workers(o, len(source), run_shard)
        else:
            results = [run_shard(o, o.rank or 0, world, source=source)]
    except BaseException:
        if created and whole:
            target.remove_if_nothing_committed(world)
        raise
    summary = _summary(target, results, time.perf_counter() - t0)
    if o.finalize and whole:
        from actstore.write.finalize import finalize

        finalize(target.url)
        summary["finalized"] = True
        from actstore.read.masks import summarize
        from actstore.read.sinkcheck import find_sinks, sink_warning
        from actstore.read.store import ActStore

        done = ActStore(target.url)
        mask = summarize(done)  # which tokens every reader's default mask keeps
        summary["mask"], summary["mask_line"] = mask.to_json(), mask.line()
        sinks = find_sinks(done)  # a kept position that dwarfs the others: an attention sink counted as content
        summary["sinks"], summary["sink_warning"] = [s.to_json() for s in sinks], sink_warning(sinks, done)
    # connection failures and retries: this process's, and those of writers in other processes
    apart = [r.network for r in results] if multi else []
    summary["network"] = retry.counts_since(net0, *apart)
    return summary


def _summary(target: CaptureTarget, results: list[RecordResult], seconds: float) -> dict[str, Any]:
    return {
        "store": str(target.url),
        "examples": sum(r.n_before + r.n_written for r in results),
        "written": sum(r.n_written for r in results),
        "tokens": sum(r.tokens for r in results),
        "bytes": sum(r.nbytes for r in results),
        "seconds": seconds,
        "capture_seconds": max(r.seconds for r in results),
        "wait_seconds": sum(r.wait_seconds for r in results),
        "source_tokens": sum(r.source_tokens for r in results),
        "truncated_tokens": sum(r.truncated_tokens for r in results),
        "shards": [r.shard for r in results],
        "finalized": False,
    }


def run_shard(
    o: CaptureOptions, rank: int, world: int, *, source: Source | None = None, progress: Any = None
) -> RecordResult:
    """Load the model and write shard `rank`'s slice of the data (one writer process)."""
    source = source or load_source(o.data, o.text_field, Decoding(o.encoding, o.errors)).limit(o.max_examples)
    target = CaptureTarget(o.store)
    target.take_lease(rank)  # a shard another live writer holds: refused before the model loads
    try:
        return _run_shard(o, rank, world, source, progress, target)
    finally:
        target.release_leases()  # (already given back by a writer that adopted it and closed)


def _run_shard(
    o: CaptureOptions, rank: int, world: int, source: Source, progress: Any, target: CaptureTarget
) -> RecordResult:
    import torch

    from actstore.capture.shares import image_or_text, windows

    if o.threads:
        torch.set_num_threads(o.threads)
    n_done, complete = target.committed(rank) if o.resume else (0, False)
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
    if o.progress and progress is None:
        print(f"loading {o.model} ...", file=sys.stderr, flush=True)
    lm = load_model(o.model, device=o.device, torch_dtype=o.model_dtype)
    make = windows if o.pack or o.chunk else image_or_text
    share = make(o, lm, source, target, rank, world, n_done)
    own_bar = None
    if progress is None and o.progress:
        own_bar = progress = CaptureBar(total=share.total, desc=f"shard {rank}")
    opts = replace(o, runner="local", world_size=world)  # this process writes this shard
    opts.check(names="python")
    try:
        return record_shard(
            lm,
            share.batches,
            target,
            opts,
            rank,
            share.contents,
            progress=progress.update if progress is not None else None,
            io_progress=getattr(progress, "io", None),
        )
    finally:
        if own_bar is not None:
            own_bar.close()
