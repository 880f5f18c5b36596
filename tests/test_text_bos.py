"""Token 0 of a plain-text or jsonl capture is never silently content (issue 39 item 1):
`--bos auto` (the default) prepends the tokenizer's BOS, labelled special, unless the
tokenizer or chat template adds one; a tokenizer without BOS gets its first position
labelled `first`; `--bos never` stores the text as tokenized. The sink check
(actstore.read.sinkcheck) warns in info, write and features when a kept position's mean
norm dwarfs the others'."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from capture_support import SENTENCES, tiny_llama, write_jsonl
from factory import cli, word_store, word_tokenizer
from tokenizers import processors

import actstore
from actstore.errors import CaptureError
from actstore.inputs.prepare import TextPlan, choose_bos, head, kept, prompt_tokens, separator_tokens, tail
from actstore.loaders.tokens import TokenStream
from actstore.read.sinkcheck import SINK_RATIO, find_sinks, sink_warning

PAIRS = [{"prompt": s, "response": SENTENCES[(i + 1) % 8]} for i, s in enumerate(SENTENCES[:6])]


def _adds_none(tok):
    """The tiny tokenizer made to add no BOS to a text (like the embedded SmolLM2's)."""
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    return tok


def _without_bos(tok):
    """The tiny tokenizer with no BOS token at all."""
    tok = _adds_none(tok)
    tok.bos_token = None
    return tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("m")
    model, tok = tiny_llama(layers=2)
    made = {"adds": tok, "none": _adds_none(tiny_llama(layers=2)[1]), "bosless": _without_bos(tiny_llama(layers=2)[1])}
    for name, t in made.items():
        model.save_pretrained(root / name)
        t.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "lines.txt"
    path.write_text("\n".join(SENTENCES[:6]) + "\n", encoding="utf-8")
    return path


def _write(out, model, data, *extra):
    cli("write", out, "--model", model, "--data", data, "--layers", "0,1", "--quiet", *extra)
    return actstore.ActStore(out)


def _hidden(model, ids, layer):
    with torch.inference_mode():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer + 1][0].numpy()


def test_plain_text_gets_the_bos_prepended_labelled_special(tmp_path, models, lines):
    model, tok = tiny_llama(layers=2)
    tok = _adds_none(tok)
    store = _write(tmp_path / "s", models / "none", lines)
    for i, text in enumerate(SENTENCES[:6]):
        ids = store.token_ids(i).tolist()
        assert ids == [tok.bos_token_id, *tok(text)["input_ids"]]  # one more token than the text
        labels = store.field("tokens_token_labels")[i, : len(ids)].tolist()
        assert labels == [1] + [0] * (len(ids) - 1)
        np.testing.assert_allclose(store[i, 0].astype(np.float32), _hidden(model, ids, 0), rtol=2e-3, atol=2e-3)
    bos = store.config.attrs["capture"]["bos"]
    assert bos["option"] == "auto" and bos["prepended"] is True and bos["token"] == tok.bos_token_id
    assert not bos["first_labelled"] and store.config.token_label_names == {0: "content", 1: "special", 2: "template"}
    stream = TokenStream(store, batch_size=64, return_index=True, shuffle=False)  # the default mask
    assert 0 not in torch.cat([b["token"] for b in stream]).tolist()
    shown = cli("info", tmp_path / "s").output
    assert (
        f"token 0      BOS (token {tok.bos_token_id}), prepended by the capture, labelled special (--bos auto)" in shown
    )


def test_a_tokenizer_that_adds_its_bos_gets_one_not_two(tmp_path, models, lines):
    _, tok = tiny_llama(layers=2)
    store = _write(tmp_path / "s", models / "adds", lines)
    for i, text in enumerate(SENTENCES[:6]):
        assert store.token_ids(i).tolist() == tok(text)["input_ids"]
        assert store.token_ids(i)[0] == tok.bos_token_id and store.field("tokens_token_labels")[i, 0] == 1
    bos = store.config.attrs["capture"]["bos"]
    assert bos["prepended"] is False and bos["token_0"].startswith("BOS (token 1), added by the tokenizer")


def test_bos_never_stores_the_text_as_tokenized(tmp_path, models, lines):
    _, tok = tiny_llama(layers=2)
    tok = _adds_none(tok)
    store = _write(tmp_path / "s", models / "none", lines, "--bos", "never")
    for i, text in enumerate(SENTENCES[:6]):
        assert store.token_ids(i).tolist() == tok(text)["input_ids"]
        assert store.field("tokens_token_labels")[i, 0] == 0  # content: today's (the old) meaning
    assert store.config.attrs["capture"]["bos"]["option"] == "never"
    assert (
        "token 0      the text's first token as tokenized (content unless the tokenizer marks it special) (--bos never)"
        in (cli("info", tmp_path / "s").output)
    )


def test_a_tokenizer_without_bos_labels_the_first_position_first(tmp_path, models, lines):
    model, tok = tiny_llama(layers=2)
    tok = _without_bos(tok)
    store = _write(tmp_path / "s", models / "bosless", lines)
    assert store.config.token_label_names == {0: "content", 1: "special", 2: "template", 3: "first"}
    for i, text in enumerate(SENTENCES[:6]):
        ids = store.token_ids(i).tolist()
        assert ids == tok(text)["input_ids"] and tok.bos_token_id is None
        labels = store.field("tokens_token_labels")[i, : len(ids)].tolist()
        assert labels == [3] + [0] * (len(ids) - 1)
    bos = store.config.attrs["capture"]["bos"]
    assert bos["first_labelled"] is True and bos["token"] is None and "labelled first" in bos["token_0"]
    default = TokenStream(store, batch_size=64, return_index=True, shuffle=False)
    assert 0 not in torch.cat([b["token"] for b in default]).tolist()  # the default mask leaves it out
    every = TokenStream(store, batch_size=64, token_mask="all", return_index=True, shuffle=False)
    assert torch.cat([b["token"] for b in every]).tolist().count(0) == 6 * 2  # --special keep keeps it (2 layers)
    shown = cli("info", tmp_path / "s").output
    assert "3 first" in shown and "leaves out 6 of" in shown
    refused = cli(
        "write",
        tmp_path / "t",
        "--model",
        models / "bosless",
        "--data",
        lines,
        "--layers",
        "0",
        "--bos",
        "always",
        ok=False,
    )
    assert refused.exit_code == 1 and "--bos always: this tokenizer has no BOS token; use --bos auto" in refused.output
    assert not (tmp_path / "t").exists() or not any((tmp_path / "t").iterdir())


def test_the_first_label_is_left_out_by_special_drop(tmp_path, models, lines):
    _, tok = tiny_llama(layers=2)
    tok = _without_bos(tok)
    store = _write(tmp_path / "s", models / "bosless", lines, "--special", "drop")
    for i, text in enumerate(SENTENCES[:6]):
        assert store.token_ids(i).tolist() == tok(text)["input_ids"][1:]  # the model saw it; the store does not


def test_prompts_keep_their_bos_when_cut_to_the_budget(tmp_path, models):
    _, tok = tiny_llama(layers=2)
    tok = _adds_none(tok)
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    store = _write(tmp_path / "s", models / "none", data, "--p-max", "4")
    prompt = store.segment("prompt")
    for i, pair in enumerate(PAIRS):
        full = [*tok(pair["prompt"])["input_ids"], *separator_tokens(tok, "\n")]  # (the separator: EOS here)
        ids = store.token_ids(i)[: prompt.lengths()[i]].tolist()
        assert ids[0] == tok.bos_token_id and store.field("prompt_token_labels")[i, 0] == 1
        assert len(full) > 3 and ids[1:] == full[-3:]  # the BOS, then the prompt's end
    assert store.config.attrs["capture"]["bos"]["prepended"] is True


def test_a_chat_template_that_starts_with_the_bos_gets_no_second_one(tmp_path, models):
    _, tok = tiny_llama(layers=2)
    plan = TextPlan(kind="pair", p_max=64, chat_template=True)
    choice = choose_bos(tok, plan, "auto")
    assert choice.added and not choice.prepend  # the tiny template renders "<s> user : ..."
    ids, labels = prompt_tokens(tok, choice.apply(plan), "the first day")
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id and labels[0] == 1


def test_cutting_keeps_the_bos_and_the_first_label():
    _, tok = tiny_llama(layers=2)
    plan = choose_bos(_adds_none(tok), TextPlan(kind="pair", p_max=3), "auto").apply(TextPlan(kind="pair", p_max=3))
    seq = prompt_tokens(_adds_none(tok), plan, "we can write some word")
    cut = tail(seq, kept(*seq, plan, None), 3, plan)
    assert cut[0] == [seq[0][0], *seq[0][-2:]] and cut[1].tolist() == [1, 0, 2]  # BOS, "word", the separator
    assert head(seq, kept(*seq, plan, None), 2)[0] == seq[0][:2]
    bosless = _without_bos(tiny_llama(layers=2)[1])
    plan = choose_bos(bosless, TextPlan(kind="pair", p_max=3), "auto").apply(TextPlan(kind="pair", p_max=3))
    seq = prompt_tokens(bosless, plan, "we can write some word")
    assert seq[1][0] == 3
    cut = tail(seq, kept(*seq, plan, None), 3, plan)
    assert cut[0] == seq[0][-3:] and cut[1].tolist() == [3, 0, 2]  # the new first position is labelled first


def test_a_resume_keeps_the_first_runs_bos(tmp_path, models, lines):
    from actstore.capture.shares import check_resumed_bos
    from actstore.capture.target import CaptureTarget

    _write(tmp_path / "s", models / "none", lines, "--bos", "never")
    never = actstore.ActStore(tmp_path / "s").config.attrs["capture"]["bos"]
    auto = {**never, "option": "auto", "prepended": True}
    check_resumed_bos(CaptureTarget(tmp_path / "s"), never)  # the same choice: resumed
    with pytest.raises(CaptureError, match=r"captured with --bos never .*; resume it with --bos never"):
        check_resumed_bos(CaptureTarget(tmp_path / "s"), auto)
    old = word_store(tmp_path / "old", word_tokenizer(tmp_path / "tok"))  # written before --bos: as never
    with pytest.raises(CaptureError, match=r"captured with --bos never \(token 0: as tokenized\)"):
        check_resumed_bos(CaptureTarget(old), auto)
    check_resumed_bos(CaptureTarget(old), {**auto, "prepended": False})  # a tokenizer that adds its BOS: as before


def test_bos_is_for_texts_not_windows(tmp_path, models, lines):
    res = cli(
        "write", tmp_path / "s", "--model", models / "none", "--data", lines, "--layers", "0", "--pack",
        "--context", "8", "--bos", "never", ok=False,
    )  # fmt: skip
    assert res.exit_code == 1 and "--no-window-bos leaves it out" in res.output


# ---- the sink check -------------------------------------------------------------------------


def test_the_sink_check_finds_a_sink_counted_as_content(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    store = actstore.ActStore(word_store(tmp_path / "s", tok, bos_label=0))  # token 0: huge, content
    sinks = find_sinks(store)
    assert [(s.layer, s.segment, s.position, s.labelled) for s in sinks] == [(4, "tokens", 0, False)]
    norms = np.asarray([np.linalg.norm(np.asarray(store[i, 4], np.float32), axis=1) for i in range(len(store))])
    assert sinks[0].mean_norm == pytest.approx(norms[:, 0].mean(), rel=1e-5)  # every example sampled (12 <= 256)
    assert sinks[0].others_median == pytest.approx(np.median(norms[:, 1:].mean(0)), rel=1e-5)
    assert sinks[0].ratio > SINK_RATIO
    warning = sink_warning(sinks, store)
    assert "layer 4 token 0:" in warning and "rerun the capture with --bos auto" in warning
    info = cli("info", tmp_path / "s")
    assert "actstore: warning: attention sink counted as content" in info.output
    assert cli("info", tmp_path / "s", "--quiet").output == ""  # --quiet prints nothing
    res = cli("features", tmp_path / "s", "--layer", "4", "--neurons", "-o", tmp_path / "f")
    assert "actstore: warning: attention sink counted as content" in res.output
    meta = json.loads((tmp_path / "f" / "meta.json").read_text())
    assert [(s["position"], s["labelled"]) for s in meta["masks"]["sinks"]] == [(0, False)]


def test_a_labelled_sink_is_left_out_unless_every_token_is_kept(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    store = actstore.ActStore(word_store(tmp_path / "s", tok))  # token 0: huge, labelled special
    assert find_sinks(store) == []
    assert "warning" not in cli("info", tmp_path / "s").output
    kept_all = find_sinks(store, keep_all=True)
    assert [(s.position, s.labelled) for s in kept_all] == [(0, True)]
    assert "drop --special keep" in sink_warning(kept_all, store)
    res = cli("features", tmp_path / "s", "--layer", "4", "--neurons", "--special", "keep", "-o", tmp_path / "f")
    assert "drop --special keep" in res.output


def test_the_sink_ratio_is_a_strict_bound():
    from actstore.read import sinkcheck

    norms = np.ones(9)
    norms[0] = SINK_RATIO * 0.99  # just under the ratio: no sink
    assert sinkcheck._sinks_of(4, "tokens", norms * 5, np.full(9, 5), np.zeros(9, bool)) == []
    norms[0] = SINK_RATIO * 1.01
    assert [s.position for s in sinkcheck._sinks_of(4, "tokens", norms * 5, np.full(9, 5), np.zeros(9, bool))] == [0]


def test_bos_choice_names_its_option():
    _, tok = tiny_llama(layers=2)
    with pytest.raises(CaptureError, match=r"--bos must be one of \['auto', 'always', 'never'\]. Got 'yes'."):
        choose_bos(tok, TextPlan(kind="text", p_max=8), "yes")
