"""Token ids as display text: one piece per token, cut from one decode of the whole sequence.

Every view shows a text as one piece per token (coloured by its activation). Joining
per-token decodes garbles any character a tokenizer splits across tokens (byte-level BPE
splits 'ö', Cyrillic, CJK and emoji into byte tokens, each decoding alone to U+FFFD). Here
the pieces are slices of `tokenizer.decode(ids)` of the whole sequence, so their
concatenation is that text exactly. A token's piece is the text its bytes complete: a
token that holds part of a character shows the part of its text before that character,
and is marked `partial`; the character appears once, on the token that completes it.

How the pieces are found (`TokenText.pieces`):
1. Each distinct id is decoded alone and after an anchor token (its text inside a text:
   "world" decodes alone as "world" with some tokenizers, as " world" after a word), once
   per id. An id is clean when neither decode holds U+FFFD and the anchored one extends
   the anchor's text.
2. When every token is clean and [alone(first), anchored(rest)...] join to the decode,
   those are the pieces (the common case: one string comparison a sequence).
3. Else, when the tokenizer spells each token's bytes (byte-level BPE, byte fallback) and
   they are the decode's UTF-8, the bytes are cut at character boundaries: each token's
   piece is the characters its bytes complete.
4. Otherwise the tokens are walked: a clean token whose text continues the decode at the
   current offset is taken; any other token is decoded with the tokens since the last
   complete one (after the anchor), and its piece ends where that decode stops agreeing
   with the whole decode (the U+FFFD of an unfinished character never agrees). A token
   whose decode runs on past that point is partial.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character
MARGIN = 4  # tokens a view reads beyond each side of a window: a UTF-8 character has <= 4 bytes


@dataclass(frozen=True)
class Pieces:
    """The display text of a token sequence.

    Attributes:
        text: one string per token; `"".join(text)` is the sequence's decoded text.
        partial: (n,) bool, the token ends inside a character that a later token completes
            (the character is shown on that token).
    """

    text: list[str]
    partial: np.ndarray

    def __len__(self) -> int:
        return len(self.text)

    @property
    def offsets(self) -> np.ndarray:
        """(n + 1,) int64 character offsets of the pieces in the decoded text: token k's
        piece is `decoded[offsets[k]:offsets[k + 1]]` (the tokens a piece maps to)."""
        return np.concatenate([[0], np.cumsum([len(t) for t in self.text], dtype=np.int64)])

    def window(self, lo: int, hi: int) -> Pieces:
        """The pieces of tokens lo..hi-1."""
        return Pieces(self.text[lo:hi], self.partial[lo:hi])


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b (slice comparisons, in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TokenText:
    """Display text of token ids for one tokenizer (a transformers tokenizer), or `[id]`
    per token without one. Per-id decodes are cached; sequences are decoded in batches."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self._alone: dict[int, str] = {}
        self._ctx: dict[int, str] = {}
        self._clean: dict[int, bool] = {}
        self._bytes_of: Any = None
        self._bytes: dict[int, bytes | None] = {}
        self._starts: dict[int, bool] = {}
        self.decode_batch = _batch_decoder(tok)
        self.anchor, self._anchor_text = _anchor(tok) if tok is not None else (None, "")

    def _learn(self, ids: Sequence[int]) -> None:
        """Decode the ids not seen yet, alone and after the anchor (two batch decodes)."""
        new = [i for i in dict.fromkeys(ids) if i not in self._clean]
        if not new:
            return
        alone = self.decode_batch([[i] for i in new])
        if self.anchor is None:
            ctx = alone
        else:
            a = self._anchor_text
            ctx = [t[len(a) :] if t.startswith(a) else None for t in self.decode_batch([[self.anchor, i] for i in new])]
        if self._bytes_of is None:
            self._bytes_of = _byte_reader(self.tok)
        spelled = self.tok.convert_ids_to_tokens(new)
        for i, t, c, s in zip(new, alone, ctx, spelled):
            self._alone[i] = t
            self._ctx[i] = t if c is None else c
            self._clean[i] = c is not None and REPLACEMENT not in t and REPLACEMENT not in c
            b = self._bytes[i] = None if s is None else self._bytes_of(s)
            self._starts[i] = b is None or not b or not 0x80 <= b[0] < 0xC0

    def context_text(self, ids: Sequence[int]) -> list[str]:
        """Each id's text inside a text (after the anchor): a view's default for a token
        whose piece in its sequence is no different."""
        ids = [int(i) for i in ids]
        if self.tok is None:
            return [f"[{i}]" for i in ids]
        self._learn(ids)
        return [self._ctx[i] for i in ids]

    def pieces(self, ids: Sequence[int]) -> Pieces:
        """The pieces of one sequence (see the module's docstring)."""
        return self.pieces_many([ids])[0]

    def pieces_many(self, seqs: Sequence[Sequence[int]]) -> list[Pieces]:
        """The pieces of many sequences: their decodes in one batch, each id decoded once."""
        seqs = [[int(i) for i in s] for s in seqs]
        if self.tok is None:
            return [_plain([f"[{i}]" for i in s]) for s in seqs]
        self._learn([i for s in seqs for i in s])
        distinct = list(dict.fromkeys(map(tuple, seqs)))  # a window several rows show: decoded once
        full = self.decode_batch([list(s) for s in distinct]) if distinct else []
        done = {s: self._one(list(s), f) for s, f in zip(distinct, full)}
        return [done[tuple(s)] for s in seqs]

    def windows(self, seqs: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]]) -> list[Pieces]:
        """The pieces of windows inside longer runs of an example's tokens: window i is tokens
        spans[i] = (lo, hi) of seqs[i], which holds up to a few tokens (MARGIN) on either side.
        Each window is decoded from the character boundary at or before lo to the one at or
        after hi: when lo and hi are boundaries its text is exactly `decode(seq[lo:hi])`; a
        character that began before lo shows whole on its last token inside the window, and
        one that runs on past hi shows on no token of it (its tokens there are partial).
        Never a U+FFFD for bytes a window's edge cut."""
        seqs = [[int(i) for i in s] for s in seqs]
        if self.tok is not None:
            self._learn([i for s in seqs for i in s])
        cuts = []
        for s, (lo, hi) in zip(seqs, spans):
            a = next((j for j in range(lo, max(lo - MARGIN, 0) - 1, -1) if self._boundary(s, j)), lo)
            b = next((j for j in range(hi, min(hi + MARGIN, len(s)) + 1) if self._boundary(s, j)), hi)
            cuts.append((a, b))
        pieces = self.pieces_many([s[a:b] for s, (a, b) in zip(seqs, cuts)])
        return [p.window(lo - a, hi - a) for p, (lo, hi), (a, _) in zip(pieces, spans, cuts)]

    def _boundary(self, seq: list[int], j: int) -> bool:
        """Whether a character boundary lies before token j of seq (its ends are boundaries)."""
        return self.tok is None or j <= 0 or j >= len(seq) or self._starts[seq[j]]

    def _one(self, ids: list[int], full: str) -> Pieces:
        if not ids:
            return _plain([])
        cand = [self._alone[ids[0]], *map(self._ctx.__getitem__, ids[1:])]
        clean = list(map(self._clean.__getitem__, ids))
        if all(clean) and "".join(cand) == full:
            return _plain(cand)
        by_bytes = self._by_bytes(ids, full)
        if by_bytes is not None:
            return by_bytes
        n = len(ids)
        bounds = np.zeros(n + 1, np.int64)
        partial = np.zeros(n, bool)
        pos, run = 0, 0  # run: the first token after the last complete one
        for k in range(n):
            c = cand[k]
            if clean[k] and full.startswith(c, pos):
                pos += len(c)
            else:
                d, base = self._decode_from(ids, run, k, bounds[run])
                b = max(base + _common_prefix(d, full[base:]), pos)
                partial[k] = base + len(d) > b
                pos = b
            bounds[k + 1] = pos
            if not partial[k]:
                run = k + 1
        bounds[n] = len(full)
        partial[n - 1] = False
        return Pieces([full[bounds[k] : bounds[k + 1]] for k in range(n)], partial)

    def _by_bytes(self, ids: list[int], full: str) -> Pieces | None:
        """Pieces cut from the tokens' bytes at character boundaries, when every token's bytes
        are known and the pieces join to the decode; else None."""
        spelled = [self._bytes[i] for i in ids]
        if None in spelled:
            return None
        data = b"".join(spelled)
        text, partial, prev, end, n = [], np.zeros(len(ids), bool), 0, 0, len(data)
        for k, b in enumerate(spelled):
            end += len(b)
            cut = _complete(data, prev, end) if end < n and 0x80 <= data[end] < 0xC0 else end
            text.append(data[prev:cut].decode("utf-8", "replace"))
            partial[k], prev = cut < end, cut
        if "".join(text) != full:
            return None  # the decoder is more than UTF-8 of the bytes: the walk decides
        return Pieces(text, partial)

    def _decode_from(self, ids: list[int], s: int, k: int, base: int) -> tuple[str, int]:
        """(the text of tokens s..k as the decode goes on after token s - 1, where that text
        starts in the whole decode): decoded after the anchor when s > 0, else from the start."""
        if s > 0 and self.anchor is not None:
            d = self.decode_batch([[self.anchor, *ids[s : k + 1]]])[0]
            if d.startswith(self._anchor_text):
                return d[len(self._anchor_text) :], int(base)
        return self.decode_batch([ids[: k + 1]])[0], 0

    def labels(self, ids: Sequence[int]) -> tuple[list[str], np.ndarray]:
        """Each token's text alone (token lists: logit tables, tokens most often active) and
        which are raw: a token holding part of a character is shown as its bytes, the bytes
        of no whole character escaped (`\\xe4`), never as U+FFFD."""
        ids = [int(i) for i in ids]
        if self.tok is None:
            return [f"[{i}]" for i in ids], np.zeros(len(ids), bool)
        self._learn(ids)
        out, raw = [], np.zeros(len(ids), bool)
        for j, i in enumerate(ids):
            t = self._alone[i]
            if REPLACEMENT in t:
                b = self._token_bytes(i)
                if b is not None and b.decode("utf-8", "replace") == t:
                    t, raw[j] = b.decode("utf-8", "backslashreplace"), True
            out.append(t)
        return out, raw

    def _token_bytes(self, i: int) -> bytes | None:
        """The bytes of token i: a byte-level BPE token's characters mapped back to bytes,
        or a byte-fallback token `<0xNN>`; None when the tokenizer says neither."""
        self._learn([i])
        return self._bytes[i]


def _complete(data: bytes, start: int, end: int) -> int:
    """Where the text of data[start:end] ends: before the lead byte of its last character
    when that character's bytes run on past `end`, else at `end`."""
    i = end - 1
    while i >= start and i > end - 4 and 0x80 <= data[i] < 0xC0:
        i -= 1  # back over continuation bytes to the character's lead byte
    if i < start or data[i] < 0xC0:
        return end
    need = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
    return i if end - i < need and end < len(data) else end


def _plain(text: list[str]) -> Pieces:
    return Pieces(text, np.zeros(len(text), bool))


ANCHORS = ("a", "e", "x", "\u2581a", "\u0120a")  # tokens that decode to one ASCII letter in most vocabularies


def _anchor(tok: Any) -> tuple[int | None, str]:
    """(an id that decodes alone to a plain letter, its text): what the per-id text in
    context is decoded after. None when the vocabulary has none of ANCHORS."""
    ids = tok.encode("a", add_special_tokens=False)
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    for i in ([ids[0]] if len(ids) == 1 else []) + [vocab[a] for a in ANCHORS if a in vocab]:
        text = tok.decode([int(i)])
        if len(text) == 1 and text.isascii() and text.isalpha():
            return int(i), text
    return None, ""


def _batch_decoder(tok: Any) -> Any:
    """`tok.batch_decode`, or the Rust tokenizer's own batch decode where transformers adds
    nothing to it (no clean_up_tokenization_spaces): the same text without the per-id
    Python conversion."""
    if tok is None:
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and getattr(tok, "clean_up_tokenization_spaces", None) is False:
        return lambda seqs: backend.decode_batch(seqs, skip_special_tokens=False)
    return tok.batch_decode


def _byte_reader(tok: Any) -> Any:
    """A function from a token's string to its bytes (or None), for the tokenizer's decoder."""
    try:
        dec = json.loads(tok.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError, TypeError):
        dec = {}
    kinds = {d.get("type") for d in dec.get("decoders", [dec]) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        table = {c: b for b, c in _bytes_to_unicode().items()}

        def byte_level(s: str) -> bytes | None:
            return bytes(table[c] for c in s) if s and all(c in table for c in s) else None

        return byte_level

    def fallback(s: str) -> bytes | None:
        if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            try:
                return bytes([int(s[3:5], 16)])
            except ValueError:
                return None
        return None

    return fallback


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies spell)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
