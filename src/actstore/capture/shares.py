"""One writer's share of `actstore write`: its batches and what its shard holds.

`image_or_text` (images, texts, prompt/response pairs) and `windows` (a corpus in
--pack/--chunk windows) turn the options, the loaded model and the data into a `Share`:
the batches of this rank's slice (after the examples a resume finds committed) and the
shard's contents as one value (`ShardContents`: the segments and texts of the store, and
the attrs that record how it was captured), which record's Job keeps as it is.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from actstore.capture.options import CaptureOptions
from actstore.capture.ranks import split
from actstore.capture.target import CaptureTarget
from actstore.capture.writeside import ShardContents
from actstore.errors import CaptureError
from actstore.inputs.data import Source, absolute_data
from actstore.inputs.models import LoadedModel
from actstore.layout.spec import FIRST_KIND, TOKEN_KIND_NAMES


@dataclass
class Share:
    """One writer's share: its batches and what its shard holds."""

    batches: Iterable[Any]
    total: int | None  # examples (windows) this writer has left, for its progress bar
    contents: ShardContents


def _capture_attrs(o: CaptureOptions, world: int, **more: Any) -> dict[str, Any]:
    return {"batch_size": o.batch_size, "model_dtype": o.model_dtype, "world_size": world, **more}


def image_or_text(
    o: CaptureOptions, lm: LoadedModel, source: Source, target: CaptureTarget, rank: int, world: int, n_done: int
) -> Share:
    from actstore.inputs.budgets import text_plan
    from actstore.inputs.prepare import TextPlan, choose_bos, default_system, image_batches, text_batches

    check_modality(lm, source)
    if lm.modality == "text" and o.generate and source.kind == "text":
        source = _as_prompts(source)  # texts become the prompts to respond to
    start, stop = split(len(source), world, rank)
    first = min(start + n_done, stop)
    attrs = {"source": source.name, "dataset": absolute_data(o.data)}
    if lm.modality != "text":
        attrs["capture"] = _capture_attrs(o, world, special=None, chat_template=False, generate=0)
        batches = image_batches(source, first, stop, lm.image, o.batch_size, lm.device)
        return Share(batches, stop - first, ShardContents(texts=("image",), attrs=attrs))
    plan = TextPlan(
        kind=source.kind,
        p_max=1,
        special=o.special,
        chat_template=o.chat_template,
        system=o.system,
        generate=o.generate,
        temperature=o.temperature,
        top_p=o.top_p,
        seed=o.seed,
        drop_bos=o.drop_bos,
        separator=o.separator,
    )
    bos = choose_bos(lm.tokenizer, plan, o.bos, None if o.chat_template else lm.document_bos)
    if o.resume:
        check_resumed_bos(target, bos.to_json())
    plan = bos.apply(plan)
    stored = target.stored_budgets() if o.resume else None
    plan = text_plan(
        lm, source, plan, p_max=o.p_max, r_max=o.r_max, p_quantile=o.p_quantile, r_quantile=o.r_quantile, stored=stored
    )
    system = o.system
    if o.chat_template and system is None:
        added = default_system(lm.tokenizer)
        if added is not None and rank == 0:  # printed even with --quiet: the prompts hold text the data did not
            print(
                f"--chat-template: the template adds its own system turn ({added.strip()[:80]!r}); "
                "--system TEXT sets another, --no-system leaves it out",
                file=sys.stderr,
                flush=True,
            )
        system = added
    attrs["capture"] = _capture_attrs(
        o, world, special=o.special, chat_template=o.chat_template, system=system, generate=o.generate
    )
    if o.sampling:
        attrs["capture"]["sampling"] = o.sampling
    attrs["capture"]["bos"] = bos.to_json()
    batches = text_batches(source, first, stop, lm.tokenizer, plan, o.batch_size, lm.device, model=lm.model)
    kinds = {**TOKEN_KIND_NAMES, **(FIRST_KIND if plan.label_first else {})}
    contents = ShardContents(
        segments=plan.segments,
        t_chunk=plan.t_chunks,
        token_labels=kinds if o.special == "mask" else False,
        texts=plan.texts,
        attrs=attrs,
    )
    return Share(batches, stop - first, contents)


def windows(
    o: CaptureOptions, lm: LoadedModel, source: Source, target: CaptureTarget, rank: int, world: int, n_done: int
) -> Share:
    """--pack / --chunk: this rank's slice of the corpus's windows (actstore.inputs.packing)."""
    from actstore.inputs.packing import RUNS_TEXT, plan_windows, window_batches

    if lm.modality != "text":
        raise CaptureError(f"--pack and --chunk take a language model; {lm.model_id} takes {lm.modality} input")
    if lm.max_tokens and o.context > lm.max_tokens:
        raise CaptureError(f"--context {o.context} exceeds {lm.model_id}'s context of {lm.max_tokens} tokens")
    wins = plan_windows(source, lm.tokenizer, o.context, "pack" if o.pack else "chunk", window_bos=o.window_bos)
    start, stop = split(len(wins), world, rank)
    if start == stop:
        raise CaptureError(
            f"the corpus makes {len(wins)} windows of {o.context} tokens: too few for {world} writers; use fewer writers"
        )
    first = min(start + n_done, stop)
    attrs = {
        "source": source.name,
        "dataset": absolute_data(o.data),
        "capture": _capture_attrs(o, world, special=o.special),
        "packing": {
            "mode": wins.mode,
            "context": o.context,
            "documents": len(source),
            "tokens": wins.n_tokens,
            "windows": len(wins),
            "separator": lm.tokenizer.eos_token,
            "window_bos": wins.bos,
            "runs": f"text field {RUNS_TEXT!r}: [document, key, offset, length]",
        },
    }
    batches = window_batches(
        source, wins, first, stop, lm.tokenizer, o.batch_size, lm.device, drop_bos=o.drop_bos, special=o.special
    )
    contents = ShardContents(
        segments={"tokens": o.context}, token_labels=o.special != "keep", texts=(RUNS_TEXT,), attrs=attrs
    )
    return Share(batches, stop - first, contents)


def check_resumed_bos(target: CaptureTarget, choice: dict[str, Any]) -> None:
    """A resume makes token 0 as the store's first run did (a store written before --bos
    existed made it as --bos never does)."""
    cfg = target.identity()
    if cfg is None:
        return
    was = cfg.attrs.get("capture", {}).get("bos") or {"option": "never", "prepended": False, "first_labelled": False}
    if (was.get("prepended"), was.get("first_labelled")) != (choice["prepended"], choice["first_labelled"]):
        raise CaptureError(
            f"{target.url} was captured with --bos {was.get('option')} (token 0: {was.get('token_0', 'as tokenized')}); "
            f"resume it with --bos {was.get('option')}, or write to a new path"
        )


def check_modality(lm: LoadedModel, source: Source) -> None:
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
