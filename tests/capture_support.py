"""Tiny config-built models, a word-level tokenizer and small data for the capture tests.

Everything is built from a fixed seed in milliseconds; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

WORDS = (
    "the a of and to in is it that was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him "
    "two has look more day could go come did number sound no most people my over know water than call "
    "first who may down side been now find capital france paris question answer user assistant"
).split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> user : {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} assistant :{% endif %}"
)


def make_tokenizer():
    """A fast word-level tokenizer with BOS, EOS, pad and a chat template."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) | set(".,?!:")))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(layers: int = 4, seed: int = 0, scale: float | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    if scale is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(scale)
    return model, tok


def tiny_dinov2(layers: int = 3, seed: int = 0, image_size: int = 28):
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    cfg = Dinov2Config(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=image_size,
        patch_size=14,
    )
    return Dinov2Model(cfg).eval()


def save_llama(folder: Path, **kw) -> Path:
    model, tok = tiny_llama(**kw)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def save_dinov2(folder: Path, **kw) -> Path:
    tiny_dinov2(**kw).save_pretrained(folder)
    return folder


def make_images(folder: Path, n: int = 6, seed: int = 0) -> list[Path]:
    """n random RGB PNGs of different sizes and aspect ratios."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        h, w = int(rng.integers(20, 60)), int(rng.integers(20, 60))
        p = folder / f"img{i:02d}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


SENTENCES = [
    "the capital of france is paris",
    "what is the answer to this question ?",
    "we can write some word that people know",
    "one day the water was long",
    "they call him first and then come down",
    "if it is time , make the sound",
    "how many people look at the number",
    "this is a long way from there to here and it has been a long time",
    "a",
]
PAIRS = [
    {"prompt": "what is the capital of france ?", "response": "paris is the capital ."},
    {"prompt": "how many people ?", "response": "two people ."},
    {"prompt": "call him", "response": "i will call him now and then"},
    {"prompt": "what was that sound ?", "response": "water ."},
    {"prompt": "the first day", "response": "was long and the water was up"},
]


def reference_pixels(path_or_rgb, size: int) -> np.ndarray:
    """(3, size, size) ImageNet-normalised pixels: shorter side to `size`, centre crop (computed here independently)."""
    from PIL import Image

    if isinstance(path_or_rgb, np.ndarray):
        im = Image.fromarray(path_or_rgb)
    else:
        im = Image.open(path_or_rgb).convert("RGB")
    w, h = im.size
    s = size / min(w, h)
    nw, nh = max(size, round(w * s)), max(size, round(h * s))
    im = im.resize((nw, nh), Image.BICUBIC)
    l, t = (nw - size) // 2, (nh - size) // 2
    a = np.asarray(im.crop((l, t, l + size, t + size)), np.float32) / 255.0
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    return ((a - mean) / std).transpose(2, 0, 1)


def all_vectors(store, layer: int, segment: str | None = None, content: bool = False) -> np.ndarray:
    """Every stored vector of `layer` (within lengths), float64, from the reader; `content`:
    only those whose token label is 0 (what the statistics of a text store with labels cover)."""
    view = store.segment(segment) if segment else store
    parts = [np.asarray(view[i, layer], np.float64) for i in range(len(store))]
    if content:
        labels = store.field(f"{segment}_token_labels")
        parts = [p[labels[i, : len(p)] == 0] for i, p in enumerate(parts)]
    return np.concatenate(parts, axis=0)
