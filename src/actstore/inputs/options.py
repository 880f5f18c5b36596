"""InputOptions: what a capture reads and how the model runs over it (the model, the data,
texts and their budgets, corpora in windows), one frozen part of actstore.capture's
CaptureOptions. Each field's default and help are spelled once, here (actstore.optionspec);
`actstore write` offers each as an option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from actstore.errors import CaptureError
from actstore.layout import spec
from actstore.optionspec import check_positive, is_int, is_number, option
from actstore.write.options import WHAT

MODEL, DATA, TEXTS, WINDOWS = (
    "The model",
    "The data",
    "Texts, prompts and responses",
    "Corpora in context windows",
)
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DECODE_ERRORS = ("strict", "replace", "skip")

_MODEL_HELP = (
    "A local model folder, a hub id, or embedded:dinov2-s14 | embedded:smollm2-135m | embedded:minilm-l6. "
    "`actstore write` takes it twice or more (text models of one tokenizer: a base model and its fine-tune): every "
    "model over the same examples into one aligned family of stores (docs/capture.md)."
)
_DATA_HELP = (
    'A folder of images, a .jsonl of texts ({"text"}) or pairs ({"prompt", "response"}), a .txt file (a document '
    "a line), a glob of files ('corpus/*.txt': a document a file; quote it), a .parquet or .arrow file, a datasets "
    "save_to_disk folder, or embedded:images | embedded:pydoc-topics."
)
_ERRORS_HELP = (
    "A .txt document that does not decode: fail before the model loads (strict), replace its undecodable bytes "
    "with U+FFFD (replace), or leave it out (skip); replace and skip print how many documents they touched."
)
_BOS_HELP = (
    "Token 0 of each text or prompt (not --pack/--chunk: see --no-window-bos): auto prepends the tokenizer's BOS, "
    "labelled special, unless the tokenizer or chat template adds it (a tokenizer without BOS: the first position "
    "is labelled 'first'); both are left out by the default mask, so the model's attention sink does not count as "
    "content. always: as auto, refusing a tokenizer without BOS; never: the text as tokenized."
)
_WINDOW_BOS_HELP = (
    "--pack / --chunk: do not start each window with the tokenizer's BOS (by default every window starts with it, "
    "or with its EOS when it has no BOS, labelled special, followed by --context - 1 corpus tokens)."
)


@dataclass(frozen=True, kw_only=True)
class InputOptions:
    """The model, the data and how texts become examples (`actstore write --help`)."""

    # -- the model --
    model: str | None = option(None, _MODEL_HELP, section=WHAT, required=True)
    data: str | None = option(None, _DATA_HELP, section=WHAT, required=True)
    device: str = option(
        "cpu",
        "cpu, cuda or cuda:N (N among the CUDA devices torch sees here, or on each Ray worker).",
        section=MODEL,
        kind="device",
        show_default=True,
    )
    model_dtype: str = option(
        "float32", "The dtype the model computes in.", section=MODEL, choices=MODEL_DTYPES, show_default=True
    )
    batch_size: int = option(8, "Examples per forward pass.", section=MODEL, show_default=True)
    threads: int | None = None  # torch's CPU threads in a writer process (None: torch's default)
    # -- the data --
    max_examples: int | None = option(None, "Capture only the first N examples of the data.", section=DATA)
    text_field: str | None = option(
        None,
        "The JSON key or column holding each document's text (.jsonl, .parquet, .arrow, a datasets folder; "
        "default text).",
        section=DATA,
    )
    encoding: str = option(
        "utf-8", "Encoding of .txt documents (e.g. latin-1, cp1252).", section=DATA, show_default=True
    )
    errors: str = option("strict", _ERRORS_HELP, section=DATA, choices=DECODE_ERRORS, show_default=True)
    # -- texts: budgets, prompts and responses --
    p_max: int | None = option(
        None,
        "Token budget of a text or prompt (default: the 0.99 quantile of the measured lengths); longer ones are "
        "truncated and counted.",
        section=TEXTS,
    )
    r_max: int | None = option(
        None,
        "Token budget of a response (default: the 0.99 quantile of the measured lengths, or N with --generate N).",
        section=TEXTS,
    )
    p_quantile: float | None = option(
        None, "Choose --p-max as this quantile of the prompt lengths, e.g. 0.99.", section=TEXTS
    )
    r_quantile: float | None = option(None, "Choose --r-max as this quantile of the response lengths.", section=TEXTS)
    separator: str = option(
        "\n",
        "Pairs without --chat-template: the text between prompt and response (its tokens end the prompt, labelled "
        "template; '' for none).",
        section=TEXTS,
        show_default="newline",
    )
    bos: str = option("auto", _BOS_HELP, section=TEXTS, choices=spec.BOS_MODES, show_default=True)
    chat_template: bool = option(False, "Wrap prompts in the tokenizer's chat template.", section=TEXTS)
    system: str | None = option(  # None: the template's own default; "": no system prompt (--no-system)
        None,
        "With --chat-template: the system prompt (default: whatever the template adds by itself, named on stderr "
        "when it adds one).",
        section=TEXTS,
    )
    generate: int = option(
        0,
        "Generate N response tokens per prompt (greedy unless --temperature) instead of reading responses; data "
        'that gives a "response" is refused (leave out --generate to capture it).',
        section=TEXTS,
        show_default=True,
    )
    temperature: float = option(
        0.0, "With --generate: sample at this temperature (0: greedy).", section=TEXTS, low=0.0, show_default=True
    )
    top_p: float = option(
        1.0,
        "With --generate and --temperature: nucleus sampling's probability mass.",
        section=TEXTS,
        low=0.0,
        high=1.0,
        open_low=True,
        show_default=True,
    )
    seed: int = option(
        0,
        "With --generate and --temperature: batch k samples from SEED + its first example's index (reproducible, "
        "whatever the writers).",
        section=TEXTS,
        show_default=True,
    )
    # -- corpora in windows --
    pack: bool = option(
        False,
        "Concatenate the documents (tokenizer's BOS/EOS between them) into windows of exactly --context tokens: "
        "every token stored once.",
        section=WINDOWS,
    )
    chunk: bool = option(
        False,
        "Cut each document into consecutive windows of at most --context tokens (no truncation, no window spans "
        "documents).",
        section=WINDOWS,
    )
    context: int | None = option(None, "Window length in tokens for --pack / --chunk.", section=WINDOWS)
    window_bos: bool = option(True, _WINDOW_BOS_HELP, section=WINDOWS)

    @property
    def sampling(self) -> dict[str, Any] | None:
        """--generate's settings as recorded in the store's attrs (None without --generate)."""
        if not self.generate:
            return None
        return {
            "max_new_tokens": self.generate,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def check_inputs(self, n: Any) -> None:
        """Reject contradictory input settings, named by `n` (a field name -> the caller's spelling)."""
        check_positive(self, ("batch_size",), n, CaptureError)
        check_positive(self, _OPTIONAL_POSITIVE, n, CaptureError, optional=True)
        if not is_int(self.generate) or self.generate < 0:
            raise CaptureError(f"{n('generate')} must be a non-negative int. Got {self.generate!r}.")
        if self.bos not in spec.BOS_MODES:
            raise CaptureError(f"{n('bos')} must be one of {list(spec.BOS_MODES)}. Got {self.bos!r}.")
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise CaptureError(
                f"{n('temperature')} must be a finite number >= 0 (0: greedy). Got {self.temperature!r}."
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise CaptureError(f"{n('top_p')} must be a number in (0, 1] (1: no nucleus cut). Got {self.top_p!r}.")
        if (self.temperature or self.top_p != 1.0) and not self.generate:
            raise CaptureError(f"{n('temperature')} and {n('top_p')} sample the responses of {n('generate')} N")
        if self.system is not None and not self.chat_template:
            raise CaptureError(
                f"{n('system')} sets the system prompt of {n('chat_template')}; add {n('chat_template')}"
            )


_OPTIONAL_POSITIVE = ("threads", "max_examples", "p_max", "r_max", "context")
