"""Every site of a block (docs/capture.md, "Sites") on a tiny random model of each architecture
family: resolved, checked against an independent path before anything is stored (the store's
attrs say what was checked), and read back by store[ex, site] and TokenStream."""

from __future__ import annotations

import numpy as np
import pytest

import actstore

pytestmark = pytest.mark.torch

_DEC = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_VIS = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
)
# (model class, config class, config, d_mlp)
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DEC, 48),
    "mistral": ("MistralForCausalLM", "MistralConfig", _DEC, 48),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DEC, 48),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {**_DEC, "head_dim": 12}, 48),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {**_DEC, "head_dim": 12}, 48),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {**_DEC, "head_dim": 12}, 48),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {**_DEC, "pad_token_id": 0}, 48),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", _DEC, 48),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64), 128),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(_DEC, num_key_value_heads=None, use_parallel_residual=True),
        48,
    ),
    "vit": ("ViTModel", "ViTConfig", _VIS, 48),
    "dinov2": ("Dinov2Model", "Dinov2Config", _VIS, 128),  # DINOv2's MLP is mlp_ratio (4) x hidden
    "clip": ("CLIPVisionModel", "CLIPVisionConfig", _VIS, 48),
    "siglip": ("SiglipVisionModel", "SiglipVisionConfig", _VIS, 48),
}
D_MODEL_SITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out", "hook_resid_post")


def _model(arch: str):
    import torch
    import transformers

    cls, cfg_cls, kw, _ = ARCHS[arch]
    torch.manual_seed(0)
    kw = {k: v for k, v in kw.items() if v is not None}
    return getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).eval()


def _batches(arch: str):
    import torch

    g = torch.Generator().manual_seed(1)
    if "vocab_size" in ARCHS[arch][2]:
        return [torch.randint(1, 64, (2, 9), generator=g) for _ in range(1)]
    return [torch.randn(2, 3, 32, 32, generator=g) for _ in range(1)]


def _reference(model, batches, names: list[str]) -> dict[str, np.ndarray]:
    """Each site by plain torch hooks on the modules the docs name, concatenated over batches."""
    import torch

    from actstore.capture.hooks import resolve_hooks
    from actstore.capture.proof import _run

    hooks = resolve_hooks(model, names)
    out: dict[str, list] = {n: [] for n in names}
    for b in batches:
        key = "pixel_values" if b.is_floating_point() else "input_ids"
        acts, _ = _run(model, hooks, {key: b})
        for n in names:
            out[n].append(acts[n].to(torch.float32).numpy())
    return {n: np.concatenate(v) for n, v in out.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_site_is_captured_checked_and_read_back(arch, tmp_path):
    from actstore.capture.hooks import site_width
    from actstore.loaders.tokens import TokenStream

    model = _model(arch)
    batches = _batches(arch)
    parallel = arch == "gpt_neox"
    wide = [f"blocks.1.{h}" for h in D_MODEL_SITES if not (parallel and h == "hook_resid_mid")]
    d_mlp = ARCHS[arch][3]
    assert site_width(model, "blocks.1.mlp.hook_post") == d_mlp
    assert site_width(model, "blocks.0.attn.hook_z") == 4 * (12 if "head_dim" in ARCHS[arch][2] else 8)
    assert all(site_width(model, n) == 32 for n in wide)
    # A store holds one width: the d_model sites together, attn.z and mlp.post each alone.
    for i, names in enumerate([wide, ["blocks.1.attn.hook_z"], ["blocks.1.mlp.hook_post"]]):
        store_path = tmp_path / f"s{i}"
        actstore.record(model, batches, store_path, layers=names, dtype="float32")
        actstore.finalize(store_path)
        store = actstore.ActStore(store_path)
        ref = _reference(model, batches, names)
        rec = store.config.attrs["capture"]["sites"]
        assert rec["tool"].startswith("transformers ") and "hidden_states[N + 1]" in rec["layer_convention"]
        assert rec["widths"] == {n: site_width(model, n) for n in names}
        for n in names:
            got = np.stack([store[e, n] for e in range(2)])
            np.testing.assert_array_equal(got, ref[n], err_msg=n)
        stream = TokenStream(store, batch_size=10_000, layers=[store.layer_names()[names[0]]], seed=0)
        rows = np.concatenate([np.asarray(b if not isinstance(b, dict) else b["acts"]) for b in stream])
        want = ref[names[0]].reshape(-1, ref[names[0]].shape[-1])
        np.testing.assert_array_equal(np.sort(rows, axis=0), np.sort(want, axis=0))
    assert any(w.startswith("hook_mlp_out = ") for w in rec["checks"]["blocks.1.mlp.hook_post"])


@pytest.mark.parametrize("arch", ["llama", "gemma2", "olmo2", "gpt2", "dinov2"])
def test_the_checks_hold_and_name_what_they_compared(arch):
    import torch

    from actstore.capture.hooks import resolve_hooks
    from actstore.capture.proof import prove
    from actstore.capture.sites import SITE_HOOKS

    model = _model(arch)
    names = [f"blocks.0.{h}" for h in SITE_HOOKS]
    b = _batches(arch)[0]
    inputs = {"pixel_values": b} if b.is_floating_point() else {"input_ids": b, "attention_mask": torch.ones_like(b)}
    if not b.is_floating_point():
        inputs["attention_mask"][1, 6:] = 0  # rows of two lengths: padding must not leak
    checks = prove(model, resolve_hooks(model, names), inputs)
    whats = {(c.site, c.what) for c in checks}
    assert ("blocks.0.hook_resid_post", "hook_resid_post = hidden_states[1]") in whats
    assert ("blocks.0.hook_resid_pre", "hook_resid_pre = hidden_states[0]") in whats
    for site in ("hook_resid_mid", "hook_resid_pre", "hook_attn_out"):
        assert (f"blocks.0.{site}", "hook_resid_mid = resid_pre + attn_out") in whats
    for site in ("hook_resid_post", "hook_resid_mid", "hook_mlp_out"):
        assert (f"blocks.0.{site}", "hook_resid_post = resid_mid + mlp_out") in whats
    if not b.is_floating_point():
        assert ("blocks.0.hook_mlp_in", "row 1's real tokens = row 1 run alone (no padding leaks in)") in whats
    assert all(c.error <= 1e-4 for c in checks)
    z, post = {
        "llama": ("self_attn.o_proj(attn.hook_z)", "mlp.down_proj(mlp.hook_post)"),
        # the post-norms are part of what attention and the MLP add
        "gemma2": (
            "post_attention_layernorm(self_attn.o_proj(attn.hook_z))",
            "post_feedforward_layernorm(mlp.down_proj(mlp.hook_post))",
        ),
        "olmo2": (
            "post_attention_layernorm(self_attn.o_proj(attn.hook_z))",
            "post_feedforward_layernorm(mlp.down_proj(mlp.hook_post))",
        ),
        "gpt2": ("attn.c_proj(attn.hook_z)", "mlp.c_proj(mlp.hook_post)"),
        "dinov2": ("layer_scale1(attention.o_proj(attn.hook_z))", "layer_scale2(mlp.fc2(mlp.hook_post))"),
    }[arch]
    for site in ("hook_attn_out", "attn.hook_z"):
        assert (f"blocks.0.{site}", f"hook_attn_out = {z}") in whats
    for site in ("hook_mlp_out", "mlp.hook_post"):
        assert (f"blocks.0.{site}", f"hook_mlp_out = {post}") in whats
    norm = {"llama": "post_attention_layernorm", "gemma2": "pre_feedforward_layernorm", "gpt2": "ln_2"}.get(arch)
    if norm:  # OLMo-2's MLP has no pre-norm (mlp_in is resid_mid); DINOv2's is norm2
        assert ("blocks.0.hook_mlp_in", f"hook_mlp_in = {norm}(resid_mid)") in whats


def test_a_site_that_is_not_what_it_says_stops_the_capture_before_anything_is_stored(tmp_path, monkeypatch):
    from actstore.capture import sites
    from actstore.capture.proof import CaptureCheckError

    model = _model("llama")
    real = sites.locate

    def wrong(block, hook, where):  # resid_mid read where mlp_in is (after the norm): a wrong tensor
        return real(block, "hook_mlp_in" if hook == "hook_resid_mid" else hook, where)

    monkeypatch.setattr(sites, "locate", wrong)
    with pytest.raises(CaptureCheckError, match=r"blocks\.1\.hook_resid_mid is not resid_pre \+ attn_out: differs by"):
        actstore.record(model, _batches("llama"), tmp_path / "s", layers=["blocks.1.hook_resid_mid"])
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("*.zarr*"))


def test_a_parallel_residual_has_no_resid_mid():
    from actstore.capture.hooks import resolve_hooks
    from actstore.errors import UnknownLayerError

    with pytest.raises(UnknownLayerError, match=r"adds attention and MLP to the residual in parallel"):
        resolve_hooks(_model("gpt_neox"), ["blocks.1.hook_resid_mid"])


def test_write_records_the_transcoder_sites_and_info_prints_their_checks(tmp_path):
    from capture_support import SENTENCES, save_llama, write_jsonl
    from factory import cli

    model_dir = save_llama(tmp_path / "llama", layers=3)
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES[:3]])
    names = ["blocks.1.hook_resid_mid", "blocks.1.hook_mlp_in", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"]
    cli("write", tmp_path / "s", "--model", model_dir, "--data", data, "--layers", ",".join(names), "--quiet")
    store = actstore.ActStore(tmp_path / "s")
    for e in range(3):  # what the names mean, read back: the residual adds up
        np.testing.assert_allclose(
            store[e, names[0]].astype(np.float32) + store[e, names[2]].astype(np.float32),
            store[e, names[3]].astype(np.float32),
            atol=2e-2,
        )
    info = cli("info", tmp_path / "s").output
    assert "sites        transformers " in info and "hidden_states[N + 1]" in info
    assert "  blocks.1.hook_mlp_in       width 32  checked: hook_mlp_in = post_attention_layernorm(resid_mid)" in info
    assert (
        "hook_resid_post = resid_mid + mlp_out" in info and "hook_mlp_in = post_attention_layernorm(resid_mid)" in info
    )
    assert "attn.hook_z" not in info  # only what was recorded is listed
