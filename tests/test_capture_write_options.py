"""`actstore write`'s one options value (issue 36): help in sections, every missing option
named at once, old spellings warned and still honoured, --special keep|mask|drop,
--system / --no-system with --chat-template, sampled --generate recorded in the attrs,
the model id a store records."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from capture_support import PAIRS, SENTENCES, make_tokenizer, save_dinov2, save_llama, tiny_llama, write_jsonl
from factory import cli

import actstore
from actstore.capture import CaptureError, CaptureOptions

DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<s> system : we are water people </s>{% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("m") / "llama", layers=3)


@pytest.fixture(scope="module")
def system_dir(tmp_path_factory):
    """A model whose chat template adds a system prompt of its own when given none."""
    folder = save_llama(tmp_path_factory.mktemp("m") / "sys", layers=2)
    tok = make_tokenizer()
    tok.chat_template = DEFAULT_SYSTEM
    tok.save_pretrained(folder)
    return folder


def test_help_lists_the_options_in_sections_and_hides_old_spellings():
    out = cli("write", "--help").output
    heads = [
        "What to record:",
        "The model:",
        "The data:",
        "Texts, prompts and responses:",
        "Corpora in context windows:",
        "Store layout and commits:",
        "The capture pipeline:",
        "Writers and resuming:",
        "Output:",
    ]
    at = [out.index(h) for h in heads]
    assert at == sorted(at)
    assert out.index("--chat-template") > out.index("Texts, prompts") and out.index("--runner") > out.index("Writers")
    assert "--engine" not in out and "--drop " not in out and "keep|mask|drop" in out


def test_every_missing_option_is_named_at_once(tmp_path):
    res = cli("write", tmp_path / "s", "--data", "d", ok=False)
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == "Error: Missing options '--model', '--layers'."
    res = cli("write", ok=False)
    assert (
        res.output.strip().splitlines()[-1]
        == "Error: Missing argument 'STORE' and options '--model', '--data', '--layers'."
    )
    assert not (tmp_path / "s").exists()


def test_options_are_checked_in_the_callers_words():
    with pytest.raises(CaptureError, match=r"^--queue-size must be a positive int\. Got 0\.$"):
        CaptureOptions(queue_size=0).check(names="cli")
    with pytest.raises(CaptureError, match=r"^queue_size must be a positive int\. Got 0\.$"):
        CaptureOptions(queue_size=0).check()
    with pytest.raises(CaptureError, match="--temperature and --top-p sample the responses of --generate N"):
        CaptureOptions(temperature=0.7).check(names="cli")
    with pytest.raises(CaptureError, match="--system sets the system prompt of --chat-template"):
        CaptureOptions(system="be brief").check(names="cli")
    with pytest.raises(CaptureError, match=r"--special must be one of \['keep', 'mask', 'drop'\]"):
        CaptureOptions(special="skip").check(names="cli")
    with pytest.raises(TypeError, match="unknown capture options"):
        actstore.record(torch.nn.Linear(2, 2), [], "x", layers=[0], no_such_option=1)


def test_engine_and_drop_still_work_with_a_warning(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", SENTENCES[:3])
    common = ["--model", llama_dir, "--data", data, "--layers", "0", "--quiet", "--p-max", "12"]
    res = cli("write", tmp_path / "old", *common, "--engine", "local", "--drop", "bos")
    assert "actstore: warning: --engine is deprecated; use --runner" in res.output
    assert "actstore: warning: --drop is deprecated; use --special drop" in res.output
    cli("write", tmp_path / "new", *common)
    old, new = actstore.ActStore(tmp_path / "old"), actstore.ActStore(tmp_path / "new")
    bos = make_tokenizer().bos_token_id
    for i in range(3):  # --drop bos kept its meaning for this release: the BOS tokens alone are left out
        assert new.token_ids(i)[0] == bos and old.token_ids(i).tolist() == new.token_ids(i)[1:].tolist()
    with pytest.warns(DeprecationWarning, match="record\\(engine=...\\) is deprecated; use runner="):
        model, _ = tiny_llama(layers=2)
        actstore.record(model, [torch.randint(4, 60, (1, 4))], tmp_path / "r", layers=[0], engine="local")


def test_special_keep_mask_drop(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS[:3])
    common = ["--model", llama_dir, "--data", data, "--layers", "0", "--quiet", "--p-max", "16", "--r-max", "12"]
    for mode in ("keep", "mask", "drop"):
        cli("write", tmp_path / mode, *common, "--special", mode)
    keep, mask, drop = (actstore.ActStore(tmp_path / m) for m in ("keep", "mask", "drop"))
    assert "prompt_token_labels" not in keep.config.fields and keep.config.token_labels is False
    assert mask.config.token_labels is True and mask.config.attrs["capture"]["special"] == "mask"
    # The labels are token kinds, and the store says so: the attrs' marker of capture-made
    # stores, and StoreConfig.token_label_names where the layout has that field.
    assert mask.config.attrs["token_labels"]["0"] == "content"
    assert getattr(mask.config, "token_label_names", None) in (None, {0: "content", 1: "special", 2: "template"})
    assert getattr(keep.config, "token_label_names", None) is None
    for i in range(3):
        labels = np.asarray(mask.field("prompt_token_labels")[i, : mask.lengths(i)["prompt"]])
        assert keep.lengths(i) == mask.lengths(i)  # every token stored, unlabelled
        assert drop.lengths(i)["prompt"] == int((labels == 0).sum())  # content only
        np.testing.assert_array_equal(keep.segment("prompt")[i, 0], mask.segment("prompt")[i, 0])
        np.testing.assert_array_equal(
            drop.token_ids(i)[: drop.lengths(i)["prompt"]], mask.token_ids(i)[: len(labels)][labels == 0]
        )


def test_system_prompt_is_set_left_out_or_named(tmp_path, system_dir):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS[:2])
    common = ["--model", system_dir, "--data", data, "--layers", "0", "--quiet", "--chat-template", "--r-max", "8"]
    res = cli("write", tmp_path / "default", *common)
    assert "the template adds its own system turn" in res.output and "--no-system leaves it out" in res.output
    cli("write", tmp_path / "none", *common, "--no-system")
    cli("write", tmp_path / "set", *common, "--system", "be long")
    tok = make_tokenizer()
    stores = {k: actstore.ActStore(tmp_path / k) for k in ("default", "none", "set")}
    words = {k: tok.decode(s.token_ids(0)[: s.lengths(0)["prompt"]]) for k, s in stores.items()}
    assert "water people" in words["default"] and "water people" not in words["none"] + words["set"]
    assert "be long" in words["set"]
    assert stores["none"].config.attrs["capture"]["system"] == ""
    assert stores["set"].config.attrs["capture"]["system"] == "be long"
    assert "water people" in stores["default"].config.attrs["capture"]["system"]
    labels = np.asarray(stores["set"].field("prompt_token_labels")[0, : stores["set"].lengths(0)["prompt"]])
    ids = stores["set"].token_ids(0)[: len(labels)]
    assert tok.convert_tokens_to_ids("long") in ids[labels == 2].tolist()  # the system text is template, not content
    res = cli("write", tmp_path / "both", *common, "--system", "x", "--no-system", ok=False)
    assert res.exit_code == 2 and "give --system TEXT or --no-system, not both" in res.output


def test_sampled_generation_is_reproducible_and_recorded(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": p["prompt"]} for p in PAIRS[:3]])
    common = ["--model", llama_dir, "--data", data, "--layers", "0", "--quiet", "--generate", "6", "--json"]
    sampled = ["--temperature", "1.5", "--top-p", "0.9", "--seed", "7"]
    cli("write", tmp_path / "a", *common, *sampled)
    cli("write", tmp_path / "b", *common, *sampled)
    cli("write", tmp_path / "g", *common)
    a, b, g = (actstore.ActStore(tmp_path / k) for k in "abg")
    assert a.config.attrs["capture"]["sampling"] == {"max_new_tokens": 6, "temperature": 1.5, "top_p": 0.9, "seed": 7}
    assert g.config.attrs["capture"]["sampling"] == {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    assert list(a.texts("response")) == list(b.texts("response"))  # the same seed, the same responses
    assert list(a.texts("response")) != list(g.texts("response"))  # sampled, not greedy
    res = cli(
        "write", tmp_path / "t", "--model", llama_dir, "--data", data, "--layers", "0", "--temperature", "1", ok=False
    )
    assert res.exit_code == 1 and "--temperature and --top-p sample the responses of --generate N" in res.output


def test_json_summary_and_layer_names(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "t.jsonl", SENTENCES[:2])
    res = cli(
        "write",
        tmp_path / "s",
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "0,blocks.1.hook_resid_post",
        "--quiet",
        "--json",
    )
    summary = json.loads(res.stdout)
    assert summary["examples"] == 2 and summary["finalized"] is True
    assert actstore.ActStore(tmp_path / "s").layers == (0, 1)


def test_the_recorded_model_id_resolves_to_a_tokenizer(tmp_path, llama_dir):
    """record() on a transformers model records its folder, its hub id, or the embedded
    model it came from; views then load the tokenizer from it."""
    from transformers import AutoModelForCausalLM

    from actstore.features.views.context import load_tokenizer
    from actstore.inputs import embedded
    from actstore.inputs.models import module_id

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    actstore.record(model, [torch.randint(4, 60, (2, 5))], tmp_path / "s", layers=[0])
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    assert store.meta["model_id"] == str(llama_dir.resolve())
    assert load_tokenizer(store).convert_tokens_to_ids("water") == make_tokenizer().convert_tokens_to_ids("water")
    other, _ = tiny_llama(layers=1)
    other.config._name_or_path = "HuggingFaceTB/SmolLM2-135M"
    assert module_id(other) == "HuggingFaceTB/SmolLM2-135M"  # a hub id, as it is
    other.config._name_or_path = str(embedded.smollm2_folder())  # loaded from the embedded GGUF folder
    assert module_id(other) == "embedded:smollm2-135m"
    other.config._name_or_path = ""
    assert module_id(other) == "LlamaForCausalLM"


def test_image_store_special_drop_leaves_out_the_cls_token(tmp_path):
    from capture_support import make_images

    dino = save_dinov2(tmp_path / "dino", layers=2)
    make_images(tmp_path / "imgs", n=2)
    images = tmp_path / "imgs"
    cli("write", tmp_path / "s", "--model", dino, "--data", images, "--layers", "0", "--special", "drop", "--quiet")
    store = actstore.ActStore(tmp_path / "s")
    assert store.config.attrs["image"]["dropped"] == ["cls"] and store.config.attrs["image"]["prefix_tokens"] == 0
