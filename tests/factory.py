"""The shared store factory of the tests (as zarr.testing.strategies is zarr's): stores of
each kind a user writes, built through the public writer, with their random values drawn
from a seed; and the layouts every feature is combined with.

- `vit_store`: one fixed segment (ViT patches + CLS), token labels, several shards;
- `text_store`: prompt/response segments of random lengths, garbage past the lengths, labels;
- `qa_store`: two padded segments with a text field and statistics, in several shards,
  commits every 600 bytes (resume, copy and object-storage tests);
- `pairs_store`: the loaders' prompt/response store: three layers, lengths that may be 0,
  token-kind labels 0..2, two token chunks a segment, statistics;
- `plain_vit_store`: one fixed segment and nothing else (no labels, no CLS attribute);
- `word_tokenizer` / `word_store`: a word-level tokenizer over WORDS and a store of its
  token ids (BOS labelled special; dimension 0 fires on "zebra"), for views that decode;
- `image_store`: a ViT-like store whose examples are images on disk (and one embedded image);
- `tagged_store`: vectors that say which token they are ([token id, layer, example, segment,
  position, noise...], float32, token ids), for streams that must align tokens;
- `store_cases` / `writer_kwargs`: a hypothesis strategy over every store configuration
  and layout, and the writer arguments of a drawn case;
- `random_acts` / `expected_view`: values representable in a dtype, and what reads return.

New tests build their stores here rather than with a builder of their own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import strategies as st

import actstore
from actstore.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from actstore.layout import spec


def examples(n: int) -> int:
    """A Hypothesis budget below the profile's (a test whose examples are each costly): n under
    the short profile (100 examples a test), scaled with the loaded one (the long one: 10 n);
    the profiles are registered in tests/conftest.py."""
    from hypothesis import settings

    return max(1, n * settings.default.max_examples // 100)


# The store layouts the loader and remote-read tests run on (ShardWriter keyword arguments).
LAYOUTS = {
    "v2": {"zarr_format": 2},
    "v3": {"zarr_format": 3, "shard_examples": None},
    "v3-sharded": {"zarr_format": 3, "shard_examples": 4},
}


def random_acts(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random activations already representable in `dtype` (bf16 as float32 values)."""
    x = rng.standard_normal(shape).astype(np.float32) * 3
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    return x


def expected_view(x: np.ndarray, dtype: str) -> np.ndarray:
    """What ActStore returns for data logged as `x` in a `dtype` store."""
    if dtype == "float16":
        return x.astype(np.float16)
    return x.astype(np.float32)


def vit_store(
    path,
    *,
    n=13,
    layers=(2, 5),
    tokens=5,
    d_model=8,
    dtype="float16",
    cls=True,
    labels=True,
    seed=0,
    t_chunk=None,
    model_id="facebook/dinov2-small",
    attrs=None,
    n_shards=1,
    **writer_kw,
):
    """A ViT-like store (one fixed segment) with random values; cls=None records no cls_token."""
    rng = np.random.default_rng(seed)
    a = {"dataset": "/datasets/images"} | ({} if cls is None else {"cls_token": cls}) | dict(attrs or {})
    per = -(-n // n_shards)
    for shard in range(n_shards):
        b = min(per, n - shard * per)
        with actstore.ShardWriter(
            path,
            shard=shard,
            layers=list(layers),
            d_model=d_model,
            tokens=tokens,
            dtype=dtype,
            token_labels=labels,
            model_id=model_id,
            attrs=a,
            t_chunk=t_chunk,
            **writer_kw,
        ) as w:
            x = (rng.standard_normal((b, len(layers), tokens, d_model)) * 3).astype(np.float32)
            kw = {"token_labels": rng.integers(0, 20, (b, tokens)).astype(np.uint8)} if labels else {}
            w.append(x, **kw)
    actstore.finalize(path)
    return actstore.ActStore(path)


def text_store(
    path,
    *,
    n=9,
    layers=(1, 3),
    p_max=6,
    r_max=4,
    d_model=8,
    dtype="float32",
    labels=True,
    seed=1,
    t_chunk=None,
    kinds=False,
    zarr_format=3,
):
    """A prompt/response store with random lengths, garbage past the lengths, and labels:
    classes 1..8, or with `kinds` token kinds 0..2 (token_label_names: the default mask
    keeps label 0)."""
    rng = np.random.default_rng(seed)
    with actstore.ShardWriter(
        path,
        layers=list(layers),
        d_model=d_model,
        segments={"prompt": p_max, "response": r_max},
        dtype=dtype,
        token_labels=labels,
        token_label_names=dict(spec.TOKEN_KIND_NAMES) if kinds else None,
        model_id="HuggingFaceTB/SmolLM2-135M",
        t_chunk=t_chunk,
        zarr_format=zarr_format,
    ) as w:
        L = len(layers)
        p = (rng.standard_normal((n, L, p_max, d_model)) * 2).astype(np.float32)
        r = (rng.standard_normal((n, L, r_max, d_model)) * 2).astype(np.float32)
        lens = {"prompt": rng.integers(1, p_max + 1, n), "response": rng.integers(0, r_max + 1, n)}
        kw = {}
        if labels:
            lo, hi = (0, 3) if kinds else (1, 9)
            kw["token_labels"] = {
                "prompt": rng.integers(lo, hi, (n, p_max)).astype(np.uint8),
                "response": rng.integers(lo, hi, (n, r_max)).astype(np.uint8),
            }
        w.append(prompt=p, response=r, lengths=lens, **kw)
    actstore.finalize(path)
    return actstore.ActStore(path)


def qa_store(path, *, shards=(0, 1), finalize=True, seed=0, d_model=8, layers=(2, 5), **kw) -> Path:
    """A small question-answer store: two padded segments, a text field, statistics."""
    rng = np.random.default_rng(seed)
    kw.setdefault("zarr_format", 2)  # the chunk-file layout, unless a test names another
    for shard in shards:
        with actstore.ShardWriter(
            path,
            shard=shard,
            layers=list(layers),
            d_model=d_model,
            segments={"prompt": 6, "response": 3},
            texts=["prompt"],
            stats=True,
            commit_bytes=600,
            **kw,
        ) as w:
            for _ in range(2):
                n = 3
                w.append(
                    prompt=rng.standard_normal((n, 2, 6, d_model)).astype(np.float16),
                    response=rng.standard_normal((n, 2, 3, d_model)).astype(np.float16),
                    lengths={"prompt": rng.integers(1, 7, n), "response": rng.integers(1, 4, n)},
                    texts={"prompt": [f"q{shard}-{i}-{rng.integers(1000)}" for i in range(n)]},
                )
    if finalize:
        actstore.finalize(path)
    return Path(path)


def pairs_store(path, seed=0, shards=2, n=7, d=8, dtype="float16", stats=True, **layout):
    """Two shards of a prompt/response store with random lengths (some 0) and token-kind
    labels 0..2 (token_label_names: the default mask keeps label 0) (`layout`: ShardWriter's
    zarr_format, shard_examples...)."""
    rng = np.random.default_rng(seed)
    for shard in range(shards):
        with actstore.ShardWriter(
            path,
            shard=shard,
            layers=[2, 5, 9],
            d_model=d,
            segments={"prompt": 9, "response": 4},
            t_chunk={"prompt": 4, "response": 4},
            dtype=dtype,
            token_labels=True,
            token_label_names=dict(spec.TOKEN_KIND_NAMES),
            stats=stats,
            **layout,
        ) as w:
            w.append(
                prompt=rng.standard_normal((n, 3, 9, d)).astype(np.float32),
                response=rng.standard_normal((n, 3, 4, d)).astype(np.float32),
                lengths={"prompt": rng.integers(0, 10, n), "response": rng.integers(0, 5, n)},
                token_labels={
                    "prompt": rng.integers(0, 3, (n, 9)).astype(np.uint8),
                    "response": rng.integers(0, 3, (n, 4)).astype(np.uint8),
                },
            )
    actstore.finalize(path)
    return actstore.ActStore(path)


def plain_vit_store(path, n=12, t=5, d=6, layers=(0, 1), seed=1, stats=True, **layout):
    """One fixed segment of t tokens, nothing else; the chunk-file layout unless `layout` names another."""
    rng = np.random.default_rng(seed)
    layout = {"zarr_format": 2, **layout}
    with actstore.ShardWriter(path, shard=0, layers=list(layers), d_model=d, tokens=t, stats=stats, **layout) as w:
        w.append(rng.standard_normal((n, len(layers), t, d)).astype(np.float16))
    actstore.finalize(path)
    return actstore.ActStore(path)


TAGGED_SEGMENTS = {"prompt": 9, "response": 4}  # the segments of `tagged_store`


def tagged_store(path, *, d=6, seed=0, shards=2, n=7, layers=(2, 5, 9), ids_seed=None, scale=1.0, **layout):
    """A store whose vectors say which token they are: [token id, layer, example, segment,
    position, noise...] (float32, exact). Token ids are random per (example, position)."""
    rng = np.random.default_rng(seed)
    ids_rng = np.random.default_rng(100 if ids_seed is None else ids_seed)
    len_rng = np.random.default_rng(7)
    ex0 = 0
    for shard in range(shards):
        with actstore.ShardWriter(
            path,
            shard=shard,
            layers=list(layers),
            d_model=d,
            segments=TAGGED_SEGMENTS,
            t_chunk={"prompt": 4, "response": 4},
            dtype="float32",
            token_ids=True,
            stats=True,
            **layout,
        ) as w:
            acts, ids = {}, {}
            for si, (name, t) in enumerate(TAGGED_SEGMENTS.items()):
                tid = ids_rng.integers(0, 50_000, (n, t))
                a = rng.standard_normal((n, len(layers), t, d)).astype(np.float32) * scale
                a[..., 0] = tid[:, None, :]
                a[..., 1] = np.asarray(layers)[None, :, None]
                a[..., 2] = (ex0 + np.arange(n))[:, None, None]
                a[..., 3] = si
                a[..., 4] = np.arange(t)[None, None, :]
                acts[name], ids[name] = a, tid
            lens = {"prompt": len_rng.integers(0, 10, n), "response": len_rng.integers(0, 5, n)}
            w.append(**acts, lengths=lens, token_ids=ids)
        ex0 += n
    actstore.finalize(path)
    return actstore.ActStore(path)


# The vocabulary of `word_tokenizer`; dimension 0 of `word_store` fires on the last word.
WORDS = ["<bos>", "the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "red", "blue", "green", "sun"]
WORDS += ["moon", "zebra"]


def word_tokenizer(folder) -> Path:
    """A word-level transformers tokenizer over WORDS (`<bos>` = id 0), saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<bos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>").save_pretrained(folder)
    return Path(folder)


WORD_D = 6  # the d_model of word_store and image_store


def word_store(path, tokenizer, *, d_model=WORD_D, bos_label=1) -> Path:
    """Two shards of 6 'sentences' of 9 token ids of `word_tokenizer` (its folder is the model
    id): token 0 is <bos> (label `bos_label`: 1 special, 0 content as --bos never stores
    a sink; token kinds) with a huge norm; dimension 0 fires on 'zebra', once a shard."""
    rng = np.random.default_rng(0)
    for shard in range(2):
        n = 6
        ids = rng.integers(1, len(WORDS) - 1, (n, 9))
        ids[:, 0] = 0
        ids[2 + shard, 5] = len(WORDS) - 1  # one zebra per shard
        x = rng.standard_normal((n, 1, 9, d_model)).astype(np.float32) * 0.1
        x[:, 0, :, 0] = (ids == len(WORDS) - 1) * (5.0 + shard) + 0.01 * (ids % 3)
        x[:, 0, 0, :] = 50.0  # a huge BOS: left out by the default mask
        labels = (ids == 0).astype(np.uint8) * bos_label
        with actstore.ShardWriter(
            path,
            shard=shard,
            layers=[4],
            d_model=d_model,
            tokens=9,
            token_ids=True,
            token_labels=True,
            token_label_names=dict(spec.TOKEN_KIND_NAMES),  # token kinds: the default mask leaves the BOS out
            model_id=str(tokenizer),
            world_size=2,
            zarr_format=3,
        ) as w:
            w.append(x.astype(np.float16), token_ids=ids, token_labels=labels)
    actstore.finalize(path)
    return Path(path)


def image_store(path, images, *, d_model=WORD_D) -> Path:
    """A ViT-like store (1 CLS + 3x3 patches, layer 11) of 4 random images written into the
    folder `images` and one embedded image; dimension 1 fires on example 1's patch (1, 2),
    dimension 0 on example 4's (the embedded image) patch (0, 0). Needs Pillow."""
    from PIL import Image

    rng = np.random.default_rng(2)
    refs = []
    for i in range(4):
        p = Path(images) / f"im{i}.png"
        Image.fromarray(rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)).save(p)
        refs.append({"path": str(p)})
    refs.append({"embedded": "skimage:camera"})  # an embedded image (actstore write --data embedded:images)
    x = rng.standard_normal((5, 1, 10, d_model)).astype(np.float32) * 0.1
    x[1, 0, 1 + 5, 1] = 9.0  # example 1, patch (1, 2)
    x[4, 0, 1 + 0, 0] = 7.0  # example 4 (the embedded image), patch (0, 0)
    with actstore.ShardWriter(
        path,
        layers=[11],
        d_model=d_model,
        tokens=10,
        texts=("image",),
        model_id="a-vit",
        attrs={"image": {"size": 28, "patch_size": 14, "grid": [3, 3], "prefix_tokens": 1}},
    ) as w:
        w.append(x.astype(np.float16), texts={"image": refs}, sample_keys=[f"im{i}" for i in range(5)])
    actstore.finalize(path)
    return Path(path)


def odd_token_store(path, tokenizer_folder, *, model_id: str | None = None) -> Path:
    """Tokens a page must not let loose: a right-to-left override, an isolate and a
    10,000-character token, in 3 examples of 8 tokens (a word-level tokenizer of its own saved
    in `tokenizer_folder`; `model_id` "" records none). Dimension 0 fires on the override token,
    dimension 1 on the long one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "left", "\u202eright", "\u2066iso", "x" * 10000, "end"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<bos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(tokenizer_folder)
    ids = np.array([[0, 1, 2, 3, 4, 5, 1, 5]] * 3)
    x = np.zeros((3, 1, 8, 4), np.float32)
    x[:, 0, 2, 0] = [3.0, 2.0, 1.0]
    x[:, 0, 4, 1] = [1.0, 2.0, 3.0]
    mid = str(tokenizer_folder) if model_id is None else model_id
    with actstore.ShardWriter(path, layers=[0], d_model=4, tokens=8, token_ids=True, model_id=mid) as w:
        w.append(x.astype(np.float16), token_ids=ids)
    actstore.finalize(path)
    return Path(path)


def chat_word_store(path, model_id: str, *, d_model=6) -> Path:
    """One prompt/response example of `word_tokenizer` ids: a BOS (label 1, dimension 0 =
    1000) then content tokens whose dimension 0 is 1..6 (prompt: 3 tokens, response: 3)."""
    ids = {"prompt": np.array([[0, 1, 2, 3]]), "response": np.array([[4, 5, 6]])}
    prompt = np.zeros((1, 1, 4, d_model), np.float32)
    response = np.zeros((1, 1, 3, d_model), np.float32)
    prompt[0, 0, :, 0] = [1000.0, 1.0, 2.0, 3.0]
    response[0, 0, :, 0] = [4.0, 5.0, 6.0]
    labels = {"prompt": np.array([[1, 0, 0, 0]], np.uint8), "response": np.zeros((1, 3), np.uint8)}
    with actstore.ShardWriter(
        path,
        layers=[0],
        d_model=d_model,
        segments={"prompt": 4, "response": 3},
        token_ids=True,
        token_labels=True,
        token_label_names=dict(spec.TOKEN_KIND_NAMES),  # the BOS is a special token: a kind, not a class
        model_id=model_id,
    ) as w:
        w.append(
            prompt=prompt.astype(np.float16),
            response=response.astype(np.float16),
            lengths={"prompt": np.array([4]), "response": np.array([3])},
            token_ids=ids,
            token_labels=labels,
        )
    actstore.finalize(path)
    return Path(path)


@st.composite
def store_cases(draw):
    """A hypothesis strategy: a store's shape, dtype, segments, layout, writers and batches."""
    n_layers = draw(st.integers(1, 3))
    layers = sorted(draw(st.lists(st.integers(0, 40), min_size=n_layers, max_size=n_layers, unique=True)))
    d_model = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    multi = draw(st.booleans())
    if multi:
        segs = {"prompt": draw(st.integers(1, 9)), "response": draw(st.integers(1, 6))}
    else:
        segs = {"tokens": draw(st.integers(1, 12))}
    t_chunk = draw(st.one_of(st.none(), st.integers(1, 5)))
    storage = draw(st.sampled_from(["v2", "v2-zarr", "v3", "v3-sharded"]))
    n_writers = draw(st.integers(1, 3))
    writers = []
    for _ in range(n_writers):
        batches = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
        writers.append(batches)
    commit_bytes = draw(st.sampled_from([1, 10_000, 10**9]))
    return dict(
        layers=layers,
        d_model=d_model,
        dtype=dtype,
        multi=multi,
        segs=segs,
        t_chunk=t_chunk,
        storage=storage,
        writers=writers,
        commit_bytes=commit_bytes,
        seed=draw(st.integers(0, 2**16)),
    )


def writer_kwargs(case):
    """ShardWriter's keyword arguments for a case drawn from `store_cases`."""
    kw = dict(
        layers=case["layers"],
        d_model=case["d_model"],
        dtype=case["dtype"],
        t_chunk=case["t_chunk"],
        commit_bytes=case["commit_bytes"],
    )
    if case["multi"]:
        kw["segments"] = case["segs"]
    else:
        kw["tokens"] = case["segs"]["tokens"]
    s = case["storage"]
    if s == "v2-zarr":
        kw["engine"] = "zarr"
    elif s == "v3":
        kw["zarr_format"] = 3
    elif s == "v3-sharded":
        kw["zarr_format"] = 3
        kw["shard_examples"] = 2
    return kw


def cli(*args, ok: bool = True):
    """`actstore ARGS` run in this process (click's runner, every argument str()-ed); with
    ok, its exit code must be 0 (the output and exception shown otherwise)."""
    from click.testing import CliRunner

    from actstore.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert res.exit_code == 0, res.output + repr(res.exception)
    return res
