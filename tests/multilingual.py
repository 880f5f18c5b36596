"""Texts in many scripts and the tokenizers that split them across tokens, for the tests
that every view shows text as `tokenizer.decode(ids)` (tests/test_token_text.py,
tests/test_views_text.py).

- `TEXTS`: German, Cyrillic, CJK, emoji (with a skin-tone modifier and a ZWJ sequence),
  math, Arabic and Hebrew (right to left);
- `byte_level_tokenizer`: a GPT-2-style byte-level BPE trained here on TEXTS with a tiny
  vocabulary, so that most non-ASCII characters are split into byte tokens;
- `byte_fallback_tokenizer`: a Llama-2-style BPE (Metaspace, byte fallback, a decoder that
  strips the leading space): characters outside its vocabulary become <0xNN> tokens;
- `smollm2_tokenizer`: the embedded SmolLM2-135M tokenizer (its GGUF's metadata only);
- `slow_pieces`: the pieces' definition computed the slow way (every prefix decoded);
- `multilingual_store`: a store of those texts' token ids, one text an example, with a
  BOS (label 1) and dimension 0 firing on chosen tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import actstore
from actstore.layout import spec

TEXTS = {
    "german": "die Bäckerei öffnet um 7 Uhr; Grüße aus Köln, Straße für Straße",
    "cyrillic": "Привет! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "cjk": "日本語のテキストと中文的文本，还有한국어 텍스트도 있어요。",
    "emoji": "ok 👍🏽 then 🤖 and the family 👨\u200d👩\u200d👧 waves 👋!",
    "math": "∀x∈ℝ: x²≥0, ∑ᵢ aᵢ ≤ ∫₀^∞ e^{-t} dt ≈ π/√2",
    "arabic": "مرحبا بالعالم، هذا نص عربي للاختبار",
    "hebrew": "שלום עולם, זהו טקסט בעברית לבדיקה",
}


def byte_level_tokenizer(folder) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) of ~300 tokens trained on TEXTS,
    saved as a transformers tokenizer in `folder` (bos `<s>` = id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(list(TEXTS.values()) * 3, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>").save_pretrained(folder)
    return Path(folder)


def byte_fallback_tokenizer(folder) -> Path:
    """A Llama-2-style BPE trained on the German and Latin parts only (so CJK, emoji and
    most of the rest become <0xNN> byte tokens), its decoder stripping the first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special)
    tk.train_from_iterator([TEXTS["german"], "the quick brown fox jumps over the lazy dog"] * 3, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", unk_token="<unk>").save_pretrained(folder)
    return Path(folder)


def smollm2_tokenizer():
    """The embedded SmolLM2 tokenizer (no weights), the one the views and the loader use:
    read once per test process."""
    from actstore.inputs.embedded import smollm2_tokenizer as shared

    return shared()


def load(folder_or_embedded: str):
    """A tokenizer as the views load it: a folder, or embedded:smollm2-135m."""
    if folder_or_embedded.startswith("embedded:"):
        return smollm2_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder_or_embedded)


def multilingual_store(path, tok, model_id: str, *, d_model: int = 4) -> tuple[Path, list[list[int]]]:
    """One example per text of TEXTS (BOS, then its ids; its sample key the text's name),
    ids from `tok`; model_id names the tokenizer. Dimension 0 is 1 + position / 100 on every
    content token whose text alone holds a U+FFFD (a token inside a split character) and
    0.5 elsewhere, so a pass's top rows sit on split characters; the BOS is left out.
    Returns (the store, each example's ids without padding)."""
    bos = tok.bos_token_id if tok.bos_token_id is not None else 0
    seqs = [[bos, *tok.encode(t, add_special_tokens=False)] for t in TEXTS.values()]
    t_max = max(map(len, seqs))
    ids = np.full((len(seqs), t_max), bos, np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    alone = tok.batch_decode([[int(i)] for i in ids.ravel()])
    split = np.array(["\ufffd" in a for a in alone]).reshape(ids.shape)
    x = np.zeros((len(seqs), 1, t_max, d_model), np.float32)
    x[:, 0, :, 0] = np.where(split, 1.0 + np.arange(t_max) / 100, 0.5)
    x[:, 0, 0, :] = 0.0
    labels = np.zeros(ids.shape, np.uint8)
    labels[:, 0] = 1
    with actstore.ShardWriter(
        path,
        layers=[0],
        d_model=d_model,
        segments={"text": t_max},
        token_ids=True,
        token_labels=True,
        token_label_names=dict(spec.TOKEN_KIND_NAMES),
        model_id=model_id,
    ) as w:
        w.append(
            x.astype(np.float16),
            lengths=np.array([len(s) for s in seqs]),
            sample_keys=list(TEXTS),
            token_ids=ids,
            token_labels=labels,
        )
    actstore.finalize(path)
    return Path(path), seqs


def slow_pieces(tok, ids):
    """The definition: token k's piece ends where the decode of ids[:k+1] stops agreeing
    with the whole decode (never before an earlier piece's end); it is partial when that
    decode runs on past it."""
    full = tok.decode(ids)
    ends, partial = [], []
    for k in range(len(ids)):
        d = tok.decode(ids[: k + 1])
        n = next((i for i, (a, b) in enumerate(zip(d, full)) if a != b), min(len(d), len(full)))
        ends.append(max(n, ends[-1] if ends else 0))
        partial.append(len(d) > ends[-1])
    ends[-1], partial[-1] = len(full), False
    starts = [0, *ends[:-1]]
    return [full[a:b] for a, b in zip(starts, ends)], partial
