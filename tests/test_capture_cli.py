"""`actstore write` and `actstore show` on tiny saved models: equality with the model's own
hidden states, text segments and masks, parallel writers, bad input."""

from __future__ import annotations

import html
import json
import re

import forked
import numpy as np
import pytest
import torch
from capture_support import (
    PAIRS,
    SENTENCES,
    all_vectors,
    make_images,
    reference_pixels,
    save_dinov2,
    save_llama,
    tiny_dinov2,
    tiny_llama,
    write_jsonl,
)
from factory import cli
from PIL import Image

import actstore
from actstore.read.info import store_info


def assert_f16_close(got: np.ndarray, ref: np.ndarray) -> None:
    """Within float16 rounding: at most one fp16 ulp of the reference apart."""
    got = np.asarray(got, np.float32)
    ulp = np.maximum(np.abs(ref), 2.0**-14) * 2.0**-10
    assert got.shape == ref.shape
    assert (np.abs(got - ref) <= ulp).all(), float(np.abs(got - ref).max())


@pytest.fixture(scope="module")
def dino_dir(tmp_path_factory):
    return save_dinov2(tmp_path_factory.mktemp("m") / "dino", layers=3)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("m") / "llama", layers=3)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("imgs")
    make_images(folder, n=6)
    return folder


def test_image_folder_store_equals_hidden_states_and_show(tmp_path, dino_dir, images):
    out = tmp_path / "s"
    res = cli("write", out, "--model", dino_dir, "--data", images, "--layers", "0,2", "--batch-size", "4", "--quiet")
    assert "wrote 6 examples" in res.output and "finalized" in res.output
    store = actstore.ActStore(out)
    assert not store.config.token_ids and store.token_ids(0) is None  # images have no vocabulary
    model = tiny_dinov2(layers=3)  # the same seed: the same weights as the saved folder
    files = sorted(images.glob("*.png"))
    px = torch.from_numpy(np.stack([reference_pixels(f, 28) for f in files]))
    with torch.inference_mode():
        hs = [
            model(px[:4], output_hidden_states=True).hidden_states,
            model(px[4:], output_hidden_states=True).hidden_states,
        ]
    for i in range(6):
        for layer in (0, 2):
            assert_f16_close(store[i, layer], hs[i // 4][layer + 1][i % 4].numpy())
        assert store.sample(i)["sample_key"] == files[i].name
        assert store.sample(i)["image"] == {"path": str(files[i].resolve())}
    assert store.config.attrs["image"]["grid"] == [2, 2] and store.config.attrs["image"]["prefix_tokens"] == 1
    png = tmp_path / "p.png"
    res = cli("show", out, "--ex", "3", "--layer", "2", "-o", png)
    with Image.open(png) as im:
        assert im.size[0] > 2 * 2 * 28 and im.mode == "RGB"
        arr = np.asarray(im)
        drawn = {k: v for k, v in im.text.items() if k.startswith("actstore:")}  # the state it was drawn from
    assert drawn == {"actstore:store": str(out), "actstore:manifest_sha256": store.manifest_sha256}
    assert len(np.unique(arr.reshape(-1, 3), axis=0)) > 50  # a picture, not a blank canvas


def test_text_store_truncates_masks_and_equals_hidden_states(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES])
    out = tmp_path / "s"
    res = cli(
        "write",
        out,
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "0,1",
        "--p-max",
        "7",
        "--batch-size",
        "4",
        "--quiet",
    )
    store = actstore.ActStore(out)
    model, tok = tiny_llama(layers=3)
    full = [tok(s)["input_ids"] for s in SENTENCES]
    cut, total = sum(max(len(f) - 7, 0) for f in full), sum(len(f) for f in full)
    assert (
        f"truncated: {cut:,} of the data's {total:,} tokens ({100 * cut / total:.1f}%) exceeded the token budgets"
        in res.output
    )
    assert store.manifest.truncation["tokens"]["count"] == sum(len(f) > 7 for f in full) > 0
    assert list(store.texts("text")) == SENTENCES
    labels = store.field("tokens_token_labels")
    for i, ids in enumerate(full):
        ids = ids[:7]
        assert store.lengths(i)["tokens"] == len(ids)
        assert store.token_ids(i).tolist() == ids  # the vocabulary id of every stored token
        assert labels[i, 0] == 1 and (labels[i, 1 : len(ids)] == 0).all()  # <s> is special
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in (0, 1):
            assert_f16_close(store[i, layer], hs[layer + 1][0].numpy())


def test_pairs_with_chat_template_label_template_tokens(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "1",
        "--chat-template",
        "--r-max",
        "4",
        "--quiet",
    )
    store = actstore.ActStore(out)
    assert store.segments == ("prompt", "response")
    model, tok = tiny_llama(layers=3)
    lab_p = store.field("prompt_token_labels")
    for i, pair in enumerate(PAIRS):
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": pair["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        p_ids = tok(rendered, add_special_tokens=False)["input_ids"]
        r_ids = tok(pair["response"], add_special_tokens=False)["input_ids"][:4]
        assert store.lengths(i) == {"prompt": len(p_ids), "response": len(r_ids)}
        assert store.token_ids(i).tolist() == p_ids + r_ids
        words = [tok.convert_ids_to_tokens(t) for t in p_ids]
        want = [1 if w in ("<s>", "</s>") else (2 if w in ("user", "assistant", ":") else 0) for w in words]
        assert lab_p[i, : len(p_ids)].tolist() == want
        with torch.inference_mode():
            hs = model(torch.tensor([p_ids + r_ids]), output_hidden_states=True).hidden_states[2][0].numpy()
        assert_f16_close(store.segment("prompt")[i, 1], hs[: len(p_ids)])
        assert_f16_close(store.segment("response")[i, 1], hs[len(p_ids) :])
        assert store.sample(i)["response"] == pair["response"]
    trunc = sum(len(tok(p["response"], add_special_tokens=False)["input_ids"]) > 4 for p in PAIRS)
    assert store.manifest.truncation["response"]["count"] == trunc > 0


def test_special_tokens_dropped_and_quantile_budget(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", SENTENCES)  # plain JSON strings
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "1",
        "--special",
        "drop",
        "--p-quantile",
        "0.5",
        "--quiet",
    )
    store = actstore.ActStore(out)
    model, tok = tiny_llama(layers=3)
    lens = [len(tok(s)["input_ids"]) - 1 for s in SENTENCES]  # the budget counts stored tokens: not the dropped <s>
    p_max = int(np.quantile(lens, 0.5, method="higher"))
    assert store.config.segment("tokens").t_max == p_max and not store.config.token_labels
    assert max(store.lengths(i)["tokens"] for i in range(len(store))) == p_max  # no slot kept for a token never stored
    for i, s in enumerate(SENTENCES):
        ids = tok(s)["input_ids"][: p_max + 1]  # <s> and p_max stored tokens
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0].numpy()
        assert_f16_close(store[i, 1], hs[1:])  # position 0 (<s>) is not stored
        assert store.token_ids(i).tolist() == ids[1:]  # ids of the stored tokens only


def test_generate_responses(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p["prompt"]} for p in PAIRS[:3]])
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "1",
        "--generate",
        "3",
        "--batch-size",
        "2",
        "--quiet",
    )
    store = actstore.ActStore(out)
    model, tok = tiny_llama(layers=3)
    from actstore.inputs.prepare import separator_tokens

    sep = separator_tokens(tok, "\n")
    assert sep == [tok.eos_token_id]  # this tokenizer drops whitespace: the separator falls back to its EOS
    for i, pair in enumerate(PAIRS[:3]):
        p_ids = tok(pair["prompt"])["input_ids"] + sep  # the explicit separator ends the prompt
        with torch.inference_mode():
            gen = model.generate(
                torch.tensor([p_ids]), max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id
            )[0, len(p_ids) :].tolist()
        if tok.eos_token_id in gen:
            gen = gen[: gen.index(tok.eos_token_id) + 1]
        assert store.lengths(i) == {"prompt": len(p_ids), "response": len(gen)}
        assert store.sample(i)["response"] == tok.decode(gen, skip_special_tokens=True)
        with torch.inference_mode():
            hs = model(torch.tensor([p_ids + gen]), output_hidden_states=True).hidden_states[2][0].numpy()
        assert_f16_close(store.segment("response")[i, 1], hs[len(p_ids) :])


@pytest.mark.slow
def test_workers_and_ranks_equal_a_single_writer(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS * 2)
    common = ["--model", llama_dir, "--data", data, "--layers", "0,2", "--batch-size", "2", "--quiet"]
    cli("write", tmp_path / "one", *common)
    cli("write", tmp_path / "two", *common, "--workers", "2")
    cli("write", tmp_path / "r", *common, "--rank", "1", "--world-size", "2")
    res = cli("write", tmp_path / "r", *common, "--rank", "0", "--world-size", "2")
    assert "run `actstore finalize" in res.output
    cli("finalize", tmp_path / "r")
    one = actstore.ActStore(tmp_path / "one")
    for other in (actstore.ActStore(tmp_path / "two"), actstore.ActStore(tmp_path / "r")):
        assert len(other.manifest.shards) == 2 and len(other) == len(one) == 10
        assert list(other.field("sample_key")) == list(one.field("sample_key"))
        assert list(other.texts("response")) == list(one.texts("response"))
        for i in range(len(one)):
            for layer in (0, 2):
                np.testing.assert_array_equal(other[i, layer], one[i, layer])
        st = other.stats()
        for layer in (0, 2):
            for seg in ("prompt", "response"):
                v = all_vectors(other, layer, seg, content=True)  # statistics cover content tokens (label 0)
                k = st.keys.index(f"layer{layer}/{seg}")
                scale = float(v.std(0).max())  # float32 blocks merged in float64: within 1e-6 of numpy
                np.testing.assert_allclose(st.mean[k], v.mean(0), rtol=1e-6, atol=1e-7 * scale)
                np.testing.assert_allclose(st.m2[k] / st.count[k], v.var(0), rtol=1e-6, atol=1e-7 * scale**2)
                assert st.count[k] == len(v)


def test_info_shows_statistics(tmp_path, dino_dir, images):
    cli("write", tmp_path / "s", "--model", dino_dir, "--data", images, "--layers", "1", "--quiet")
    out = cli("info", tmp_path / "s").output
    assert "layer1/tokens" in out and "overflow" in out and "30" in out  # 6 images x 5 tokens


@pytest.mark.parametrize(
    "case, message",
    [
        ("layer", r"actstore: error: layer 9 does not exist: .*dino has 3 blocks, so layers 0..2 \(or -3..-1\) exist"),
        ("empty_folder", r"actstore: error: --data .*: no images \(.jpg.*\) in this folder; nothing to capture"),
        ("empty_jsonl", r"actstore: error: --data .*empty.jsonl holds no examples; nothing to capture"),
        ("bad_image", r"actstore: error: cannot read image .*broken.png: .*; remove or replace the file"),
        (
            "truncated_image",
            r"actstore: error: cannot read image .*img00.png: .*truncated.*; remove or replace the file",
        ),
        ("modality", r"actstore: error: model .* takes image input but --data .* holds text examples"),
        ("bad_json", r"actstore: error: .*bad.jsonl:2: not valid JSON"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, dino_dir, images, case, message):
    import shutil

    data = images
    layers = "0"
    if case == "layer":
        layers = "0,9"
    elif case == "empty_folder":
        data = tmp_path / "none"
        data.mkdir()
    elif case == "empty_jsonl":
        data = tmp_path / "empty.jsonl"
        data.write_text("\n")
    elif case == "bad_image":
        data = tmp_path / "imgs"
        shutil.copytree(images, data)
        (data / "broken.png").write_bytes(b"\x89PNG not really an image")
    elif case == "truncated_image":  # the header reads, the pixels do not
        data = tmp_path / "imgs"
        shutil.copytree(images, data)
        raw = (data / "img00.png").read_bytes()
        (data / "img00.png").write_bytes(raw[: len(raw) // 2])
    elif case == "modality":
        data = write_jsonl(tmp_path / "t.jsonl", ["some text"])
    elif case == "bad_json":
        data = tmp_path / "bad.jsonl"
        data.write_text('{"text": "ok"}\n{"text": \n')
    out = tmp_path / "s"
    res = cli("write", out, "--model", dino_dir, "--data", data, "--layers", layers, "--quiet", ok=False)
    assert res.exit_code == 1
    assert re.search(message, res.output), res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_fp16_overflow_via_cli(tmp_path):
    folder = save_llama(tmp_path / "big", layers=2, scale=1e7)
    data = write_jsonl(tmp_path / "t.jsonl", SENTENCES[:3])
    res = cli("write", tmp_path / "s", "--model", folder, "--data", data, "--layers", "0", "--quiet", ok=False)
    assert res.exit_code == 1
    assert re.search(
        r"actstore: error: segment 'tokens': \d+ finite float32 values lie beyond the range of float16", res.output
    ), res.output
    assert not (tmp_path / "s").exists()
    cli("write", tmp_path / "c", "--model", folder, "--data", data, "--layers", "0", "--on-overflow", "clip", "--quiet")
    store = actstore.ActStore(tmp_path / "c")
    st = store.stats()
    assert st.overflow[0] == store.manifest.overflow["tokens"] > 0
    cli("write", tmp_path / "f", "--model", folder, "--data", data, "--layers", "0", "--dtype", "float32", "--quiet")
    assert np.abs(all_vectors(actstore.ActStore(tmp_path / "f"), 0)).max() > 65504


def test_datasets_folder(tmp_path, llama_dir):
    import datasets

    datasets.Dataset.from_dict({"text": SENTENCES[:4]}).save_to_disk(str(tmp_path / "ds"))
    cli("write", tmp_path / "s", "--model", llama_dir, "--data", tmp_path / "ds", "--layers", "1", "--quiet")
    store = actstore.ActStore(tmp_path / "s")
    assert list(store.texts("text")) == SENTENCES[:4]
    assert list(store.field("sample_key")) == ["row-0", "row-1", "row-2", "row-3"]
    model, tok = tiny_llama(layers=3)
    with torch.inference_mode():
        hs = (
            model(torch.tensor([tok(SENTENCES[2])["input_ids"]]), output_hidden_states=True).hidden_states[2][0].numpy()
        )
    assert_f16_close(store[2, 1], hs)


def test_show_colours_a_text_stores_tokens(tmp_path, llama_dir):
    """A text store shows as an HTML page of its decoded tokens (the tokenizer the store
    records), each coloured by a dimension with the value and the id on hover."""
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "t.jsonl", SENTENCES[:2])
    cli("write", tmp_path / "s", "--model", llama_dir, "--data", data, "--layers", "1", "--quiet")
    cli("show", tmp_path / "s", "--ex", "1", "--layer", "1", "--dim", "3", "-o", tmp_path / "x.html")
    page = (tmp_path / "x.html").read_text()
    store = actstore.ActStore(tmp_path / "s")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = [int(i) for i in store.token_ids(1)]
    for i, v in zip(ids, np.asarray(store[1, 1], np.float32)[:, 3]):
        assert f'title="{float(v):.4g} · id {i}' in page
    # the tokens' pieces join to the decode of the example's ids (text decoded as text, not per token)
    pieces = re.findall(r'<span class="tk[^"]*" style="[^"]*" title="[^"]*">([^<]*)</span>', page)
    assert len(pieces) == len(ids) and html.unescape("".join(pieces)) == tok.decode(ids)
    res = cli("show", tmp_path / "s", "--ex", "0", "--ex", "1", "--layer", "1", ok=False)
    assert res.exit_code != 0 and "a text store shows one example at a time" in res.output


def test_max_examples_and_json_records(tmp_path, llama_dir):
    rows = [{"id": f"doc{i}", "text": s} for i, s in enumerate(SENTENCES)]
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    cli(
        "write", tmp_path / "s", "--model", llama_dir, "--data", data, "--layers", "0", "--max-examples", "3", "--quiet"
    )
    store = actstore.ActStore(tmp_path / "s")
    assert list(store.field("sample_key")) == ["doc0", "doc1", "doc2"]
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["n_examples"] == 3


def test_workers_report_a_shared_error_once_and_leave_nothing(tmp_path, dino_dir, images):
    out = tmp_path / "s"
    res = cli(
        "write", out, "--model", dino_dir, "--data", images, "--layers", "0,9", "--workers", "2", "--quiet", ok=False
    )
    assert res.exit_code == 1
    assert res.output.strip() == (  # found from the model's config before any writer starts
        f"actstore: error: layer 9 does not exist: {dino_dir} has 3 blocks, so layers 0..2 (or -3..-1) "
        "exist; names: blocks.N.hook_resid_pre|hook_attn_out|attn.hook_z|hook_resid_mid|hook_mlp_in|mlp.hook_post|hook_mlp_out|hook_resid_post, or module paths"
    )
    assert not out.exists()


def test_chat_template_needs_prompts(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", SENTENCES[:2])
    res = cli(
        "write",
        tmp_path / "s",
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "0",
        "--chat-template",
        "--quiet",
        ok=False,
    )
    assert res.exit_code == 1 and "--chat-template wraps prompts" in res.output
    assert not (tmp_path / "s").exists()


def test_docs_name_every_write_option():
    from pathlib import Path

    from actstore.cli.capture import write_cmd
    from actstore.cli.views import show_cmd

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "cli.md").read_text() + (root / "docs" / "capture.md").read_text()
    opts = [o for cmd in (write_cmd, show_cmd) for p in cmd.params for o in p.opts if o.startswith("--")]
    assert len(opts) > 25
    missing = [o for o in opts if o not in docs]
    assert missing == [], f"options of actstore write/show not documented: {missing}"


def test_writing_over_an_existing_store_needs_resume(tmp_path, dino_dir, images):
    out = tmp_path / "s"
    cli("write", out, "--model", dino_dir, "--data", images, "--layers", "0", "--quiet")
    before = actstore.ActStore(out)[2, 0].copy()
    res = cli("write", out, "--model", dino_dir, "--data", images, "--layers", "0", "--quiet", ok=False)
    assert res.exit_code == 1
    assert (
        res.output.strip()
        == f"actstore: error: {out} already holds shard 0 (6 examples committed, complete); pass --resume to continue the run, "
        f"or remove {out} or write to a new path to start over"
    )
    np.testing.assert_array_equal(actstore.ActStore(out)[2, 0], before)


def test_captured_vit_store_exports_to_saev_without_extra_options(tmp_path, dino_dir, images):
    """Capture records what saev export needs (cls_token, family, dataset)."""
    out = tmp_path / "s"
    cli("write", out, "--model", dino_dir, "--data", images, "--layers", "1,2", "--quiet")
    attrs = actstore.ActStore(out).config.attrs
    assert attrs["cls_token"] is True and attrs["family"] == "dinov2" and attrs["dataset"] == str(images.resolve())
    res = cli("export-saev", out, tmp_path / "dump", "--quiet")
    saev_dir = res.output.strip().splitlines()[-1]
    meta = json.loads((tmp_path / "dump" / saev_dir.rsplit("/", 1)[-1] / "metadata.json").read_text())
    assert meta["cls_token"] is True and meta["family"] == "dinov2" and meta["dataset"] == str(images.resolve())
    store, exported = actstore.ActStore(out), actstore.open(saev_dir)
    assert exported.layers == (1, 2) and len(exported) == len(store) == 6
    np.testing.assert_array_equal(exported[5, 2], store[5, 2].astype(np.float32))


@pytest.mark.slow
def test_sharded_layout_with_workers_equals_a_single_v2_writer(tmp_path, llama_dir, monkeypatch):
    import zarr

    forked.writers_from_forkserver(monkeypatch)  # the spawned writers: test_workers_and_ranks_equal_a_single_writer

    data = write_jsonl(tmp_path / "p.jsonl", PAIRS * 2)
    common = ["--model", llama_dir, "--data", data, "--layers", "0,2", "--batch-size", "2", "--quiet"]
    sharded = ["--zarr-format", "3", "--shard-examples", "3"]
    cli("write", tmp_path / "v2", *common, "--zarr-format", "2")
    cli("write", tmp_path / "v3", *common, *sharded, "--workers", "2")
    one, other = actstore.ActStore(tmp_path / "v2"), actstore.ActStore(tmp_path / "v3")
    assert other.config.zarr_format == 3 and other.config.shard_examples == 3 and one.config.zarr_format == 2
    assert len(other) == len(one) == 10 and list(other.field("sample_key")) == list(one.field("sample_key"))
    for i in range(len(one)):
        for layer in (0, 2):
            np.testing.assert_array_equal(other[i, layer], one[i, layer])
    # Each writer's 5 examples lie in 2 shard files (3 + 2 examples), which zarr-python reads.
    arr_dir = tmp_path / "v3" / "shards" / "shard-00001.zarr" / "arrays" / "prompt_activations"
    assert sorted(p.name for p in (arr_dir / "c").iterdir()) == ["0", "1"]
    z = zarr.open_array(str(arr_dir), mode="r")
    assert z.shape[0] == 5 and z.shards == (3, *z.shape[1:])
    np.testing.assert_array_equal(z[4, 1, : other.lengths(9)["prompt"]], other.segment("prompt")[9, 2])
    assert cli("verify", tmp_path / "v3", "--deep").exit_code == 0
    assert "wrote 0 examples" in cli("write", tmp_path / "v3", *common, *sharded, "--workers", "2", "--resume").output
    # Another writer of the same store must use its layout: another one is refused.
    cli("write", tmp_path / "r", *common, *sharded, "--rank", "1", "--world-size", "2")
    res = cli("write", tmp_path / "r", *common, "--zarr-format", "2", "--rank", "0", "--world-size", "2", ok=False)
    assert (
        res.exit_code == 1 and "already holds a different actstore store" in res.output and "zarr_format" in res.output
    )
    cli("write", tmp_path / "r", *common, *sharded, "--rank", "0", "--world-size", "2")
    cli("finalize", tmp_path / "r")
    ranks = actstore.ActStore(tmp_path / "r")
    assert len(ranks) == 10
    for i in range(len(one)):
        np.testing.assert_array_equal(ranks[i, 2], one[i, 2])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zarr-format", "2", "--shard-examples", "4"], "--shard-examples (Zarr sharding) needs --zarr-format 3"),
        (["--zarr-format", "3", "--shard-examples", "0"], "--shard-examples must be a positive int. Got 0."),
    ],
)
def test_bad_layout_options_are_refused_before_anything_is_written(tmp_path, dino_dir, images, args, message):
    out = tmp_path / "s"
    res = cli("write", out, "--model", dino_dir, "--data", images, "--layers", "0", "--quiet", *args, ok=False)
    assert res.exit_code == 1 and res.output.strip() == f"actstore: error: {message}"
    assert not out.exists()


def test_writer_nice_option_reaches_the_capture_and_is_range_checked(tmp_path, monkeypatch):
    import actstore.capture.run as run_mod
    from actstore.capture import CaptureError

    got = []

    def fake_write(o):
        got.append(o)
        raise CaptureError("stopped before capture")

    monkeypatch.setattr(run_mod, "write", fake_write)
    args = ("write", tmp_path / "s", "--model", "m", "--data", "d", "--layers", "0")
    assert cli(*args, ok=False).output.strip() == "actstore: error: stopped before capture"
    cli(*args, "--writer-nice", "3", ok=False)
    assert [o.writer_nice for o in got] == [10, 3]
    res = cli(*args, "--writer-nice", "20", ok=False)
    assert res.exit_code == 2 and "--writer-nice" in res.output and len(got) == 2


@pytest.mark.slow
def test_capture_to_s3_equals_a_local_capture(tmp_path, s3_url, dino_dir, images, monkeypatch):
    forked.writers_from_forkserver(monkeypatch)
    cli(
        "write",
        tmp_path / "local",
        "--model",
        dino_dir,
        "--data",
        images,
        "--layers",
        "0,2",
        "--batch-size",
        "4",
        "--quiet",
    )
    cli(
        "write",
        s3_url,
        "--model",
        dino_dir,
        "--data",
        images,
        "--layers",
        "0,2",
        "--batch-size",
        "4",
        "--workers",
        "2",
        "--quiet",
    )
    local, remote = actstore.ActStore(tmp_path / "local"), actstore.ActStore(s3_url)
    assert len(local) == len(remote) == 6
    for ex in range(6):
        for layer in (0, 2):
            np.testing.assert_array_equal(remote[ex, layer], local[ex, layer])
    assert cli("verify", "--deep", s3_url).output.startswith(f"verify (deep) {s3_url}: 6 examples in 2 shards")
    assert cli("verify", "--deep", "--quiet", s3_url).output == ""  # sound: nothing to say


def test_capture_to_a_missing_bucket_fails_before_the_model_loads(s3_endpoint, dino_dir, images, monkeypatch):
    import actstore.capture.run as run_mod

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "load_model", no_model)
    res = cli(
        "write", "s3://no-such-bucket/acts", "--model", dino_dir, "--data", images, "--layers", "0", "--quiet", ok=False
    )
    assert res.exit_code == 1
    assert res.output.startswith(
        "actstore: error: cannot list s3://no-such-bucket/acts: the bucket 'no-such-bucket' does not exist"
    )


def test_default_budgets_come_from_the_measured_lengths(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS * 3)
    out = tmp_path / "s"
    cli("write", out, "--model", llama_dir, "--data", data, "--layers", "1", "--quiet")
    store = actstore.ActStore(out)
    _, tok = tiny_llama(layers=3)
    from actstore.inputs.prepare import TextPlan, prompt_tokens, response_tokens

    plan = TextPlan(kind="pair", p_max=1, r_max=0, special="mask", chat_template=False, generate=0)
    p_lens = [len(prompt_tokens(tok, plan, p["prompt"])[0]) for p in PAIRS * 3]
    r_lens = [len(response_tokens(tok, p["response"])[0]) for p in PAIRS * 3]
    want = {
        "prompt": int(np.quantile(p_lens, 0.99, method="higher")),
        "response": int(np.quantile(r_lens, 0.99, method="higher")),
    }
    assert {s.name: s.t_max for s in store.config.segments} == want and want["prompt"] < 64
    info = store_info(out)
    stored = sum(store.lengths(i)["prompt"] for i in range(len(store)))
    assert info["segments"]["prompt"]["padding"] == pytest.approx(1 - stored / (len(store) * want["prompt"]))
    assert f"({100 * (1 - stored / (len(store) * want['prompt'])):.1f}% padding)" in cli("info", out).output


def test_write_json_summary(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES[:3]])
    res = cli("write", tmp_path / "s", "--model", llama_dir, "--data", data, "--layers", "1", "--quiet", "--json")
    s = json.loads(res.stdout)
    assert (s["examples"], s["written"], s["shards"], s["finalized"]) == (3, 3, [0], True)
    assert s["tokens"] == sum(actstore.ActStore(tmp_path / "s").lengths(i)["tokens"] for i in range(3))


def test_drop_cls_leaves_out_token_0_of_a_vit(tmp_path, dino_dir, images):
    out = tmp_path / "s"
    cli("write", out, "--model", dino_dir, "--data", images, "--layers", "0,1", "--drop", "cls", "--quiet")
    full = tmp_path / "full"
    cli("write", full, "--model", dino_dir, "--data", images, "--layers", "0,1", "--quiet")
    a, b = actstore.ActStore(out), actstore.ActStore(full)
    assert a.config.segments[0].t_max == b.config.segments[0].t_max - 1
    assert a.config.attrs["cls_token"] is False and a.config.attrs["image"]["prefix_tokens"] == 0
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i, 1], b[i, 1][1:])
    cli("show", out, "--ex", "0", "--layer", "1", "-o", tmp_path / "x.png")  # the picture needs no CLS


def test_budgets_and_truncation_count_stored_tokens_only(tmp_path, llama_dir):
    """With --special drop the budgets are quantiles of the content tokens (template and special
    tokens are not stored, so they take no budget) and truncation is counted in those tokens."""
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    _, tok = tiny_llama(layers=3)
    content = []
    for pair in PAIRS:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": pair["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        at = rendered.rfind(pair["prompt"])
        content.append(
            [
                t
                for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                if a < at + len(pair["prompt"]) and b > at and t not in tok.all_special_ids
            ]
        )
    r_ids = [
        [t for t in tok(p["response"], add_special_tokens=False)["input_ids"] if t not in tok.all_special_ids]
        for p in PAIRS
    ]
    common = [
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "1",
        "--chat-template",
        "--special",
        "drop",
        "--quiet",
        "--json",
    ]
    s = json.loads(cli("write", tmp_path / "full", *common, "--p-quantile", "1", "--r-quantile", "1").stdout)
    store = actstore.ActStore(tmp_path / "full")
    assert {x.name: x.t_max for x in store.config.segments} == {
        "prompt": max(map(len, content)),
        "response": max(map(len, r_ids)),
    }
    assert [store.token_ids(i).tolist() for i in range(len(PAIRS))] == [c + r for c, r in zip(content, r_ids)]
    assert s["truncated_tokens"] == 0 and s["source_tokens"] == sum(map(len, content)) + sum(map(len, r_ids))
    s = json.loads(cli("write", tmp_path / "cut", *common, "--p-max", "2", "--r-max", "2").stdout)
    cut = actstore.ActStore(tmp_path / "cut")
    assert [cut.token_ids(i).tolist() for i in range(len(PAIRS))] == [c[-2:] + r[:2] for c, r in zip(content, r_ids)]
    assert (
        s["truncated_tokens"] == sum(max(len(c) - 2, 0) for c in content) + sum(max(len(r) - 2, 0) for r in r_ids) > 0
    )


def test_a_write_that_fails_midway_says_what_it_left_and_the_rerun_names_both_ways(tmp_path, llama_dir, monkeypatch):
    """The data file changes under a running `write` after 4 examples were committed: the one
    error line says what the run left and how to go on; a rerun without --resume is refused
    naming --resume and removing the store; --resume completes it."""
    import time

    from actstore.capture.record import committed
    from actstore.inputs import data as data_mod

    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES[:6]])
    out = tmp_path / "s"
    args = ["write", out, "--model", llama_dir, "--data", texts, "--layers", "0", "--batch-size", "2"]
    args += ["--p-max", "16", "--commit-mb", "0.000001", "--quiet"]
    read = data_mod._LineIndex.read

    def changed_after_4(self, i):
        if i < 4:
            return read(self, i)
        deadline = time.monotonic() + 60
        while committed(out, 0)[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer thread commits the first two batches
        return b'{"text": broken'

    with monkeypatch.context() as mp:
        mp.setattr(data_mod._LineIndex, "read", changed_after_4)
        res = cli(*args, ok=False)
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
    assert res.output.startswith(f"actstore: error: {texts} changed while being read (record 4: "), res.output
    assert res.output.strip().endswith(
        f"; rerun with --resume; the run left {out} unfinalized (shard 0: 4 examples committed); "
        f"rerun with --resume to continue it, or remove {out} to start over"
    ), res.output
    assert committed(out, 0) == (4, False)
    res = cli(*args, ok=False)
    assert res.exit_code == 1 and res.output.strip() == (
        f"actstore: error: {out} already holds shard 0 (4 examples committed, left unfinished by an earlier run); "
        f"pass --resume to continue the run, or remove {out} or write to a new path to start over"
    )
    cli(*args, "--resume")
    assert len(actstore.ActStore(out)) == 6
