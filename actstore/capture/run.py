"""write(): the whole capture job behind `actstore write`, in one process or many.

The data (cut to --max-examples) is split into contiguous, deterministic slices, one per
writer: writer r of w takes examples [n*r//w, n*(r+1)//w) into shard r. Since finalize
orders examples shard-major, the finalized store lists the examples in data order
whatever the number of writers.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from actstore.layout import spec
from actstore.capture.data import Source, absolute_data, load_source
from actstore.capture import ranks
from actstore.capture.progress import Progress
from actstore.capture.ranks import bar_total, split
from actstore.errors import CaptureError
from actstore.capture.models import LoadedModel, load_model
from actstore.capture.textdecode import Decoding
from actstore.capture.prepare import SPECIAL_MODES, TextPlan, image_batches, prompt_lengths, text_batches
from actstore.capture.record import DEFAULT_WRITER_NICE, RecordResult, committed, record
from actstore.dtypes import require_torch
from actstore import catalog
from actstore.storage import open_storage

ENGINES = ("local", "ray")
DROPPABLE = ("bos", "cls")
DEFAULT_QUANTILE = 0.99  # default token budgets: this quantile of the measured lengths
MIN_T_CHUNK = 16


def measured_t_chunk(lengths: Any, budget: int) -> int:
    """Token chunk of a variable-length segment whose lengths were measured: the smallest
    power of two >= the median length (at least MIN_T_CHUNK), at most the budget. Most
    reads then touch one chunk holding little padding: in benchmarks/bench_spec.py's
    matrix (docs/spec-answers.md) it gave the lowest prompt read latency at every width."""
    median = max(1, int(np.ceil(np.median(np.asarray(lengths)))))
    return min(int(budget), max(MIN_T_CHUNK, 1 << (median - 1).bit_length()))


@dataclass(frozen=True)
class WriteOptions:
    """Everything `actstore write` takes (see `actstore write --help`)."""

    store: str
    model: str
    data: str
    layers: tuple[int | str, ...]
    dtype: str = spec.DEFAULT_DTYPE
    batch_size: int = 8
    device: str = "cpu"
    model_dtype: str = "float32"
    max_examples: int | None = None
    p_max: int | None = None
    r_max: int | None = None
    p_quantile: float | None = None
    r_quantile: float | None = None
    generate: int = 0
    special: str = "mask"
    chat_template: bool = False
    workers: int = 1
    rank: int | None = None  # None (with world_size None): from Slurm/torchrun variables, else 0 of 1
    world_size: int | None = None
    engine: str = "local"  # "local": --workers processes on this machine; "ray": actors on a Ray cluster
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    ray_address: str | None = None
    pack: bool = False  # concatenate the documents into windows of exactly `context` tokens
    chunk: bool = False  # cut each document into consecutive windows of at most `context` tokens
    context: int | None = None
    encoding: str = "utf-8"  # text files' encoding
    errors: str = "strict"  # undecodable documents: strict (fail), replace (U+FFFD), skip (leave out)
    window_bos: bool = True  # --pack / --chunk: each window starts with the tokenizer's BOS (labelled special)
    text_field: str | None = None  # the column / JSON key of each document's text
    drop: tuple[str, ...] = ()  # tokens the model sees but the store does not keep: "bos" (texts), "cls" (images)
    separator: str = "\n"  # pairs without a chat template: between prompt and response
    resume: bool = False
    finalize: bool = True
    commit_mb: float = spec.DEFAULT_COMMIT_BYTES / 2**20
    on_overflow: str = "raise"
    queue_size: int = 4
    stats: bool = True
    progress: bool = True
    threads: int | None = None
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT
    shard_examples: int | str = spec.SHARD_EXAMPLES_AUTO  # with format 3: about 256 MiB a Zarr shard file
    writer_nice: int = DEFAULT_WRITER_NICE


def check_options(o: WriteOptions) -> None:
    """Reject contradictory options before anything is loaded or written."""
    if o.batch_size < 1:
        raise CaptureError(f"--batch-size must be a positive int. Got {o.batch_size}.")
    if o.workers < 1:
        raise CaptureError(f"--workers must be a positive int. Got {o.workers}.")
    if o.engine not in ENGINES:
        raise CaptureError(f"--engine must be one of {list(ENGINES)}. Got {o.engine!r}.")
    if (o.workers > 1 or o.engine == "ray") and (o.rank is not None or o.world_size is not None):
        raise CaptureError(
            "use either --workers N (writers started by actstore) or --rank/--world-size (one writer per launch), not both"
        )
    if o.rank is not None or o.world_size is not None:
        ranks.resolve(o.rank, o.world_size, {})
    if o.engine != "ray" and (o.gpus_per_worker or o.ray_address):
        raise CaptureError("--gpus-per-worker and --ray-address go with --engine ray")
    if o.cpus_per_worker <= 0 or o.gpus_per_worker < 0:
        raise CaptureError(
            f"--cpus-per-worker must be positive and --gpus-per-worker non-negative. Got {o.cpus_per_worker}, {o.gpus_per_worker}."
        )
    if o.pack and o.chunk:
        raise CaptureError(
            "give --pack (documents concatenated into windows) or --chunk (each document cut into windows), not both"
        )
    if (o.pack or o.chunk) != (o.context is not None):
        raise CaptureError(
            "--pack and --chunk need --context N (the window length in tokens), and --context needs one of them"
        )
    if o.context is not None and o.context < 1:
        raise CaptureError(f"--context must be a positive int. Got {o.context}.")
    if (o.pack or o.chunk) and (o.generate or o.chat_template or o.p_max or o.r_max or o.p_quantile or o.r_quantile):
        raise CaptureError(
            "--pack/--chunk store every token of the corpus in windows of --context tokens: "
            "--p-max, --r-max, quantiles, --generate and --chat-template do not apply"
        )
    unknown = [d for d in o.drop if d not in DROPPABLE]
    if unknown:
        raise CaptureError(f"--drop takes {list(DROPPABLE)}. Got {unknown}.")
    if o.special not in SPECIAL_MODES:
        raise CaptureError(f"--special must be one of {list(SPECIAL_MODES)}. Got {o.special!r}.")
    if o.p_max is not None and o.p_quantile is not None:
        raise CaptureError("give --p-max or --p-quantile, not both")
    if o.r_max is not None and o.r_quantile is not None:
        raise CaptureError("give --r-max or --r-quantile, not both")
    for name, q in (("--p-quantile", o.p_quantile), ("--r-quantile", o.r_quantile)):
        if q is not None and not 0 < q <= 1:
            raise CaptureError(f"{name} must be in (0, 1], e.g. 0.99. Got {q}.")
    for name, v in (("--p-max", o.p_max), ("--r-max", o.r_max)):
        if v is not None and v < 1:
            raise CaptureError(f"{name} must be a positive int. Got {v}.")
    if o.generate < 0:
        raise CaptureError(f"--generate must be a non-negative int. Got {o.generate}.")
    if o.generate and o.r_quantile is not None:
        raise CaptureError(
            "--r-quantile needs responses in the data; with --generate N the response budget is N (or --r-max)"
        )
    if o.commit_mb <= 0:
        raise CaptureError(f"--commit-mb must be positive. Got {o.commit_mb}.")
    if not 0 <= o.writer_nice <= 19:
        raise CaptureError(f"--writer-nice must be an int in 0..19. Got {o.writer_nice}.")
    if o.zarr_format not in spec.ZARR_FORMATS:
        raise CaptureError(f"--zarr-format must be one of {list(spec.ZARR_FORMATS)}. Got {o.zarr_format}.")
    if o.shard_examples != spec.SHARD_EXAMPLES_AUTO:
        if not isinstance(o.shard_examples, int) or o.shard_examples < 1:
            raise CaptureError(f"--shard-examples must be a positive int. Got {o.shard_examples}.")
        if o.zarr_format != 3:
            raise CaptureError("--shard-examples (Zarr sharding) needs --zarr-format 3")


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
    try:
        if o.engine == "ray":
            from actstore.capture.engines import run_ray

            results = run_ray(o, len(source), run_shard)
        elif o.workers > 1:
            results = _run_workers(o, len(source))
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
    plan = _text_plan(o, lm, source) if lm.modality == "text" else None
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
            drop_cls="cls" in o.drop,
        )
    finally:
        if own_bar is not None:
            own_bar.close()


def _run_windows(o: WriteOptions, rank: int, world: int, source: Source, progress: Any, n_done: int) -> RecordResult:
    """--pack / --chunk: this rank's slice of the corpus's windows (actstore.capture.packing)."""
    from actstore.capture.packing import RUNS_TEXT, plan_windows, window_batches

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


def _text_plan(o: WriteOptions, lm: LoadedModel, source: Source) -> TextPlan:
    kind = source.kind
    if o.chat_template and kind != "pair":
        raise CaptureError("--chat-template wraps prompts: use it with prompt/response data or --generate N")
    if o.generate and not lm.is_decoder:
        raise CaptureError(f"--generate needs a causal language model; {lm.model_id} is not one")
    plan = TextPlan(
        kind=kind,
        p_max=o.p_max or 1,
        r_max=0,
        special=o.special,
        chat_template=o.chat_template,
        generate=o.generate,
        drop_bos="bos" in o.drop,
        separator=o.separator,
    )
    stored = _stored_budgets(o) if o.resume and o.p_max is None and o.r_max is None else None
    if stored is not None:  # a resume keeps the store's budgets and chunks (measured on the first run)
        return replace(plan, p_max=stored[0], r_max=stored[1] if kind == "pair" else 0, t_chunk=stored[2])
    lengths = None
    if o.p_max is None:  # measured: a high quantile of the lengths, not a fixed budget mostly padding
        lengths = prompt_lengths(lm.tokenizer, plan, source)
        q = DEFAULT_QUANTILE if o.p_quantile is None else o.p_quantile
        plan = replace(plan, p_max=max(1, int(np.quantile(lengths, q, method="higher"))))
    if kind == "pair":
        r_max = o.r_max or o.generate
        if not r_max:
            from actstore.capture.prepare import response_lengths

            q = DEFAULT_QUANTILE if o.r_quantile is None else o.r_quantile
            r_max = max(1, int(np.quantile(response_lengths(lm.tokenizer, plan, source), q, method="higher")))
        plan = replace(plan, r_max=r_max)
    total = plan.p_max + plan.r_max
    if lm.max_tokens and total > lm.max_tokens:
        if o.p_max is not None:
            raise CaptureError(
                f"--p-max + --r-max = {total} tokens exceeds {lm.model_id}'s context of {lm.max_tokens} tokens"
            )
        plan = replace(plan, p_max=max(1, lm.max_tokens - plan.r_max))  # a default or quantile budget: fit the context
    if lengths is not None:  # chunks sized to the measured lengths, not to the budget
        plan = replace(plan, t_chunk=measured_t_chunk(lengths, plan.p_max))
    return plan


def _stored_budgets(o: WriteOptions) -> tuple[int, int, int] | None:
    """(p_max, r_max, text or prompt t_chunk) of the store being resumed, or None (no store yet)."""
    storage = open_storage(o.store)
    if not catalog.has_identity(storage):
        return None
    segs = catalog.read_identity(storage).segments
    return segs[0].t_max, (segs[1].t_max if len(segs) > 1 else 0), segs[0].t_chunk


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


# ---- worker processes -------------------------------------------------------------
def _run_workers(o: WriteOptions, n: int) -> list[RecordResult]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # torch and threads: never fork a process that runs torch
    q = ctx.Queue()
    threads = o.threads or max(1, (os.cpu_count() or 1) // o.workers)
    wo = replace(o, threads=threads, progress=False)
    procs = [ctx.Process(target=_worker_main, args=(wo, r, q), name=f"actstore-writer-{r}") for r in range(o.workers)]
    total = bar_total(o, n)
    if o.progress:
        print(f"starting {o.workers} writer processes (each loads {o.model}) ...", file=sys.stderr, flush=True)
    for p in procs:
        p.start()
    bar = Progress(total=total, desc=f"{o.workers} writers", disable=not o.progress)
    results: dict[int, RecordResult] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < o.workers:
            try:
                msg = q.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(procs):  # a writer killed from outside sends nothing
                    if not p.is_alive() and r not in results and r not in errors and q.empty():
                        errors[r] = f"died without a word (exit code {p.exitcode}); rerun with --resume"
                continue
            if msg[0] == "progress":
                bar.update(*msg[1:])
            elif msg[0] == "io":
                bar.io(msg[2], who=msg[1])
            elif msg[0] == "done":
                results[msg[1]] = msg[2]
            else:
                errors[msg[1]] = msg[2]
    finally:
        bar.close()
        for p in procs:
            p.join(timeout=None if not errors else 5)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        by_msg: dict[str, list[int]] = {}
        for r, m in sorted(errors.items()):
            by_msg.setdefault(m, []).append(r)
        raise CaptureError(
            "; ".join(f"writer{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_msg.items())
        )
    return [results[r] for r in range(o.workers)]


def _worker_main(o: WriteOptions, rank: int, q: Any) -> None:
    """Entry point of a writer process: write one shard, report progress and the result."""
    try:
        res = run_shard(o, rank, o.workers, progress=_QueueProgress(q, rank))
        q.put(("done", rank, res))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        q.put(("error", rank, str(e) or type(e).__name__))


class _QueueProgress:
    def __init__(self, q: Any, rank: int):
        self.q = q
        self.rank = rank

    def update(self, examples: int, tokens: int, nbytes: int) -> None:
        self.q.put(("progress", examples, tokens, nbytes))

    def io(self, stats: Any) -> None:
        self.q.put(("io", self.rank, stats))
