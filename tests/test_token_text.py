"""Token ids as display pieces (actstore.inputs.tokentext): the pieces of a sequence join to
`tokenizer.decode(ids)` exactly, each character shows once, on the token that completes it,
and the tokens before it in the character are marked partial. Checked against the
definition computed the slow way (every prefix decoded), over German, Cyrillic, CJK, emoji,
math and right-to-left text, with the embedded SmolLM2 tokenizer, a byte-level BPE, a
byte-fallback BPE whose decoder strips the first space, and a word-level tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
from factory import word_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from multilingual import TEXTS, byte_fallback_tokenizer, byte_level_tokenizer, load, slow_pieces, smollm2_tokenizer

from actstore.inputs.tokentext import MARGIN, TokenText

pytestmark = pytest.mark.torch  # the tokenizers are transformers ones


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        "smollm2": smollm2_tokenizer(),
        "byte-level": load(str(byte_level_tokenizer(root / "bl"))),
        "byte-fallback": load(str(byte_fallback_tokenizer(root / "bf"))),
        "word": load(str(word_tokenizer(root / "w"))),
    }


@pytest.fixture(scope="module")
def token_texts(tokenizers):
    """One TokenText per tokenizer for the property tests: its per-id caches carry over from
    example to example, as in a view (a fresh one reads SmolLM2's whole vocabulary, 0.2 s;
    the tests above start fresh)."""
    return {name: TokenText(tok) for name, tok in tokenizers.items()}


@pytest.mark.parametrize("name", ["smollm2", "byte-level", "byte-fallback"])
def test_pieces_join_to_the_decode_and_show_each_character_once(tokenizers, name):
    tok = tokenizers[name]
    tt = TokenText(tok)
    split_seen = 0
    for lang, text in TEXTS.items():
        ids = tok.encode(text, add_special_tokens=False)
        p = tt.pieces(ids)
        assert "".join(p.text) == tok.decode(ids) == text, (name, lang)
        assert "\ufffd" not in "".join(p.text)
        want_text, want_partial = slow_pieces(tok, ids)
        assert p.text == want_text, (name, lang)
        assert p.partial.tolist() == want_partial, (name, lang)
        offsets = p.offsets
        assert offsets[0] == 0 and offsets[-1] == len(text) and (np.diff(offsets) >= 0).all()
        assert [text[a:b] for a, b in zip(offsets[:-1], offsets[1:])] == p.text
        split_seen += int(p.partial.sum())
    assert split_seen > 20  # the texts do split characters across tokens with this tokenizer


def test_a_split_character_shows_on_its_last_token(tokenizers):
    tok = tokenizers["smollm2"]
    ids = tok.encode("die Bäckerei öffnet", add_special_tokens=False)
    p = TokenText(tok).pieces(ids)
    assert [tok.decode([i]) for i in ids][6:8] == [" \ufffd", "\ufffd"]  # 'ö' is split: each alone is U+FFFD
    assert p.text == ["die", " B", "ä", "cke", "re", "i", " ", "ö", "ff", "net"]
    assert p.partial.tolist() == [False] * 6 + [True] + [False] * 3


def test_token_labels_show_bytes_of_a_split_character_never_u_fffd(tokenizers):
    tok = tokenizers["smollm2"]
    ids = tok.encode("Привет ö", add_special_tokens=False)
    text, raw = TokenText(tok).labels(ids)
    assert text == ["\\xd0", "\\x9f", "ри", "в", "ет", " \\xc3", "\\xb6"]
    assert raw.tolist() == [True, True, False, False, False, True, True]
    bf = tokenizers["byte-fallback"]
    ids = bf.encode("日", add_special_tokens=False)
    text, raw = TokenText(bf).labels(ids)
    assert text == ["", "\\xe6", "\\x97", "\\xa5"] and raw.tolist() == [False, True, True, True]


def test_without_a_tokenizer_pieces_are_ids():
    p = TokenText(None).pieces([5, 17])
    assert p.text == ["[5]", "[17]"] and not p.partial.any()
    assert TokenText(None).labels([3])[0] == ["[3]"]


def test_word_level_pieces_carry_the_spaces_the_decode_puts_between_words(tokenizers):
    tok = tokenizers["word"]
    ids = tok.encode("the cat sat", add_special_tokens=False)
    p = TokenText(tok).pieces(ids)
    assert p.text == ["the", " cat", " sat"] and tok.decode(ids) == "the cat sat"


ALPHABET = "aZ 7.!?ÄöüßПриветж日本語中文한국👍🏽🤖👨\u200d👩∀∈ℝ²≥∑∫√مرحباשלום\n\t"


@settings(max_examples=30, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=40), cut=st.tuples(st.integers(0, 60), st.integers(0, 60)))
def test_any_window_of_any_text_joins_to_its_decode(tokenizers, token_texts, text, cut):
    for name in ("smollm2", "byte-level", "byte-fallback"):
        tok = tokenizers[name]
        ids = tok.encode(text, add_special_tokens=False)
        lo, hi = sorted(c % (len(ids) + 1) for c in cut)
        window = ids[lo:hi]
        p = token_texts[name].pieces(window)
        assert "".join(p.text) == tok.decode(window)
        assert len(p.text) == len(window) == len(p.partial)
        assert (np.diff(p.offsets) >= 0).all() and p.offsets[-1] == len(tok.decode(window))
        if window and "\ufffd" not in tok.decode(window):  # a window of whole characters
            assert not p.partial[-1]
            want_text, want_partial = slow_pieces(tok, window)
            assert p.text == want_text and p.partial.tolist() == want_partial, (name, window)


@settings(max_examples=25, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=30), cut=st.tuples(st.integers(0, 80), st.integers(0, 80)))
def test_a_window_cut_inside_a_character_shows_whole_characters_only(tokenizers, token_texts, text, cut):
    for name in ("smollm2", "byte-level", "byte-fallback"):
        tok, tt = tokenizers[name], token_texts[name]
        ids = tok.encode(text, add_special_tokens=False)
        lo, hi = sorted(c % (len(ids) + 1) for c in cut)
        a, b = max(lo - MARGIN, 0), min(hi + MARGIN, len(ids))
        (p,) = tt.windows([ids[a:b]], [(lo - a, hi - a)])
        shown = "".join(p.text)
        assert len(p.text) == hi - lo and "\ufffd" not in shown
        whole = tt.pieces(ids)
        if "\ufffd" not in tok.decode(ids[lo:hi]):  # the window starts and ends between characters
            assert shown == tok.decode(ids[lo:hi])
        if name != "byte-fallback":  # (its decoder drops the first space of a decode)
            # each character shows on the token that completes it in the whole text
            assert p.text == whole.text[lo:hi] and p.partial.tolist() == whole.partial[lo:hi].tolist()


def test_many_sequences_decode_in_one_batch_with_the_same_pieces(tokenizers):
    tok = tokenizers["byte-level"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS.values()]
    windows = [s[i : i + 9] for s in seqs for i in range(0, len(s) - 9, 3)]
    tt = TokenText(tok)
    many = tt.pieces_many(windows + windows[:5])
    assert [m.text for m in many[: len(windows)]] == [TokenText(tok).pieces(w).text for w in windows]
    assert all("".join(m.text) == tok.decode(w) for m, w in zip(many, windows + windows[:5]))
