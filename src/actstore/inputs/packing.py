"""Corpus capture: documents tokenized into context windows of exactly N tokens.

- `--pack --context N`: every document's tokens (the tokenizer's own special tokens, then
  its EOS when it has one and the document does not end with it) are concatenated in data
  order and cut into windows of N tokens; only the last window may be shorter. Every token
  of the corpus is stored exactly once, and a window may span documents (as SAELens and
  dictionary_learning train).
- `--chunk --context N`: each document is cut into consecutive windows of at most N
  tokens; no window spans two documents and nothing is truncated.
- Window BOS (the default of `actstore write`; `--no-window-bos` opts out): every window
  starts with the tokenizer's BOS (its EOS as the stand-in when it has no BOS), labelled
  special, followed by N - 1 corpus tokens, as SAE trainers expect (SAELens prepends BOS
  to every context); a document's own leading BOS gives way to it. Its run is document -1.

Each window records the runs `[document index, document key, offset, length]` of its
stored tokens (the text field `runs`; `token_origins(store, ex)`), so any stored token maps
back to its document and position. Counting the
windows tokenizes the corpus once (only the lengths are kept); the windows of a writer's
slice tokenize their documents again (a small cache keeps the documents they share).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from actstore.errors import CaptureError
from actstore.inputs.data import Source
from actstore.inputs.prepare import CaptureBatch

if TYPE_CHECKING:
    from actstore.read.store import ActStore

MODES = ("pack", "chunk")
RUNS_TEXT = "runs"  # the text field holding each window's (document, offset) runs
SPECIAL, CONTENT = 1, 0  # token labels: the tokenizer's special tokens, everything else


def doc_tokens(tok: Any, text: str) -> list[int]:
    """A document's tokens: the tokenizer's own special tokens (BOS for most LLMs), then its
    EOS as the separator when it defines one and the document does not already end with it."""
    ids = list(tok(text, add_special_tokens=True)["input_ids"])
    eos = tok.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


@dataclass(frozen=True)
class Windows:
    """The windows of a corpus: window w is the runs `runs(w)`."""

    mode: str
    context: int
    doc_lengths: np.ndarray  # tokens per document
    doc_start: np.ndarray  # global token offset of each document (pack), cumulative
    win_doc: np.ndarray  # chunk mode: the document of each window
    win_offset: np.ndarray  # chunk mode: the offset of each window in its document
    bos: int | None = None  # the token each window starts with (None: --no-window-bos)
    doc_skip: np.ndarray | None = None  # per document: 1 when its own leading BOS gives way to the window's

    @property
    def step(self) -> int:
        """Corpus tokens per full window."""
        return self.context - (self.bos is not None)

    @property
    def n_tokens(self) -> int:
        return int(self.doc_lengths.sum())

    def __len__(self) -> int:
        if self.mode == "pack":
            return -(-self.n_tokens // self.step)
        return len(self.win_doc)

    def runs(self, w: int) -> list[tuple[int, int, int]]:
        """(document, offset, length) runs of window w, in order; offsets count in the
        document's tokens (`doc_tokens`); the window's BOS is the run (-1, 0, 1)."""
        c = self.step
        out = [(-1, 0, 1)] if self.bos is not None else []
        skip = self.doc_skip if self.doc_skip is not None else np.zeros(len(self.doc_lengths), np.int64)
        if self.mode == "chunk":
            d, off = int(self.win_doc[w]), int(self.win_offset[w])
            return out + [(d, off + int(skip[d]), min(c, int(self.doc_lengths[d]) - off))]
        lo, hi = w * c, min((w + 1) * c, self.n_tokens)
        d = int(np.searchsorted(self.doc_start, lo, side="right")) - 1
        while lo < hi:
            while self.doc_lengths[d] == 0:
                d += 1
            off = lo - int(self.doc_start[d])
            n = min(hi - lo, int(self.doc_lengths[d]) - off)
            out.append((d, off + int(skip[d]), n))
            lo += n
            d += 1
        return out


def window_bos_id(tok: Any) -> int:
    """The token each window starts with: the tokenizer's BOS, else its EOS (the stand-in)."""
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if bos is None:
        raise CaptureError(
            "the tokenizer has neither a BOS nor an EOS token to start each window with; pass --no-window-bos"
        )
    return int(bos)


def plan_windows(
    source: Source, tok: Any, context: int, mode: str, batch: int = 256, window_bos: bool = False
) -> Windows:
    """Tokenize the corpus once (lengths only) and lay out its windows (each starting with
    the tokenizer's BOS when `window_bos`)."""
    if mode not in MODES:
        raise CaptureError(f"packing mode must be one of {list(MODES)}. Got {mode!r}.")
    bos = window_bos_id(tok) if window_bos else None
    if bos is not None and context < 2:
        raise CaptureError(
            f"--context {context} leaves no room after each window's BOS; use --context 2 or more, or --no-window-bos"
        )
    if source.kind != "text":
        raise CaptureError(
            f"--pack and --chunk take documents (texts); --data {source.name} holds {source.kind} examples"
        )
    lengths = np.zeros(len(source), np.int64)
    skip = np.zeros(len(source), np.int64)
    for b0 in range(0, len(source), batch):
        texts = [source.get(i)["text"] for i in range(b0, min(b0 + batch, len(source)))]
        enc = tok(texts, add_special_tokens=True)["input_ids"]
        eos = tok.eos_token_id
        lengths[b0 : b0 + len(texts)] = [len(ids) + (eos is not None and (not ids or ids[-1] != eos)) for ids in enc]
        if bos is not None and tok.bos_token_id is not None:  # the document's own BOS gives way to the window's
            skip[b0 : b0 + len(texts)] = [bool(ids) and ids[0] == tok.bos_token_id for ids in enc]
    lengths -= skip
    step = context - (bos is not None)
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    if mode == "chunk":
        per_doc = -(-lengths // step)
        win_doc = np.repeat(np.arange(len(lengths)), per_doc)
        first = np.concatenate([[0], np.cumsum(per_doc)[:-1]]) if len(per_doc) else np.zeros(0, np.int64)
        win_offset = (np.arange(len(win_doc)) - np.repeat(first, per_doc)) * step
    else:
        win_doc = win_offset = np.zeros(0, np.int64)
    return Windows(
        mode=mode,
        context=context,
        doc_lengths=lengths,
        doc_start=start,
        win_doc=win_doc,
        win_offset=win_offset,
        bos=bos,
        doc_skip=skip,
    )


def stored_runs(runs: list[tuple[int, int, int]], kept: np.ndarray) -> list[tuple[int, int, int]]:
    """The (document, offset, length) runs of a window's stored tokens: its model-token runs
    with the positions not stored (--drop bos) cut out, so stored token k of the window is
    the k-th token the runs list."""
    if not runs or not len(kept):
        return []
    # Each stored token's document and position in it, vectorised (this runs for every batch).
    d, off, n = (np.asarray(c, np.int64) for c in zip(*runs))
    doc = np.repeat(d, n)[kept]
    at = (np.repeat(off - (np.cumsum(n) - n), n) + np.arange(int(n.sum())))[kept]
    new = np.ones(len(doc), bool)
    new[1:] = (doc[1:] != doc[:-1]) | (at[1:] != at[:-1] + 1)
    starts = np.flatnonzero(new)
    lengths = np.diff(np.append(starts, len(doc)))
    return [(int(doc[i]), int(at[i]), int(k)) for i, k in zip(starts, lengths)]


def token_origins(store: ActStore, ex: int) -> np.ndarray:
    """(n, 2) int64 [document index, position in the document's tokens] of each stored token
    of window `ex` of a --pack / --chunk store, in the order of `store[ex, layer]`."""
    runs = store.sample(ex).get(RUNS_TEXT)
    if runs is None:
        raise CaptureError(f"{store.path} has no {RUNS_TEXT!r} text field: it was not captured with --pack or --chunk")
    parts = [
        np.stack([np.full(n, d, np.int64), np.arange(off, off + n, dtype=np.int64)], axis=1) for d, _key, off, n in runs
    ]
    return np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)


def window_batches(
    source: Source,
    windows: Windows,
    start: int,
    stop: int,
    tok: Any,
    batch_size: int,
    device: Any,
    drop_bos: bool = False,
    special: str = "mask",
) -> Iterator[CaptureBatch]:
    """CaptureBatches of windows [start, stop): input_ids padded on the right (only the last
    window of the corpus, or of a document in chunk mode, is shorter), token labels marking
    the tokenizer's special tokens (special "mask"; "keep": no labels; "drop": special
    tokens not stored, the window's BOS included), and each window's runs."""
    import torch

    special_ids = set(tok.all_special_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    cache: OrderedDict[int, list[int]] = OrderedDict()

    def tokens(d: int) -> list[int]:
        if d not in cache:
            cache[d] = doc_tokens(tok, source.get(d)["text"])
            if len(cache[d]) - windows.doc_skip[d] != windows.doc_lengths[d]:
                raise CaptureError(
                    f"document {d} tokenized to {len(cache[d])} tokens, then {windows.doc_lengths[d]}: the tokenizer is not deterministic"
                )
            if len(cache) > 64:
                cache.popitem(last=False)
        return cache[d]

    for b0 in range(start, stop, batch_size):
        seqs, model_runs = [], []
        for w in range(b0, min(b0 + batch_size, stop)):
            rs = windows.runs(w)
            seqs.append([t for d, off, n in rs for t in ([windows.bos] if d < 0 else tokens(d)[off : off + n])])
            model_runs.append(rs)
        t = max(len(s) for s in seqs)
        ids = np.full((len(seqs), t), pad_id, np.int64)
        mask = np.zeros((len(seqs), t), np.int64)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = s
            mask[j, : len(s)] = 1
        bos = tok.bos_token_id if drop_bos else None  # --drop bos: the model sees them; the store does not
        lead = (drop_bos or special == "drop") and windows.bos is not None  # ... nor the window's BOS (or its stand-in)
        drop_all = special == "drop"  # --special drop: no special token is stored
        select = [
            np.asarray(
                [
                    k
                    for k, x in enumerate(s)
                    if not (lead and k == 0) and (x not in special_ids if drop_all else x != bos)
                ],
                np.int64,
            )
            for s in seqs
        ]
        lens = np.asarray([len(s) for s in select], np.int64)
        runs = [
            [[d, source.get(d)["key"] if d >= 0 else "", off, n] for d, off, n in stored_runs(rs, sel)]
            for rs, sel in zip(model_runs, select)
        ]
        yield CaptureBatch(
            inputs={"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(mask).to(device)},
            keys=[f"window-{w}" for w in range(b0, b0 + len(seqs))],
            select={"tokens": select},
            labels=None
            if special == "keep"
            else {
                "tokens": [
                    np.asarray(
                        [
                            SPECIAL if s[k] in special_ids or (k == 0 and windows.bos is not None) else CONTENT
                            for k in sel
                        ],
                        np.uint8,
                    )
                    for s, sel in zip(seqs, select)
                ]
            },
            source_lengths={"tokens": lens},
            texts={RUNS_TEXT: runs},
        )
