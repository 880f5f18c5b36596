"""Token budgets and token chunks of text segments: measured from the data (a high quantile
of the lengths), given (p_max, r_max), or kept from the store being resumed.

Plain parameters in, a TextPlan out: the capture (actstore write) says what it was given
and what the store it resumes holds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from actstore.errors import CaptureError
from actstore.inputs.data import Source
from actstore.inputs.models import LoadedModel
from actstore.inputs.prepare import TextPlan, prompt_lengths, response_lengths

DEFAULT_QUANTILE = 0.99  # default token budgets: this quantile of the measured lengths
MIN_T_CHUNK = 16


def measured_t_chunk(lengths: Any, budget: int) -> int:
    """Token chunk of a variable-length segment whose lengths were measured: the smallest
    power of two >= the median length (at least MIN_T_CHUNK), at most the budget. Most
    reads then touch one chunk holding little padding: in benchmarks/bench_spec.py's
    matrix (docs/spec-answers.md) it gave the lowest prompt read latency at every width."""
    median = max(1, int(np.ceil(np.median(np.asarray(lengths)))))
    return min(int(budget), max(MIN_T_CHUNK, 1 << (median - 1).bit_length()))


def text_plan(
    lm: LoadedModel,
    source: Source,
    plan: TextPlan,
    *,
    p_max: int | None = None,
    r_max: int | None = None,
    p_quantile: float | None = None,
    r_quantile: float | None = None,
    stored: tuple[int, int, int] | None = None,
) -> TextPlan:
    """`plan` (its kind, special tokens, template, generation) with its budgets and chunk.

    Args:
        lm: the model (its tokenizer measures the lengths; its context caps the budgets).
        source: the data (texts or pairs).
        plan: how texts become tokens; its p_max, r_max and t_chunk are set here.
        p_max, r_max: given budgets (--p-max, --r-max); None: measured.
        p_quantile, r_quantile: the quantile of the measured lengths (default 0.99).
        stored: (p_max, r_max, t_chunk) of the store being resumed: kept as they are.
    """
    kind = source.kind
    if plan.chat_template and kind != "pair":
        raise CaptureError("--chat-template wraps prompts: use it with prompt/response data or --generate N")
    if plan.generate and not lm.is_decoder:
        raise CaptureError(f"--generate needs a causal language model; {lm.model_id} is not one")
    plan = replace(plan, kind=kind, p_max=p_max or 1, r_max=0)
    if stored is not None and p_max is None and r_max is None:  # a resume keeps the store's budgets and chunks
        return replace(plan, p_max=stored[0], r_max=stored[1] if kind == "pair" else 0, t_chunk=stored[2])
    lengths = None
    if p_max is None:  # measured: a high quantile of the lengths, not a fixed budget mostly padding
        lengths = prompt_lengths(lm.tokenizer, plan, source)
        q = DEFAULT_QUANTILE if p_quantile is None else p_quantile
        plan = replace(plan, p_max=max(1, int(np.quantile(lengths, q, method="higher"))))
    if kind == "pair":
        budget = r_max or plan.generate
        if not budget:
            q = DEFAULT_QUANTILE if r_quantile is None else r_quantile
            budget = max(1, int(np.quantile(response_lengths(lm.tokenizer, plan, source), q, method="higher")))
        plan = replace(plan, r_max=budget)
    total = plan.p_max + plan.r_max
    if lm.max_tokens and total > lm.max_tokens:
        if p_max is not None:
            raise CaptureError(
                f"--p-max + --r-max = {total} tokens exceeds {lm.model_id}'s context of {lm.max_tokens} tokens"
            )
        plan = replace(plan, p_max=max(1, lm.max_tokens - plan.r_max))  # a default or quantile budget: fit the context
    if lengths is not None:  # chunks sized to the measured lengths, not to the budget
        plan = replace(plan, t_chunk=measured_t_chunk(lengths, plan.p_max))
    return plan
