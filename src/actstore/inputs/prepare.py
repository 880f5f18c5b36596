"""Records -> model inputs: images resized and normalised, texts tokenised with masks.

Token labels (stored as the store's per-token uint8 `token_labels` when special tokens
are masked): 0 = content, 1 = special token (BOS, EOS, pad, ...), 2 = chat-template text,
3 = the first position of a text whose tokenizer has no BOS (`first`).

Token 0 of a text or prompt (`--bos`, `BosChoice`): the tokenizer's BOS, prepended when the
tokenizer (or the chat template) does not add one itself (auto, always), so that the model's
attention sink is a labelled special token the default mask leaves out; without a BOS token
the first position is labelled `first` (auto). `never` stores the text as tokenized.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.errors import CaptureError
from actstore.inputs.data import Source, load_image
from actstore.inputs.models import ImageSpec
from actstore.layout.spec import BOS_MODES, FIRST_KIND, FIRST_LABEL

CONTENT, SPECIAL, TEMPLATE, FIRST = 0, 1, 2, FIRST_LABEL
TOKEN_LABEL_MEANING = {"0": "content", "1": "special token", "2": "chat template"}
FIRST_MEANING = {str(k): f"{v} position (no BOS token)" for k, v in FIRST_KIND.items()}  # with label `first`
SPECIAL_MODES = ("keep", "mask", "drop")  # stored as content (unlabelled), labelled, left out


@dataclass
class CaptureBatch:
    """One batch for the capture loop.

    Attributes:
        inputs: keyword arguments of the model's forward (torch tensors on the device).
        args: positional arguments of the forward (for modules without named inputs).
        keys: sample keys, one per example.
        select: per segment, per example, the token positions stored (None: every token
            of a fixed-length segment).
        labels: per segment, per example, uint8 token labels aligned with `select`.
        source_lengths: per segment, (b,) token counts before truncation.
        texts: per text field, b JSON values.
    """

    inputs: dict[str, Any]
    keys: list[str]
    args: tuple[Any, ...] = ()
    select: dict[str, list[np.ndarray]] | None = None
    labels: dict[str, list[np.ndarray]] | None = None
    source_lengths: dict[str, np.ndarray] | None = None
    texts: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)


# ---- images -----------------------------------------------------------------------
def crop_pixels(rgb: np.ndarray, size: int) -> np.ndarray:
    """Shorter side resized to `size` (bicubic), then the centre `size` x `size` square."""
    from PIL import Image

    im = Image.fromarray(rgb)
    w, h = im.size
    s = size / min(w, h)
    nw, nh = max(size, round(w * s)), max(size, round(h * s))
    im = im.resize((nw, nh), Image.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(im.crop((left, top, left + size, top + size)))


def image_batches(
    source: Source, start: int, stop: int, spec: ImageSpec, batch_size: int, device: Any
) -> Iterator[CaptureBatch]:
    import torch

    mean = np.asarray(spec.mean, np.float32)[:, None, None]
    std = np.asarray(spec.std, np.float32)[:, None, None]
    for b0 in range(start, stop, batch_size):
        recs = [source.get(i) for i in range(b0, min(b0 + batch_size, stop))]
        pix = np.empty((len(recs), 3, spec.size, spec.size), np.float32)
        for j, r in enumerate(recs):
            px = crop_pixels(load_image(r["image"]), spec.size)
            pix[j] = (px.transpose(2, 0, 1).astype(np.float32) / 255.0 - mean) / std
        yield CaptureBatch(
            inputs={"pixel_values": torch.from_numpy(pix).to(device)},
            keys=[r["key"] for r in recs],
            texts={"image": [r["image"] for r in recs]},
        )


# ---- texts ------------------------------------------------------------------------
@dataclass
class TextPlan:
    """How texts become stored segments.

    Attributes:
        kind: "text" (one segment "tokens") or "pair" (segments "prompt" and "response").
        p_max: stored token budget of the text or prompt.
        r_max: stored token budget of the response (pairs).
        special: "mask" (store every token plus token_labels), "keep" (store every token,
            unlabelled) or "drop" (store content only).
        chat_template: wrap prompts in the tokenizer's chat template.
        system: with chat_template, the system prompt (None: the template's own default,
            "" an empty system turn: no default prompt).
        generate: new tokens to generate as the response (0: take responses from the data).
        temperature, top_p, seed: sampling of the generated responses (temperature 0:
            greedy); batch k of a run samples with seed + its first example's index.
        t_chunk: token chunk length of the text or prompt segment (None: the writer's
            default by bytes); the response's chunk is its whole budget.
    """

    kind: str
    p_max: int
    r_max: int = 0
    special: str = "mask"
    chat_template: bool = False
    system: str | None = None
    generate: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    drop_bos: bool = False  # do not store the tokenizer's BOS tokens
    bos: int | None = None  # the BOS every text or prompt starts with (--bos auto/always), None: --bos never
    prepend_bos: bool = False  # bos is prepended (the tokenizer does not add it)
    label_first: bool = False  # no BOS token (--bos auto): the first position is labelled FIRST
    separator: str = "\n"  # pairs without a chat template: between prompt and response (labelled template)
    t_chunk: int | None = None

    @property
    def t_chunks(self) -> dict[str, int] | None:
        """The writer's t_chunk argument: {text or prompt segment: t_chunk}, or None."""
        return None if self.t_chunk is None else {"tokens" if self.kind == "text" else "prompt": self.t_chunk}

    @property
    def segments(self) -> dict[str, int]:
        return {"tokens": self.p_max} if self.kind == "text" else {"prompt": self.p_max, "response": self.r_max}

    @property
    def texts(self) -> tuple[str, ...]:
        return ("text",) if self.kind == "text" else ("prompt", "response")


def prompt_tokens(tok: Any, plan: TextPlan, text: str) -> tuple[list[int], np.ndarray]:
    """Token ids and labels of a text or prompt (chat template applied when asked)."""
    special = set(tok.all_special_ids)
    if plan.chat_template and plan.kind == "pair":
        if not getattr(tok, "chat_template", None):
            raise CaptureError("--chat-template: this tokenizer has no chat template; drop the option")
        rendered = render_chat(tok, plan.system, text)
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        at = rendered.rfind(text)
        lo, hi = (at, at + len(text)) if at >= 0 and text else (0, 0)
        labels = [
            SPECIAL if t in special else (CONTENT if s < hi and e > lo else TEMPLATE)
            for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
        ]
        return lead(plan, list(enc["input_ids"]), np.asarray(labels, np.uint8))
    ids = list(tok(text, add_special_tokens=True)["input_ids"])
    labels = [SPECIAL if t in special else CONTENT for t in ids]
    if plan.kind == "pair" and plan.separator:
        sep = separator_tokens(tok, plan.separator)
        ids += sep
        labels += [TEMPLATE] * len(sep)
    return lead(plan, ids, np.asarray(labels, np.uint8))


def lead(plan: TextPlan, ids: list[int], labels: np.ndarray) -> tuple[list[int], np.ndarray]:
    """A text or prompt with its token 0 as `plan` says: the BOS prepended (labelled
    special), or, without a BOS token, its first position labelled FIRST when it is content."""
    if plan.prepend_bos and plan.bos is not None:
        return [plan.bos, *ids], np.concatenate([np.asarray([SPECIAL], np.uint8), labels])
    if plan.label_first and len(labels) and labels[0] == CONTENT:
        labels = labels.copy()
        labels[0] = FIRST
    return ids, labels


@dataclass(frozen=True)
class BosChoice:
    """What token 0 of every text or prompt is (`--bos`), decided once per tokenizer.

    Attributes:
        mode: "auto", "always" or "never" (the option).
        token: the tokenizer's BOS id (None: it has none).
        added: the tokenizer (or the chat template) puts it first by itself.
        prepend: the capture prepends it (auto/always, when it is not added).
        first: no BOS token (auto): the first position is labelled `first`.
    """

    mode: str
    token: int | None
    added: bool
    prepend: bool
    first: bool

    @property
    def token_0(self) -> str:
        """Token 0 in words (the store's attrs and `info`)."""
        if self.mode == "never":
            return "the text's first token as tokenized (content unless the tokenizer marks it special)"
        if self.prepend:
            return f"BOS (token {self.token}), prepended by the capture, labelled special"
        if self.first:
            return "the text's first token, labelled first (the tokenizer has no BOS token)"
        return f"BOS (token {self.token}), added by the tokenizer or chat template, labelled special"

    def to_json(self) -> dict[str, Any]:
        return {
            "option": self.mode,
            "token": self.token,
            "prepended": self.prepend,
            "first_labelled": self.first,
            "token_0": self.token_0,
        }

    def apply(self, plan: TextPlan) -> TextPlan:
        """`plan` with this choice's token 0."""
        from dataclasses import replace

        bos = self.token if self.mode != "never" and (self.prepend or self.added) else None
        return replace(plan, bos=bos, prepend_bos=self.prepend, label_first=self.first)


def choose_bos(tok: Any, plan: TextPlan, mode: str, token: int | None = None) -> BosChoice:
    """Decide token 0 for texts made by `tok` and `plan` (a probe text is tokenized as the
    capture will): --bos auto prepends the BOS when neither the tokenizer nor the chat
    template puts it first, and labels position 0 `first` when there is no BOS token;
    always is auto that refuses a tokenizer without BOS; never changes nothing. `token`: the
    model's own document start when it is not the tokenizer's BOS (LoadedModel.document_bos)."""
    if mode not in BOS_MODES:
        raise CaptureError(f"--bos must be one of {list(BOS_MODES)}. Got {mode!r}.")
    bos = tok.bos_token_id if token is None else token
    if bos is None and mode == "always":
        raise CaptureError(
            "--bos always: this tokenizer has no BOS token; use --bos auto (labels token 0 'first') or --bos never"
        )
    from dataclasses import replace

    probe, _ = prompt_tokens(tok, replace(plan, bos=None, prepend_bos=False, label_first=False), "a")
    added = bos is not None and bool(probe) and probe[0] == bos
    if mode == "never":
        return BosChoice(mode=mode, token=bos, added=added, prepend=False, first=False)
    return BosChoice(mode=mode, token=bos, added=added, prepend=bos is not None and not added, first=bos is None)


def render_chat(tok: Any, system: str | None, text: str) -> str:
    """A prompt as the chat template renders it: a user turn (after a system turn when
    `system` is not None), then the generation prompt."""
    turns = [{"role": "user", "content": text}]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    try:
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja's template errors (e.g. "System role not supported")
        raise CaptureError(f"the tokenizer's chat template refused the prompt: {e}") from None


def default_system(tok: Any) -> str | None:
    """The system turn a chat template adds by itself when given none (its text before the
    user turn, when that names a system role), or None."""
    probe = "\u2063probe\u2063"
    rendered = render_chat(tok, None, probe)
    before = rendered[: rendered.find(probe)]
    return before if "system" in before.lower() else None


def separator_tokens(tok: Any, text: str) -> list[int]:
    """The tokens between a prompt and its response without a chat template: `text`
    tokenized, or the tokenizer's SEP/EOS token when the text tokenizes to nothing."""
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if ids:
        return ids
    fallback = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    return [fallback] if fallback is not None else []


def response_tokens(tok: Any, text: str) -> tuple[list[int], np.ndarray]:
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    special = set(tok.all_special_ids)
    return ids, np.asarray([SPECIAL if t in special else CONTENT for t in ids], np.uint8)


def kept(ids: Sequence[int], labels: np.ndarray, plan: TextPlan, bos: int | None) -> np.ndarray:
    """The positions of a token sequence that the store keeps: all, or only content tokens
    (--special drop), less the tokenizer's BOS tokens (--drop bos)."""
    keep = np.flatnonzero(labels == CONTENT) if plan.special == "drop" else np.arange(len(labels))
    if plan.drop_bos and bos is not None and len(keep):
        keep = keep[np.asarray(ids, np.int64)[keep] != bos]
    return keep


def head(seq: tuple[list[int], np.ndarray], keep: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
    """`seq` cut after its first n kept tokens (texts, responses: the start is kept)."""
    if len(keep) <= n:
        return seq
    cut = int(keep[n])
    return seq[0][:cut], seq[1][:cut]


def tail(
    seq: tuple[list[int], np.ndarray], keep: np.ndarray, n: int, plan: TextPlan | None = None
) -> tuple[list[int], np.ndarray]:
    """`seq` from its n-th last kept token on (prompts: the end, next to the response); the
    BOS that `plan` puts first stays first (counted in the n when it is stored)."""
    if len(keep) <= n:
        return seq
    ids, labels = seq
    first = int(plan is not None and plan.bos is not None and bool(ids) and ids[0] == plan.bos)
    n -= int(first and len(keep) and keep[0] == 0)
    start = max(int(keep[len(keep) - n]) if n > 0 else len(ids), first)
    cut = ids[:first] + ids[start:], np.concatenate([labels[:first], labels[start:]])
    return lead(plan, *cut) if plan is not None and plan.label_first and not first else cut


def prompt_lengths(tok: Any, plan: TextPlan, source: Source) -> np.ndarray:
    """Stored (kept) token counts of every text or prompt, for the default budget and --p-quantile."""
    key = "text" if plan.kind == "text" else "prompt"
    return np.asarray(
        [len(kept(*prompt_tokens(tok, plan, source.get(i)[key]), plan, tok.bos_token_id)) for i in range(len(source))],
        np.int64,
    )


def response_lengths(tok: Any, plan: TextPlan, source: Source) -> np.ndarray:
    """Stored (kept) token counts of every response in the data (for --r-quantile)."""
    return np.asarray(
        [
            len(kept(*response_tokens(tok, source.get(i)["response"] or ""), plan, tok.bos_token_id))
            for i in range(len(source))
        ],
        np.int64,
    )


def text_batches(
    source: Source, start: int, stop: int, tok: Any, plan: TextPlan, batch_size: int, device: Any, model: Any = None
) -> Iterator[CaptureBatch]:
    import torch

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    bos = tok.bos_token_id
    for b0 in range(start, stop, batch_size):
        recs = [source.get(i) for i in range(b0, min(b0 + batch_size, stop))]
        key = "text" if plan.kind == "text" else "prompt"
        prompts = [prompt_tokens(tok, plan, r[key]) for r in recs]
        keeps = [kept(ids, lab, plan, bos) for ids, lab in prompts]
        src_p = np.asarray([len(k) for k in keeps], np.int64)  # budgets count stored tokens only
        if plan.kind == "text":  # texts keep the start, prompts the end (next to the response) and their BOS
            prompts = [head(p, k, plan.p_max) for p, k in zip(prompts, keeps)]
        else:
            prompts = [tail(p, k, plan.p_max, plan) for p, k in zip(prompts, keeps)]
        if plan.kind == "pair":
            if plan.generate:
                responses = generate(model, tok, [ids for ids, _ in prompts], plan, pad_id, device, seed=plan.seed + b0)
            else:
                missing = [r["key"] for r in recs if r.get("response") is None]
                if missing:
                    raise CaptureError(
                        f'examples {missing[:3]} have no "response"; add responses to the data or pass --generate N'
                    )
                responses = [response_tokens(tok, r["response"]) for r in recs]
            keeps = [kept(ids, lab, plan, bos) for ids, lab in responses]
            src_r = np.asarray([len(k) for k in keeps], np.int64)
            responses = [head(r, k, plan.r_max) for r, k in zip(responses, keeps)]
        else:
            responses = [([], np.zeros(0, np.uint8)) for _ in recs]
        seqs = [p[0] + r[0] for p, r in zip(prompts, responses)]
        t = max(1, max(len(s) for s in seqs))
        ids = np.full((len(seqs), t), pad_id, np.int64)
        mask = np.zeros((len(seqs), t), np.int64)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = s
            mask[j, : len(s)] = 1
        select: dict[str, list[np.ndarray]] = {}
        labels: dict[str, list[np.ndarray]] = {}
        names = list(plan.segments)
        for j, (p, r) in enumerate(zip(prompts, responses)):
            spans = [(0, p)] if plan.kind == "text" else [(0, p), (len(p[0]), r)]
            for name, (off, (part, lab)) in zip(names, spans):
                keep = kept(part, lab, plan, bos)
                select.setdefault(name, []).append(off + keep)
                labels.setdefault(name, []).append(lab[keep])
        texts: dict[str, list[Any]] = {}
        if plan.kind == "text":
            texts["text"] = [r["text"] for r in recs]
            src = {"tokens": src_p}
        else:
            texts["prompt"] = [r["prompt"] for r in recs]
            texts["response"] = (
                [tok.decode(ids, skip_special_tokens=True) for ids, _ in responses]
                if plan.generate
                else [r["response"] for r in recs]
            )
            src = {"prompt": src_p, "response": src_r}
        yield CaptureBatch(
            inputs={"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(mask).to(device)},
            keys=[r["key"] for r in recs],
            select=select,
            labels=labels if plan.special == "mask" else None,
            source_lengths=src,
            texts=texts,
        )


def generate(
    model: Any, tok: Any, prompts: Sequence[list[int]], plan: TextPlan, pad_id: int, device: Any, seed: int = 0
) -> list[tuple[list[int], np.ndarray]]:
    """Responses of up to `plan.generate` tokens (cut after the first EOS, which is kept):
    greedy, or sampled with plan.temperature and plan.top_p from `seed`."""
    import torch

    if not hasattr(model, "generate"):
        raise CaptureError("--generate needs a causal language model; this model cannot generate")
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for j, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[j, t - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[j, t - len(p) :] = 1
    sample = {"do_sample": False}
    if plan.temperature > 0:
        sample = {"do_sample": True, "temperature": plan.temperature, "top_p": plan.top_p, "top_k": 0}
        torch.manual_seed(seed)  # generate() samples from torch's global generator
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=plan.generate,
            pad_token_id=pad_id,
            **sample,
        )
    eos = tok.eos_token_id
    special = set(tok.all_special_ids)
    res = []
    for row in out[:, t:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        res.append((row, np.asarray([SPECIAL if x in special else CONTENT for x in row], np.uint8)))
    return res
