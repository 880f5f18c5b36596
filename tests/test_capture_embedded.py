"""End to end on the real shipped models (installed by scripts/setup.sh, no download):
DINOv2-S/14 over embedded images, SmolLM2-135M answering a question, MiniLM over pydoc."""

from __future__ import annotations

import json
from pathlib import Path

import forked
import numpy as np
import pytest
import skimage.data
import torch
from capture_support import reference_pixels, write_jsonl
from click.testing import CliRunner
from PIL import Image

import actstore
from actstore.capture import load_model
from actstore.cli import main
from actstore.saev import verify_saev

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    """The shipped SmolLM2, loaded once (seconds of GGUF conversion): the CLI's writes in this
    process reuse it (load_model's cache), and this module runs in one test process."""
    return load_model("embedded:smollm2-135m")


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def _close(got, ref):
    """Within float16 rounding (one ulp, 2**-10 relative) plus float32 run-to-run noise.

    The same input in another buffer takes other SIMD paths in BLAS: the reference forward
    differs from the capture's by ~1e-6 of each token's scale, which fp16 rounding of
    near-zero elements cannot hide; 1e-5 of the token's largest element covers it.
    """
    got = np.asarray(got, np.float32)
    assert got.shape == ref.shape
    tol = np.abs(ref) * 2.0**-10 + 1e-5 * np.abs(ref).max(axis=-1, keepdims=True)
    assert (np.abs(got - ref) <= tol).all(), float((np.abs(got - ref) / tol).max())


def test_embedded_vit_store_equals_hidden_states_and_show(tmp_path):
    out = tmp_path / "vit"
    text = _cli(
        "write",
        out,
        "--model",
        "embedded:dinov2-s14",
        "--data",
        "embedded:images",
        "--layers",
        "4,11",
        "--max-examples",
        "3",
        "--batch-size",
        "2",
        "--quiet",
    )
    assert "wrote 3 examples" in text
    store = actstore.ActStore(out)
    assert (store.d_model, store.config.segments[0].t_max) == (384, 257)  # CLS + 16x16 patches of 14 px
    assert list(store.field("sample_key")) == ["skimage:astronaut", "skimage:chelsea", "skimage:coffee"]
    model = load_model("embedded:dinov2-s14").model  # the same weights the write used (cached)
    px = torch.from_numpy(
        np.stack([reference_pixels(getattr(skimage.data, n)(), 224) for n in ("astronaut", "chelsea", "coffee")])
    )
    with torch.inference_mode():
        hs = [
            model(px[:2], output_hidden_states=True).hidden_states,
            model(px[2:], output_hidden_states=True).hidden_states,
        ]
    for i in range(3):
        for layer in (4, 11):
            _close(store[i, layer], hs[i // 2][layer + 1][i % 2].numpy())
    info = _cli("info", out)
    assert "layer11/tokens" in info and "771" in info  # 3 x 257 vectors per layer
    png = tmp_path / "astronaut.png"
    _cli("show", out, "--ex", "0", "--layer", "11", "-o", png)
    with Image.open(png) as im:
        assert im.size == (2 * 2 * 224 + 24 + 70 + 30, 224 * 2 + 34 + 10)
    # exported to saev with no options beyond the destination (family, CLS and dataset from the capture)
    path = _cli("export-saev", out, tmp_path / "saev", "--quiet").strip().splitlines()[-1]
    md = json.loads((Path(path) / "metadata.json").read_text())
    assert (md["family"], md["dataset"], md["cls_token"], md["patches_per_ex"]) == (
        "dinov2",
        str(tmp_path / "saev" / "embedded-images"),
        True,
        256,
    )
    _cli("verify-saev", path)
    assert verify_saev(path).problems == []


def test_embedded_llm_generates_and_stores_its_hidden_states(tmp_path, smollm2):
    prompt = "What is the capital of France?"
    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": prompt}])
    out = tmp_path / "llm"
    _cli(
        "write",
        out,
        "--model",
        "embedded:smollm2-135m",
        "--data",
        data,
        "--layers",
        "3,15",
        "--chat-template",
        "--generate",
        "8",
        "--quiet",
    )
    store = actstore.ActStore(out)
    assert "Paris" in store.sample(0)["response"]
    lm = smollm2
    tok = lm.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    p_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        gen = lm.model.generate(
            torch.tensor([p_ids]), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
        )[0, len(p_ids) :].tolist()
        hs = lm.model(torch.tensor([p_ids + gen]), output_hidden_states=True).hidden_states
    assert store.lengths(0) == {"prompt": len(p_ids), "response": len(gen)}
    labels = store.field("prompt_token_labels")[0, : len(p_ids)]
    assert (labels == 0).sum() == len(tok(prompt, add_special_tokens=False)["input_ids"])  # the question is content
    assert (labels == 1).sum() >= 4 and (labels == 2).sum() > 0  # <|im_start|>/<|im_end|> and the template text
    for layer in (3, 15):
        _close(store.segment("prompt")[0, layer], hs[layer + 1][0, : len(p_ids)].numpy())
        _close(store.segment("response")[0, layer], hs[layer + 1][0, len(p_ids) :].numpy())


def test_embedded_minilm_over_pydoc_topics(tmp_path):
    out = tmp_path / "bert"
    _cli(
        "write",
        out,
        "--model",
        "embedded:minilm-l6",
        "--data",
        "embedded:pydoc-topics",
        "--layers",
        "1,5",
        "--max-examples",
        "3",
        "--p-max",
        "64",
        "--quiet",
    )
    store = actstore.ActStore(out)
    lm = load_model("embedded:minilm-l6")
    from pydoc_data import topics

    names = sorted(topics.topics)[:3]
    assert list(store.field("sample_key")) == names
    assert store.manifest.truncation["tokens"]["count"] == 3  # every topic is longer than 64 tokens
    for i, name in enumerate(names):
        ids = lm.tokenizer(topics.topics[name])["input_ids"][:64]
        with torch.inference_mode():
            hs = lm.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in (1, 5):
            _close(store[i, layer], hs[layer + 1][0].numpy())
        assert store.field("tokens_token_labels")[i, 0] == 1  # [CLS]


def test_capture_example_runs(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = forked.run(root / "examples" / "capture_record.py", str(tmp_path / "ex"), cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    tok = load_model("embedded:minilm-l6").tokenizer
    texts = ["The cat sat on the mat.", "Activations are stored as float16.", "Paris is the capital of France."]
    for ex, t in enumerate(texts):
        n = len(tok(t)["input_ids"])
        assert f"example {ex}: {n} tokens, layer 5 -> ({n}, 384) float16" in r.stdout
    store = actstore.ActStore(tmp_path / "ex")
    assert int(store.segment("tokens").lengths().sum()) == sum(len(tok(t)["input_ids"]) for t in texts)


def _pydoc_lines(n: int) -> list[str]:
    """n sentences of English prose from Python's own help topics (shipped with Python)."""
    from pydoc_data.topics import topics

    found = [
        line.strip()
        for key in sorted(topics)
        for line in topics[key].splitlines()
        if len(line.strip()) >= 50 and line.strip()[0].isalpha()
    ]
    return found[::7][:n]


def test_embedded_smollm2_token_0_is_a_labelled_bos_and_never_warns_of_the_sink(tmp_path, smollm2):
    """Issue 39 item 1 on the real model: a plain-text capture starts every line with the BOS
    (labelled special, left out by default), and a --bos never store, whose token 0 is the
    attention sink counted as content, is named by the sink check."""
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(_pydoc_lines(24)) + "\n", encoding="utf-8")
    res = CliRunner().invoke(
        main, ["write", str(tmp_path / "auto"), "--model", "embedded:smollm2-135m", "--data", str(lines), "--layers", "16", "--quiet"]
    )  # fmt: skip
    assert res.exit_code == 0 and "warning" not in res.output, res.output
    store = actstore.ActStore(tmp_path / "auto")
    lm = smollm2
    tok = lm.tokenizer
    assert lm.document_bos == tok.convert_tokens_to_ids("<|endoftext|>") == 0  # SmolLM2's document start
    for i, text in enumerate(_pydoc_lines(24)):
        ids = store.token_ids(i).tolist()
        assert ids[0] == lm.document_bos and ids[1:] == tok(text)["input_ids"][: len(ids) - 1]
        assert store.field("tokens_token_labels")[i, 0] == 1
    _cli("features", tmp_path / "auto", "--layer", "16", "--neurons", "-o", tmp_path / "fa", "--quiet")
    import pyarrow.parquet as pq

    top = pq.read_table(tmp_path / "fa" / "top.parquet").to_pandas()
    assert not (top.token == 0).any()  # the BOS (the sink) is no neuron's top activation
    top1 = top[(top["sign"] == 1) & (top["rank"] == 0)]
    lengths = store.segment("tokens").lengths()
    chance = len(store) / float(lengths.sum() - len(store))  # a random kept token is a line's first real token
    sd = np.sqrt(chance * (1 - chance) / len(top1))
    assert len(top1) > 500 and (top1.token == 1).mean() <= chance + 3 * sd, ((top1.token == 1).mean(), chance)
    few = tmp_path / "few.txt"  # the check reads 8 examples or more: 8 lines show the sink
    few.write_text("\n".join(_pydoc_lines(8)) + "\n", encoding="utf-8")
    res = CliRunner().invoke(
        main, ["write", str(tmp_path / "never"), "--model", "embedded:smollm2-135m", "--data", str(few), "--layers", "16", "--quiet", "--bos", "never"]
    )  # fmt: skip
    assert res.exit_code == 0
    assert "attention sink counted as content" in res.output and "layer 16 token 0:" in res.output
    assert "rerun the capture with --bos auto" in res.output
    assert actstore.ActStore(tmp_path / "never").token_ids(0)[0] != tok.bos_token_id
