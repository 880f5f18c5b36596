"""record(): run a model over batches and write the hooked activations to one store shard.

The forward pass runs on the calling thread; each hooked output is reduced and copied on
the model's device as it is produced (actstore.capture.stage) and a background thread
appends the batches to a ShardWriter (actstore.capture.writeside). The forward pass waits only
when the writer is `queue_size` batches behind. actstore.capture.loop has the loop.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Unpack

from actstore.capture import family, loop, proof, wrappers
from actstore.capture.hooks import resolve_hooks
from actstore.capture.loop import RecordResult
from actstore.capture.options import CaptureOptions, OldRecordSettings, make_options
from actstore.capture.segments import check_lengths
from actstore.capture.target import CaptureTarget
from actstore.capture.writeside import Job, ShardContents
from actstore.errors import CaptureError
from actstore.inputs.models import LoadedModel, wrap_module
from actstore.write.pipeline import IOStats

__all__ = ["RecordResult", "committed", "record"]


def committed(store: str | os.PathLike, shard: int = 0) -> tuple[int, bool]:
    """(examples committed, shard complete) of a writer shard; (0, False) if it does not exist."""
    return CaptureTarget(store).committed(shard)


def record(
    model: Any,
    batches: Iterable[Any],
    store: str | os.PathLike,
    options: CaptureOptions | None = None,
    *,
    shard: int = 0,
    segments: Mapping[str, int] | None = None,
    t_chunk: Mapping[str, int] | None = None,
    token_labels: bool | Mapping[int, str] = False,
    texts: Sequence[str] = (),
    model_id: str | None = None,
    attrs: Mapping[str, Any] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    io_progress: Callable[[IOStats], None] | None = None,
    **settings: Unpack[OldRecordSettings],
) -> RecordResult | list[RecordResult]:
    """Record the residual stream (or named modules) of `model` over `batches` into a shard.

    Args:
        model: a torch module (HF transformers model), a LoadedModel from load_model, an
            nnsight LanguageModel or a TransformerLens TransformerBridge around an HF model
            (actstore.capture.wrappers: the same site names give the same tensors); a list
            of them (models of one tokenizer) records each over the same batches into one
            aligned family at `store` (docs/format.md, section 9), as do sites of several
            widths (measured on the first batch): one member store per (model, width).
        batches: CaptureBatch objects, dicts of forward kwargs, or tensors (float:
            pixel_values, int: input_ids), moved to the model's device. Plain batches store
            every token (one fixed segment: every batch of one length) unless `segments`
            is given: then each example keeps the tokens its `attention_mask` marks (every
            token without one), zero-padded to the budget.
        store: the store root (a folder or an object-store URL).
        options: a CaptureOptions; `settings` (its field names, typed by
            actstore.capture.options.RecordSettings) override its fields. The ones record()
            reads: layers (block numbers, layer N = output of block N =
            hidden_states[N + 1], or module paths / TransformerLens names), dtype (stored:
            float16, bfloat16, float32), stats, on_overflow ("raise" or "clip"),
            token_ids (keep each token's vocabulary id; None: when batches carry
            input_ids), zarr_format and shard_examples (the layout, as in ShardWriter),
            commit_bytes, fsync, resume (continue after the shard's committed examples;
            `batches` must start after them, see committed()), queue_size (batches the
            writer may lag behind; the ring holds queue_size + 2 batches of host memory),
            writer_threads, writer_nice (0..19: the writer threads' priority drop),
            stop_early, world_size (of a distributed run: this shard is rank `shard`), and
            runner ("local", or "ray": `workers` writer actors on a Ray cluster at
            ray_address, each reserving cpus_per_worker and gpus_per_worker, write shards
            0..workers-1 from contiguous slices of a list of batches; `model` may then be a
            model spec for load_model or a callable returning the model).
        shard: this writer's shard number.
        segments: {name: T_max} of zero-padded segments (texts); None for one fixed segment.
        t_chunk: {segment: token chunk length} for some of `segments`.
        token_labels, texts: as in ShardWriter (CaptureBatch supplies the values); token
            labels are token kinds: True for 0 content, 1 special, 2 chat template, or a
            {label: name} of the kinds the batches use (e.g. with 3 "first": the first
            position of a text whose tokenizer has no BOS, actstore.inputs.prepare).
            record() takes batches, not raw texts: token 0 is what the batches hold
            (text_batches with a TextPlan from choose_bos makes it a labelled BOS).
        model_id, attrs: metadata for the store (model_id: by default one that resolves to
            a tokenizer: embedded:..., a hub id or a folder holding one).
        progress: called on the writer thread with (examples, tokens, bytes) per batch.
        io_progress: called with the writer's IOStats after each batch.

    Returns:
        A RecordResult (with runner="ray", one per writer, in rank order; of a family, one
        per member, in the order of its record). The shard is
        closed (complete) when every batch was written. A call that fails after it wrote
        to the store adds a note to the error saying what it left (the shard and its
        committed examples) and how to go on: resume=True with the batches after the
        committed ones (committed()), or remove the store.
    """
    opts = make_options(options, _renamed(dict(settings)))
    opts.check(names="python")
    contents = ShardContents(
        segments=dict(segments) if segments else None,
        t_chunk=dict(t_chunk) if t_chunk else None,
        token_labels=token_labels,
        texts=tuple(texts),
        attrs=dict(attrs or {}),
    )
    if opts.runner == "ray":
        if isinstance(model, (list, tuple)):
            raise CaptureError("runner='ray' records one model; record a family of models with the local runner")
        return _record_ray(model, batches, store, opts, shard, progress, contents, model_id)
    if isinstance(model, (list, tuple)):  # several models on the same tokens: a family
        passed = _passed(opts, shard, contents, progress, io_progress)
        return _family(list(model), list(batches), store, opts, model_id, {}, passed)
    return record_shard(model, batches, store, opts, shard, contents, model_id, progress, io_progress)


def _passed(opts: CaptureOptions, shard: int, contents: ShardContents, progress: Any, io_progress: Any) -> dict:
    """What each member's record() gets when this call records a family."""
    return {
        "options": opts, "shard": shard, "segments": contents.segments, "t_chunk": contents.t_chunk,
        "token_labels": contents.token_labels, "texts": contents.texts, "attrs": contents.attrs,
        "progress": progress, "io_progress": io_progress,
    }  # fmt: skip


def record_shard(
    model: Any,
    batches: Iterable[Any],
    store: Any,
    opts: CaptureOptions,
    shard: int,
    contents: ShardContents,
    model_id: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    io_progress: Callable[[IOStats], None] | None = None,
) -> Any:
    """record() on this process, from checked options and the shard's contents as one value
    (what `actstore write`'s writers call with their Share: actstore.capture.run)."""
    lm = model if isinstance(model, LoadedModel) else wrap_module(wrappers.unwrap(model), model_id=model_id)
    # unknown layers fail before anything is written; a TransformerBridge's sites are its hook points
    points = wrappers.hook_points(model)
    hooks = resolve_hooks(lm.forward, opts.layers, points)
    if family.may_differ([hp.name for hp in hooks]):  # module paths: widths measured on batch 0
        batches, widths = family.widths_on_first(lm, hooks, batches)
        if len(widths) > 1:  # several widths: a family of one member per width
            passed = _passed(opts, shard, contents, progress, io_progress)
            return _family([lm], list(batches), store, opts, model_id, {}, passed)
    if contents.segments is None and isinstance(batches, Sequence):
        check_lengths(batches, opts.drop_cls)  # one length, checked before anything is written
    job = Job(
        target=CaptureTarget.of(store),
        shard=shard,
        hooks=hooks,
        lm=lm,
        opts=opts,
        contents=contents,
        model_id=model_id or lm.model_id,
        token_ids=bool(opts.token_ids),
    )
    if not opts.resume:  # what an earlier run left: refused, naming resume=True and removing it
        job.target.check_fresh([shard], resume="resume=True")
    batches = proof.before_capture(model, lm, hooks, batches, points, job.contents.attrs)  # each site checked first
    before = (job.target.holds(shard), job.target.committed(shard))
    try:
        return loop.run(job, batches, progress, io_progress)
    except BaseException as e:
        _say_what_is_left(e, job.target, shard, before)
        raise


def _family(
    models: list[Any],
    batches: list[Any],
    store: str | os.PathLike,
    opts: CaptureOptions,
    model_id: str | None,
    settings: Mapping[str, Any],
    passed: dict[str, Any],
) -> list[RecordResult]:
    """record() of several models or widths into one aligned family (actstore.capture.family):
    each member recorded by record() with the arguments this call was `passed`."""
    rest = {k: v for k, v in settings.items() if k not in ("layers", "resume")}
    return family.record_family(
        models,
        batches,
        store,
        opts.layers,
        record,
        model_id=model_id,
        resume=opts.resume,
        record_options={**passed, **rest},
    )


def _say_what_is_left(e: BaseException, target: CaptureTarget, shard: int, before: tuple[Any, ...]) -> None:
    """Add to `e` (a note: its traceback shows it, the CLI prints it) what this failed call
    left in the store and how to go on, when it changed the shard. (The CLI says --resume
    for resume=True: actstore.cli.wording.)"""
    try:
        if (target.holds(shard), target.committed(shard)) == before:
            return  # (e.g. a refused rerun: the shard is as it was)
        note = target.left_behind([shard], "resume=True")
    except Exception:  # noqa: BLE001 - the store cannot be read now: the error itself says more
        return
    if note:
        e.add_note(note)


def _renamed(settings: dict[str, Any]) -> dict[str, Any]:
    """Old keyword spellings, kept one release: engine= (the runner), drop_cls=."""
    out = dict(settings)
    if "engine" in out:
        warnings.warn("record(engine=...) is deprecated; use runner=", DeprecationWarning, stacklevel=3)
        out["runner"] = out.pop("engine")
    if out.pop("drop_cls", False):
        out["drop"] = (*out.get("drop", ()), "cls")
    if "layers" in out:
        out["layers"] = tuple(out["layers"])
    return out


def _record_ray(
    model: Any,
    batches: Any,
    store: Any,
    opts: CaptureOptions,
    shard: int,
    progress: Callable[[int, int, int], None] | None,
    contents: ShardContents,
    model_id: str | None,
) -> list[RecordResult]:
    """record(runner="ray"): the writers as Ray actors (actstore.capture.runner_ray)."""
    from dataclasses import replace

    from actstore.capture.runner_ray import RaySettings, record_ray

    if shard != 0 or opts.world_size is not None:
        raise ValueError(
            "record(runner='ray') writes shards 0..workers-1 (world size `workers`): leave shard and world_size out"
        )
    settings = RaySettings(
        workers=opts.workers,
        address=opts.ray_address,
        cpus_per_worker=opts.cpus_per_worker,
        gpus_per_worker=opts.gpus_per_worker,
        progress=False,
    )
    results = record_ray(
        record, model, batches, store, settings, replace(opts, runner="local"), contents, model_id, callback=progress
    )
    return [
        res
        if isinstance(res, RecordResult)
        else RecordResult(
            shard=r, n_before=res, n_written=0, tokens=0, nbytes=0, seconds=0.0, forward_seconds=0.0, wait_seconds=0.0
        )  # a complete shard
        for r, res in enumerate(results)
    ]
