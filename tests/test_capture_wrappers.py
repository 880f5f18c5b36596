"""record() takes the model as nnsight and TransformerLens hold it (actstore.capture.wrappers):
the same site names give bit-equal stores to the HF module's, on the same tiny model."""

from __future__ import annotations

import numpy as np
import pytest

import actstore

pytestmark = pytest.mark.torch

SITES = [
    "blocks.0.hook_resid_pre",
    "blocks.0.hook_attn_out",
    "blocks.0.hook_resid_mid",
    "blocks.0.hook_mlp_in",
    "blocks.0.hook_mlp_out",
    "blocks.1.hook_resid_post",
]


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",  # what TransformerBridge runs: the HF reference must run it too
    )
    return LlamaForCausalLM(cfg).eval()


def _batches():
    import torch

    return [torch.randint(1, 32, (2, 9), generator=torch.Generator().manual_seed(3))]


def _store(model, path, layers):
    actstore.record(model, _batches(), path, layers=layers, dtype="float32")
    actstore.finalize(path)
    return actstore.ActStore(path)


def _same(a, b, names):
    for n in names:
        for e in range(2):
            np.testing.assert_array_equal(a[e, n], b[e, n], err_msg=n)
        assert np.abs(a[0, n]).max() > 0  # a real tensor, not zeros


@pytest.mark.parametrize("layers", [SITES, ["blocks.1.attn.hook_z"], ["blocks.1.mlp.hook_post"]])
def test_an_nnsight_language_model_gives_the_hf_store(tmp_path, layers):
    from capture_support import make_tokenizer
    from nnsight import LanguageModel

    model = _llama()
    hf = _store(model, tmp_path / "hf", layers)
    wrapped = _store(LanguageModel(model, tokenizer=make_tokenizer()), tmp_path / "nn", layers)
    _same(hf, wrapped, layers)
    assert wrapped.config.attrs["capture"]["sites"]["tool"].startswith("nnsight ")
    assert hf.config.attrs["capture"]["sites"]["tool"].startswith("transformers ")


def test_a_transformer_bridge_gives_the_hf_store(tmp_path):
    from capture_support import make_tokenizer
    from transformer_lens.model_bridge import TransformerBridge

    model = _llama()
    hf = {
        i: _store(model, tmp_path / f"hf{i}", ls)
        for i, ls in enumerate([SITES, ["blocks.1.attn.hook_z"], ["blocks.1.mlp.hook_post"]])
    }
    folder = tmp_path / "folder"  # the bridge reads the config and tokenizer from a folder (no hub here)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=model)
    for i, ls in enumerate([SITES, ["blocks.1.attn.hook_z"], ["blocks.1.mlp.hook_post"]]):
        got = _store(bridge, tmp_path / f"tl{i}", ls)
        _same(hf[i], got, ls)
        rec = got.config.attrs["capture"]["sites"]
        assert rec["tool"].startswith("transformer_lens ")
        assert rec["widths"] == {n: {"blocks.1.attn.hook_z": 32, "blocks.1.mlp.hook_post": 48}.get(n, 32) for n in ls}
    assert got.config.attrs["hooks"] == {"1": "blocks.1.mlp.out.hook_in"}  # read from the bridge's own hook point


def test_a_hooked_transformer_is_refused_with_the_way_to_a_bridge():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from actstore.errors import UnknownLayerError

    ht = HookedTransformer(
        HookedTransformerConfig(n_layers=1, d_model=16, n_ctx=8, d_head=4, act_fn="relu", d_vocab=10)
    )
    with pytest.raises(UnknownLayerError, match=r"takes a TransformerLens TransformerBridge, not a HookedTransformer"):
        actstore.record(ht, _batches(), "unused", layers=["blocks.0.hook_resid_post"])
