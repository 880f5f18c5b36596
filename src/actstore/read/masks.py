"""Which tokens a consumer reads by default: the one rule that the loaders (TokenStream,
PairDataset, aligned streams), the exports (saev, SAELens), the feature pass and the
capture's statistics all apply.

Per-token labels are data unless the store says otherwise. A store whose configuration says
its labels are token kinds (`StoreConfig.token_label_names`: 0 content, 1 special token, 2
chat template; the capture records it) is read as its content tokens only: BOS (every
--pack/--chunk window starts with one, an attention-sink outlier), other special tokens and
chat-template tokens are left out. Every other store (no labels, or labels that are classes:
a probing data set's tags, a saev labels.bin) is read whole. `token_mask="all"` (or None)
keeps every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.layout.spec import TOKEN_LABELS_SUFFIX
from actstore.read.interface import Reader

CONTENT = "content"  # token_mask: tokens whose stored label is 0
DEFAULT = "default"  # token_mask: CONTENT where the labels are token kinds, else every token
ALL = "all"  # token_mask: every token up to each length (the same as None)


def default_token_mask(store: Reader) -> str | None:
    """The mask every consumer applies unless told otherwise: CONTENT for a store whose
    labels are token kinds, None (every token) for any other store."""
    return CONTENT if leaves_out_special(store) else None


def leaves_out_special(store: Reader) -> bool:
    """Whether the default mask leaves out tokens by their label (the labels are token kinds:
    it keeps label 0, content, and leaves out special and chat-template tokens)."""
    return store.config.default_keeps is not None


def effective_token_mask(store: Reader, token_mask: Any) -> Any:
    """`token_mask` with the shortcuts DEFAULT and ALL resolved (None: every token)."""
    if isinstance(token_mask, str):
        if token_mask == DEFAULT:
            return default_token_mask(store)
        if token_mask == ALL:
            return None
    return token_mask


# Label bytes read to count what the default mask leaves out (info, the commands' first line):
# beyond it the line says which tokens it keeps without counting them.
MASK_COUNT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class MaskSummary:
    """What a store's default mask keeps: `keeps` in words, the store's real tokens (every
    segment, padding left out) and how many of them the mask leaves out (None: not counted,
    the labels being larger than MASK_COUNT_BYTES)."""

    keeps: str
    tokens: int
    left_out: int | None

    def line(self, keep_all: bool = False) -> str:
        """One line saying it (`keep_all`: for a run told to keep every token)."""
        if keep_all and self.left_out != 0:
            left = "some" if self.left_out is None else f"{self.left_out:,} of {self.tokens:,} real tokens"
            return f"mask: every real token (asked for: the default mask, {self.keeps}, would leave out {left})"
        if self.left_out is None:
            return f"default mask: {self.keeps}; its left-out tokens are not counted (over {MASK_COUNT_BYTES >> 20} MiB of labels)"
        if not self.left_out:
            return f"default mask: {self.keeps}: all {self.tokens:,} real tokens"
        share = 100 * self.left_out / self.tokens if self.tokens else 0.0
        return (
            f"default mask: {self.keeps}: leaves out {self.left_out:,} of {self.tokens:,} real tokens ({share:.1f}%); "
            "keep them with --special keep (Python: token_mask='all')"
        )

    def to_json(self) -> dict[str, Any]:
        return {"keeps": self.keeps, "tokens": self.tokens, "left_out": self.left_out}


def summarize(store: Reader) -> MaskSummary:
    """What the default mask of `store` keeps and leaves out (reads its lengths, and its
    labels when they are token kinds)."""
    cfg = store.config
    names = [s.name for s in cfg.segments]
    n = len(store)
    # (a fixed segment's lengths are its t_max: nothing is read)
    lengths = {s: np.asarray(store.segment(s).lengths(), np.int64) if n else np.zeros(0, np.int64) for s in names}
    tokens = int(sum(v.sum() for v in lengths.values()))
    if cfg.token_label_names is None:
        why = "its token labels are classes: data, not a mask" if cfg.token_labels else "no token labels"
        return MaskSummary(keeps=f"every real token ({why})", tokens=tokens, left_out=0)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(cfg.token_label_names.items()))
    keeps = f"content tokens, label {cfg.default_keeps} (its labels are token kinds: {kinds})"
    if n * sum(s.t_max for s in cfg.segments) > MASK_COUNT_BYTES:
        return MaskSummary(keeps=keeps, tokens=tokens, left_out=None)
    kept = 0
    for s in cfg.segments:
        if not n:
            continue
        labels = np.asarray(store.field(s.name + TOKEN_LABELS_SUFFIX))
        real = np.arange(labels.shape[1])[None, :] < lengths[s.name][:, None]
        kept += int((real & (labels == cfg.default_keeps)).sum())
    return MaskSummary(keeps=keeps, tokens=tokens, left_out=tokens - kept)
