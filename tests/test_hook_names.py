"""Hooks by name (docs/capture.md, "What a layer is"): TransformerLens-style names, module paths
and negative block numbers at capture; the names kept in the store and accepted by readers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from capture_support import SENTENCES, save_llama, tiny_llama, write_jsonl
from factory import cli

import actstore
from actstore.errors import LayerNotFoundError

NAMES = ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.0.hook_mlp_out", "blocks.0.hook_attn_out"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hooks")
    return save_llama(d / "llama", layers=3), write_jsonl(d / "t.jsonl", [{"text": s} for s in SENTENCES[:4]])


def _reference(ids: list[int]) -> dict[str, np.ndarray]:
    """What TransformerLens means by each name, computed with plain torch hooks on the same model."""
    model, _ = tiny_llama(layers=3)
    got: dict[str, np.ndarray] = {}
    block0 = model.model.layers[0]

    def keep(name, value):
        got.setdefault(name, value.numpy().copy())  # (a hook must return None: a value would replace the output)

    h1 = block0.mlp.register_forward_hook(lambda m, a, out: keep("mlp", out[0]))
    h2 = block0.self_attn.register_forward_hook(lambda m, a, out: keep("attn", out[0][0]))
    with torch.inference_mode():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h1.remove()
    h2.remove()
    return {
        "blocks.1.hook_resid_pre": hs[1][0].numpy(),  # the input of block 1 = hidden_states[1]
        "blocks.1.hook_resid_post": hs[2][0].numpy(),  # the output of block 1 = hidden_states[2]
        "blocks.0.hook_mlp_out": got["mlp"],
        "blocks.0.hook_attn_out": got["attn"],
        "blocks.2.hook_resid_pre": hs[2][0].numpy(),
    }


def test_names_are_captured_kept_and_read_back(tmp_path, setup):
    model_dir, data = setup
    out = tmp_path / "s"
    cli(
        "write",
        out,
        "--model",
        model_dir,
        "--data",
        data,
        "--layers",
        ",".join(NAMES + ["blocks.2.hook_resid_pre"]),
        "--quiet",
    )
    store = actstore.ActStore(out)
    names = store.layer_names()
    assert {n: names[n] for n in NAMES} == {n: i for i, n in enumerate(NAMES)}  # two share block 1: numbered in order
    assert names["model.layers.0.mlp"] == 2 and names["model.layers.0.self_attn"] == 3
    _, tok = tiny_llama(layers=3)
    for i, text in enumerate(SENTENCES[:4]):
        ref = _reference(tok(text)["input_ids"])
        for name, want in ref.items():
            np.testing.assert_allclose(store[i, name].astype(np.float32), want, rtol=2e-3, atol=2e-3, err_msg=name)
        np.testing.assert_array_equal(store[i, "model.layers.0.mlp"], store[i, 2])
    assert [a.shape for a in store[0:2, "blocks.0.hook_mlp_out"]] == [store[0, 2].shape, store[1, 2].shape]
    with pytest.raises(
        LayerNotFoundError,
        match=r"no stored layer is named 'blocks.7.hook_resid_post'; did you mean .*This store holds layers \[0, 1, 2, 3, 4\], named \['blocks.0.hook_attn_out'",
    ):
        store[0, "blocks.7.hook_resid_post"]
    info = cli("info", out).output
    assert "layer 2      = model.layers.0.mlp, blocks.0.hook_mlp_out" in info


def test_block_numbers_negative_and_their_names(tmp_path, setup):
    model_dir, data = setup
    out = tmp_path / "s"
    cli("write", out, "--model", model_dir, "--data", data, "--layers", "0,-2", "--quiet")
    store = actstore.ActStore(out)
    assert store.layers == (0, 1)  # -2 of 3 blocks is block 1
    for i in range(len(store)):
        np.testing.assert_array_equal(store[i, "blocks.1.hook_resid_post"], store[i, 1])
        np.testing.assert_array_equal(store[i, "model.layers.0"], store[i, 0])


def test_unknown_names_say_what_is_valid(tmp_path, setup):
    model_dir, data = setup
    for layers, message in (
        (
            "blocks.3.hook_resid_post",
            f"blocks.3.hook_resid_post does not exist: {model_dir} has 3 blocks, so layers 0..2 (or -3..-1) exist",
        ),
        ("-4", "layer -4 does not exist"),
        (
            "blocks.0.hook_z",
            "'blocks.0.hook_z' is not a hook name this capture knows; use blocks.N.hook_resid_pre|hook_attn_out|"
            "attn.hook_z|hook_resid_mid|hook_mlp_in|mlp.hook_post|hook_mlp_out|hook_resid_post, a block number, "
            "or a module path (did you mean 'blocks.0.attn.hook_z'",
        ),
        ("model.layers.0.nope", "no module 'model.layers.0.nope'"),
        ("1,blocks.1.hook_resid_post", "layers must be distinct"),
    ):
        res = cli(
            "write", tmp_path / "s", "--model", model_dir, "--data", data, "--layers", layers, "--quiet", ok=False
        )
        assert res.exit_code == 1 and message in res.output, (layers, res.output)
        assert not (tmp_path / "s").exists()
