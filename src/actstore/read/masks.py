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

from typing import Any

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
