"""Token windows around many (feature, example, token) rows at once, as arrays: each row's
token ids, its feature's activation at every token of the window, which tokens the pass's
mask left out, and the document the token came from (its key). Each example is read and
encoded once, for the features of all its rows; the rest is array indexing.

A window is `before` tokens, the row's token, then `after` tokens: column `before` is always
the row's token; positions outside the example hold id -1 (drawn as nothing). The MARGIN
tokens on either side of a window are kept too (`lead`, `tail`): `window_pieces` decodes a
window from the character boundaries around it (actstore.inputs.tokentext), so that a
character whose bytes a window's edge cuts is never shown as U+FFFD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.encoders.encoder import Encoder
from actstore.inputs.tokentext import MARGIN, Pieces, TokenText
from actstore.read.api import Reader
from actstore.read.store import ActStore

DEFAULT_WINDOW = (12, 4)  # tokens shown before and after the row's token
PIECES_BATCH = 8192  # windows decoded in one batch (one progress step)


@dataclass(frozen=True)
class Windows:
    """Arrays of n windows of width W = before + 1 + after.

    Attributes:
        ids: (n, W) int64 token ids, -1 outside the example.
        acts: (n, W) float32 the row's feature at each token (0 outside).
        off: (n, W) bool, tokens the pass's default mask leaves out (BOS, specials, template).
        before: the column of each row's own token.
        doc: (n,) int32 index into `keys` of the document (packed stores: the run holding the
            token) or example (its sample key) the row's token belongs to; -1: none kept.
        doc_token: (n,) int64 the token's position in its document (packed stores), else -1.
        keys: the document keys that `doc` indexes.
        lead, tail: (n, MARGIN) int64 the ids just before and after the window (-1 outside).
    """

    ids: np.ndarray
    acts: np.ndarray
    off: np.ndarray
    before: int
    doc: np.ndarray
    doc_token: np.ndarray
    keys: list[str]
    lead: np.ndarray
    tail: np.ndarray


def window_pieces(tt: TokenText, w: Windows, *, progress: Any = None) -> list[Pieces]:
    """The display pieces of every window, one per column inside the example (the -1 columns
    have none): each decoded whole, from the character boundaries around it, in batches of
    PIECES_BATCH windows (`progress` is called with the number done since its last call)."""
    out: list[Pieces] = []
    for b0 in range(0, len(w.ids), PIECES_BATCH):
        seqs, spans = [], []
        for r in range(b0, min(b0 + PIECES_BATCH, len(w.ids))):
            lead, ids, tail = w.lead[r], w.ids[r], w.tail[r]
            lead, ids, tail = lead[lead >= 0], ids[ids >= 0], tail[tail >= 0]
            seqs.append(np.concatenate([lead, ids, tail]).tolist())
            spans.append((len(lead), len(lead) + len(ids)))
        out += tt.windows(seqs, spans)
        if progress is not None:
            progress(len(seqs))
    return out


def token_labels(store: Reader) -> dict[str, np.ndarray] | None:
    """Each segment's token labels (N, T_max) when the pass's default mask applies to the store."""
    from actstore.layout import spec
    from actstore.read.masks import leaves_out_special

    if not leaves_out_special(store):
        return None
    return {s: np.asarray(store.field(s + spec.TOKEN_LABELS_SUFFIX)) for s in store.segments}


def left_out(store: Reader, labels: dict[str, np.ndarray] | None, ex: int, n: int) -> np.ndarray:
    if labels is None:
        return np.zeros(n, bool)
    lengths = store.lengths(ex)
    return np.concatenate([labels[s][ex, : lengths[s]] != 0 for s in store.segments])


class _Keys:
    """Document keys of a store: a packed window's runs (text field `runs`: [document, key,
    offset, n] each) or the example's sample key; interned so that each is written once."""

    def __init__(self, store: Reader) -> None:
        from actstore.inputs.packing import RUNS_TEXT

        self.store = store
        self.packed = isinstance(store, ActStore) and RUNS_TEXT in store.config.texts
        self.sample_keys = None
        if isinstance(store, ActStore) and not self.packed:
            self.sample_keys = store.field("sample_key")
        self.keys: list[str] = []
        self._index: dict[str, int] = {}

    def _intern(self, key: Any) -> int:
        k = str(key)
        i = self._index.get(k)
        if i is None:
            i = self._index[k] = len(self.keys)
            self.keys.append(k)
        return i

    def of(self, ex: int, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(doc index, position in the document) of each of example ex's `tokens`."""
        n = len(tokens)
        if self.packed:
            from actstore.inputs.packing import RUNS_TEXT

            runs = self.store.sample(ex).get(RUNS_TEXT) or []
            if runs:
                ends = np.cumsum([int(r[3]) for r in runs])
                which = np.minimum(np.searchsorted(ends, tokens, side="right"), len(runs) - 1)
                docs = np.array([self._intern(r[1]) for r in runs], np.int32)[which]
                starts = ends - np.array([int(r[3]) for r in runs])
                offs = np.array([int(r[2]) for r in runs], np.int64)
                return docs, offs[which] + tokens - starts[which]
        if self.sample_keys is not None:
            key = self.sample_keys[ex]
            if key not in ("", None):
                return np.full(n, self._intern(key), np.int32), np.full(n, -1, np.int64)
        return np.full(n, -1, np.int32), np.full(n, -1, np.int64)


def text_windows(
    store: Reader,
    layer: int,
    encoder: Encoder,
    features: np.ndarray,
    examples: np.ndarray,
    tokens: np.ndarray,
    *,
    window: tuple[int, int] = DEFAULT_WINDOW,
    progress: Any = None,
    positions: bool = False,
) -> Windows:
    """The windows of rows (features[i], examples[i], tokens[i]) of a text store.

    Args:
        progress: called with the number of examples done since the last call (a bar).
        positions: for a store that keeps no token ids, each token's position in its
            example stands in for its id (the site shows them with a note; they must not
            be decoded). Without it such a store is refused.
    """
    if not store.config.token_ids and not positions:
        raise FeatureError(f"{store.path} keeps no token ids: text context needs a store captured with token_ids")
    positions = positions and not store.config.token_ids
    before, after = window
    n = len(examples)
    w = Windows(
        ids=np.full((n, before + 1 + after), -1, np.int64),
        acts=np.zeros((n, before + 1 + after), np.float32),
        off=np.zeros((n, before + 1 + after), bool),
        before=before,
        doc=np.full(n, -1, np.int32),
        doc_token=np.full(n, -1, np.int64),
        keys=[],
        lead=np.full((n, MARGIN), -1, np.int64),
        tail=np.full((n, MARGIN), -1, np.int64),
    )
    labels = token_labels(store)
    keys = _Keys(store)
    order = np.argsort(examples, kind="stable")
    bounds = np.flatnonzero(np.diff(examples[order])) + 1
    span = np.arange(-before - MARGIN, after + 1 + MARGIN)  # the window and its margins
    cols = slice(MARGIN, MARGIN + before + 1 + after)
    with one_blas_thread():  # an example's matmul is small: BLAS threads would only wait on each other
        for grp in np.split(order, bounds) if n else []:
            ex = int(examples[grp[0]])
            feats, col = np.unique(features[grp], return_inverse=True)
            values = encoder.encode(np.asarray(store[ex, layer], np.float32), feats)  # (T, len(feats))
            ex_ids = np.arange(len(values)) if positions else np.asarray(store.token_ids(ex), np.int64)
            t_len = len(ex_ids)
            pos = tokens[grp].astype(np.int64)[:, None] + span  # (rows, MARGIN + W + MARGIN)
            inside = (pos >= 0) & (pos < t_len)
            clipped = np.clip(pos, 0, max(t_len - 1, 0))
            ids = np.where(inside, ex_ids[clipped], -1)
            w.ids[grp], w.lead[grp], w.tail[grp] = ids[:, cols], ids[:, :MARGIN], ids[:, cols.stop :]
            inside, clipped = inside[:, cols], clipped[:, cols]
            w.acts[grp] = np.where(inside, values[clipped, col[:, None]], 0.0)
            w.off[grp] = inside & left_out(store, labels, ex, t_len)[clipped]
            w.doc[grp], w.doc_token[grp] = keys.of(ex, tokens[grp].astype(np.int64))
            if progress is not None:
                progress(1)
    w.keys.extend(keys.keys)
    return w


def one_blas_thread() -> Any:
    """A context in which numpy's BLAS runs on one thread (threadpoolctl; nothing without it)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def n_examples(examples: np.ndarray) -> int:
    """How many distinct examples the windows of these rows read (for a progress bar)."""
    return len(np.unique(examples))
