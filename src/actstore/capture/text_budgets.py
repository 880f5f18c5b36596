"""Token budgets and token chunks of text segments: measured from the data (a high quantile
of the lengths), given (--p-max, --r-max), or kept from the store being resumed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from actstore import catalog
from actstore.inputs.data import Source
from actstore.inputs.models import LoadedModel
from actstore.inputs.prepare import TextPlan, prompt_lengths
from actstore.capture.write_options import WriteOptions
from actstore.errors import CaptureError
from actstore.storage import open_storage

DEFAULT_QUANTILE = 0.99  # default token budgets: this quantile of the measured lengths
MIN_T_CHUNK = 16


def measured_t_chunk(lengths: Any, budget: int) -> int:
    """Token chunk of a variable-length segment whose lengths were measured: the smallest
    power of two >= the median length (at least MIN_T_CHUNK), at most the budget. Most
    reads then touch one chunk holding little padding: in benchmarks/bench_spec.py's
    matrix (docs/spec-answers.md) it gave the lowest prompt read latency at every width."""
    median = max(1, int(np.ceil(np.median(np.asarray(lengths)))))
    return min(int(budget), max(MIN_T_CHUNK, 1 << (median - 1).bit_length()))


def text_plan(o: WriteOptions, lm: LoadedModel, source: Source) -> TextPlan:
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
    stored = stored_budgets(o) if o.resume and o.p_max is None and o.r_max is None else None
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
            from actstore.inputs.prepare import response_lengths

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


def stored_budgets(o: WriteOptions) -> tuple[int, int, int] | None:
    """(p_max, r_max, text or prompt t_chunk) of the store being resumed, or None (no store yet)."""
    storage = open_storage(o.store)
    if not catalog.has_identity(storage):
        return None
    segs = catalog.read_identity(storage).segments
    return segs[0].t_max, (segs[1].t_max if len(segs) > 1 else 0), segs[0].t_chunk
