"""The research loop: examples/train_sae.py -> `actstore features --sae` -> `actstore view`.

The store is captured from a tiny random Llama (a word-level tokenizer, BOS labelled
special); the example trains its TopK SAE on it and writes an SAELens folder, which
SAELens itself loads with the same encodings as actstore's encoder. The feature pass's
reconstruction figures equal an independent numpy computation over the same tokens, and
its CE loss recovered equals SAELens's own evals (run_evals on a TransformerLens
HookedTransformer holding the same weights) on the same SAE and token rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from factory import WORDS, cli, word_tokenizer

import actstore
from actstore.layout import spec

pytestmark = pytest.mark.slow  # trains an SAE and runs a model

ROOT = Path(__file__).resolve().parents[1]
N_EX, T, LAYER, D = 24, 12, 0, 32


def _model_and_store(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random Llama (folder named without 'llama': TransformerLens reads its config
    from the folder) and a store of its layer-0 residual stream over N_EX rows of T tokens,
    token 0 the BOS (label special, left out by the default mask, as is any later id 0)."""
    import transformers as tf

    folder = tmp_path / f"tiny{seed}"
    word_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.3,  # logits far from uniform: ablating a layer costs loss
    )
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    ids = torch.zeros((N_EX, 1), dtype=torch.int64)  # the BOS, then text the model itself samples:
    gen = torch.Generator().manual_seed(seed)  # its loss is below a uniform guess, which ablation gives
    with torch.no_grad():
        for _ in range(T - 1):
            p = model(ids).logits[:, -1].softmax(-1)
            ids = torch.cat([ids, torch.multinomial(p, 1, generator=gen)], 1)
    ids = ids.numpy()
    with torch.no_grad():
        acts = model(torch.as_tensor(ids), output_hidden_states=True).hidden_states[LAYER + 1].numpy()
    store = tmp_path / f"s{seed}.store"
    with actstore.ShardWriter(
        store,
        layers=[LAYER],
        d_model=D,
        tokens=T,
        token_ids=True,
        token_labels=True,
        token_label_names=dict(spec.TOKEN_KIND_NAMES),
        model_id=str(folder),
        stats=True,
        attrs={"hook_names": {str(LAYER): f"blocks.{LAYER}.hook_resid_post"}},
    ) as w:
        w.append(acts[:, None].astype(np.float32), token_ids=ids, token_labels=(ids == 0).astype(np.uint8))
    actstore.finalize(store)
    return folder, store


def _numpy_quality(sae_folder: Path, x: np.ndarray) -> dict:
    """FVE, MSE, L0, dead and dense of the saved TopK SAE over tokens x, in float64 from
    the safetensors weights (no actstore or SAELens code)."""
    from safetensors.numpy import load_file

    w = {k: v.astype(np.float64) for k, v in load_file(str(sae_folder / "sae_weights.safetensors")).items()}
    k = json.loads((sae_folder / "cfg.json").read_text())["k"]
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    top = np.argsort(-pre, axis=1)[:, :k]
    f = np.zeros_like(pre)
    np.put_along_axis(f, top, np.maximum(np.take_along_axis(pre, top, 1), 0), 1)
    err = ((x - (f @ w["W_dec"] + w["b_dec"])) ** 2).sum(1)
    var = (x**2).sum(1).mean() - (x.mean(0) ** 2).sum()
    fires = (f != 0).sum(0)
    return {
        "fve": 1 - err.mean() / var,
        "mse": err.mean(),
        "l0": (f != 0).sum(1).mean(),
        "dead": int((fires == 0).sum()),
        "dense": int((fires > 0.1 * len(x)).sum()),
    }


def _saelens_ce(model_folder: Path, sae_folder: Path, tokens: torch.Tensor) -> dict:
    """SAELens's run_evals (compute_ce_loss) on a HookedTransformer with the Llama's weights,
    over `tokens` as one batch, BOS (id 0) excluded as actstore's default mask leaves it out."""
    import transformers as tf
    from sae_lens import SAE
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import convert_hf_model_config
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    hf = tf.LlamaForCausalLM.from_pretrained(model_folder).eval()
    cfg = HookedTransformerConfig(**convert_hf_model_config(str(model_folder)))
    ht = HookedTransformer(cfg)
    ht.load_and_process_state_dict(
        convert_llama_weights(hf, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    ht.eval()
    with torch.no_grad():  # the same model: TransformerLens's logits are the HF model's
        torch.testing.assert_close(ht(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)

    class Rows:  # what run_evals reads of SAELens's ActivationsStore: these token rows
        store_batch_size_prompts = len(tokens)
        context_size = tokens.shape[1]

        def get_batch_tokens(self, n):
            return tokens[:n]

        def reset_input_dataset(self):
            pass

    sae = SAE.load_from_disk(sae_folder)
    config = EvalConfig(compute_ce_loss=True, n_eval_reconstruction_batches=1, batch_size_prompts=len(tokens))
    metrics, _ = run_evals(sae, Rows(), ht, ActivationScaler(), config, exclude_special_tokens=[0])
    return metrics["model_performance_preservation"]


def test_train_sae_features_view(tmp_path):
    model, store = _model_and_store(tmp_path)
    sae, feats, site = tmp_path / "sae", tmp_path / "feats", tmp_path / "site"
    # the example as a user runs it (forked with torch imported: tests/forked.py), then the two
    # commands through click's runner in this process
    ex = forked.run(
        ROOT / "examples" / "train_sae.py",
        *(store, "--steps", 40, "--batch-size", 64, "--k", 4, "--expansion", 2, "--out", sae),
        cwd=ROOT,
        timeout=600,
    )
    assert ex.returncode == 0, ex.stderr[-3000:]
    r = cli("features", store, "--layer", LAYER, "--sae", sae, "--model", model, "--ce-tokens", 100, "--out", feats)
    cli("view", feats, "--out", site, "--quiet")
    assert "CE loss recovered" in r.output and (site / "index.html").is_file()

    # SAELens reads the folder as it is, and encodes as actstore's encoder does
    from sae_lens import SAE

    from actstore.features import load_saelens

    cfg = json.loads((sae / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["k"], cfg["normalize_activations"]) == ("topk", 4, "none")
    st = actstore.ActStore(store)
    content = [st.token_ids(e) != 0 for e in range(N_EX)]  # the pass's tokens: label 0, all but id 0
    x = np.concatenate([np.asarray(st[e, LAYER], np.float32)[content[e]] for e in range(N_EX)])
    lens = SAE.load_from_disk(sae)
    assert type(lens).__name__ == "TopKSAE" and lens.cfg.k == 4
    want = lens.encode(torch.from_numpy(x)).detach().numpy()
    got = load_saelens(sae).encode(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal((got != 0).sum(1), 4)

    # the pass's reconstruction figures over its tokens, against numpy
    meta = json.loads((feats / "meta.json").read_text())
    q = meta["quality"]
    ref = _numpy_quality(sae, x.astype(np.float64))
    assert q["n_tokens"] == len(x) > N_EX * (T - 1) * 0.8
    assert (q["l0"], q["dead"], q["dense"], q["n_latents"]) == (ref["l0"], ref["dead"], ref["dense"], 2 * D)
    assert q["fve"] == pytest.approx(ref["fve"], rel=1e-5) and q["mse"] == pytest.approx(ref["mse"], rel=1e-5)
    assert 0.2 < q["fve"] < 1  # the trained SAE explains much of the variance; the figure is no constant
    import pyarrow.parquet as pq

    n_active = pq.read_table(feats / "features.parquet").column("n_active").to_numpy()
    assert q["dead"] == int((n_active == 0).sum())  # the tables agree

    # the CE loss recovered: SAELens's own evals on the same SAE and token rows
    n_rows = int(np.searchsorted(np.cumsum([c.sum() for c in content]), 100)) + 1  # whole rows to cover 100 tokens
    scored = sum(int(c[:-1].sum()) for c in content[:n_rows])  # a content token followed by a token
    assert (q["ce_examples"], q["ce_tokens"]) == (n_rows, scored)
    rows = torch.as_tensor(np.stack([st.token_ids(e) for e in range(q["ce_examples"])]).astype(np.int64))
    lens_ce = _saelens_ce(model, sae, rows)
    for key in ("ce_loss_score", "ce_loss_without_sae", "ce_loss_with_sae", "ce_loss_with_ablation"):
        assert abs(q[key] - lens_ce[key]) < 1e-3, (key, q[key], lens_ce[key])
    assert q["ce_loss_with_ablation"] > q["ce_loss_without_sae"] + 0.05  # a score with a real denominator

    # the site's index shows the figures (rendered by a headless chromium)
    from browser import _browser, _chromium

    url = (site / "index.html").as_uri()
    dom = _browser(_chromium(), tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom", url=url)
    assert f"<b>{q['fve']:.4f}</b><span>variance explained</span>" in dom
    assert f"<b>{q['l0']:.2f}</b><span>L0</span>" in dom
    assert f"<b>{q['ce_loss_score']:.4f}</b><span>CE loss recovered ({q['ce_tokens']} tokens)</span>" in dom
    assert f"<b>{q['dead']}</b><span>dead (never active)</span>" in dom  # the index's count agrees


def test_ce_needs_the_stores_model_and_an_sae(tmp_path):
    model, store = _model_and_store(tmp_path)
    other, _ = _model_and_store(tmp_path, seed=1)
    import safetensors.numpy

    sae = tmp_path / "sae"
    sae.mkdir()
    rng = np.random.default_rng(0)
    w = {
        "W_enc": rng.standard_normal((D, 64)),
        "b_enc": np.zeros(64),
        "W_dec": rng.standard_normal((64, D)) * 0.1,
        "b_dec": np.zeros(D),
    }
    safetensors.numpy.save_file({k: v.astype(np.float32) for k, v in w.items()}, str(sae / "sae_weights.safetensors"))
    (sae / "cfg.json").write_text(json.dumps({"architecture": "topk", "d_in": D, "d_sae": 64, "k": 3}))
    common = ("features", store, "--layer", LAYER, "--ce-tokens", 30, "--quiet")
    r = cli(*common, "--sae", sae, "--model", other, "--out", tmp_path / "f1", ok=False)
    assert r.exit_code != 0 and f"--model {other} does not reproduce layer 0 of" in r.output
    assert not (tmp_path / "f1").exists()  # refused before the pass: nothing written
    r = cli(*common, "--neurons", "--model", model, "--out", tmp_path / "f2", ok=False)
    assert r.exit_code != 0 and "the neurons directions are no SAELens SAE" in r.output
    cli(*common, "--sae", sae, "--model", model, "--out", tmp_path / "f3")
    q = json.loads((tmp_path / "f3" / "meta.json").read_text())["quality"]
    assert q["ce_examples"] == 3 and q["ce_hook"] == "blocks.0.hook_resid_post" and q["ce_activation_difference"] < 1e-3
