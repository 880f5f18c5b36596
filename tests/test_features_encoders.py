"""Encoders read from each direction source give the source library's own encode: SAELens
(its SAE classes, saved with save_model), saev and dictionary_learning (checkpoints written
in their formats, compared with their encode functions transcribed from their sources);
bad checkpoints are refused with a message that says what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actstore.features import EncoderError, load_dictionary_learning, load_directions, load_saelens, load_saev
from actstore.features.encoders.sources import load

D_IN, D_SAE = 16, 40


def _randomize(sae, gen):
    with torch.no_grad():
        for name, p in sae.named_parameters():
            if name == "threshold":
                p.copy_(torch.rand(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _saelens(kind, tmp_path, **cfg):
    import sae_lens

    classes = {
        "standard": ("StandardSAE", "StandardSAEConfig"),
        "jumprelu": ("JumpReLUSAE", "JumpReLUSAEConfig"),
        "topk": ("TopKSAE", "TopKSAEConfig"),
    }
    sae_cls, cfg_cls = (getattr(sae_lens, n) for n in classes[kind])
    sae = sae_cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, dtype="float32", device="cpu", **cfg))
    _randomize(sae, torch.Generator().manual_seed(len(tmp_path.name)))
    folder = tmp_path / f"sae-{kind}"
    sae.save_model(folder)
    return sae, folder


@pytest.mark.parametrize("device", [None, "cpu"])  # numpy, and torch
@pytest.mark.parametrize(
    "kind,cfg",
    [
        ("standard", {}),
        ("standard", {"apply_b_dec_to_input": False}),
        ("standard", {"normalize_activations": "constant_norm_rescale"}),
        ("standard", {"normalize_activations": "layer_norm"}),
        ("jumprelu", {}),
        ("jumprelu", {"apply_b_dec_to_input": False}),
        ("topk", {"k": 5}),
        ("topk", {"k": 3, "rescale_acts_by_decoder_norm": True}),
    ],
)
def test_saelens_encode_is_sae_lens_own(tmp_path, kind, cfg, device):
    sae, folder = _saelens(kind, tmp_path, **cfg)
    enc = load_saelens(folder)
    assert enc.kind == "saelens" and (enc.d_in, enc.n_features) == (D_IN, D_SAE)
    assert (enc.b_pre is not None) == cfg.get("apply_b_dec_to_input", True)
    x = np.random.default_rng(0).standard_normal((300, D_IN)).astype(np.float32) * 3
    want = sae.encode(torch.from_numpy(x)).detach().numpy()
    got = enc.encode(x, device=device)
    assert (want > 0).sum() > 100  # the comparison sees many active latents
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got > 0, want > 0)
    # a subset of features gives those columns (TopK still selects over all latents)
    cols = np.array([1, 7, 30])
    np.testing.assert_allclose(enc.encode(x, cols, device=device), want[:, cols], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        enc.encode(x, cols, device=device, feature_major=True), want[:, cols].T, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(enc.W_dec, sae.W_dec.detach().numpy())
    # the reconstruction is SAELens's decode (its input normalisation undone), numpy and torch
    recon = sae.decode(sae.encode(torch.from_numpy(x))).detach().numpy()
    np.testing.assert_allclose(enc.decode(np.ascontiguousarray(want.T), x), recon, rtol=1e-4, atol=1e-4)
    from actstore.features.topk.quality import reconstruct_tensor

    np.testing.assert_allclose(reconstruct_tensor(enc, torch.from_numpy(x)).numpy(), recon, rtol=1e-4, atol=1e-4)
    assert np.abs(recon - sae.b_dec.detach().numpy()).mean() > 1  # the latents reach the output: a real check


def _saev_file(path, activation, state):
    header = {
        "schema": 5,
        "cfg": {"d_model": D_IN, "d_sae": D_SAE, "activation": activation, "normalize_w_dec": True},
        "commit": "x",
        "lib": "test",
    }
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        torch.save(state, f)


def _sae_state(gen, **extra):
    s = {
        "W_enc": torch.randn(D_IN, D_SAE, generator=gen),
        "b_enc": torch.randn(D_SAE, generator=gen) * 0.3,
        "W_dec": torch.randn(D_SAE, D_IN, generator=gen),
        "b_dec": torch.randn(D_IN, generator=gen),
    }
    return s | extra


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("act", ["Relu", "TopK", "BatchTopK"])
def test_saev_checkpoints(tmp_path, act, device):
    gen = torch.Generator().manual_seed(1)
    extra = {"activation.threshold": torch.tensor(0.4)} if act == "BatchTopK" else {}
    state = _sae_state(gen, **extra)
    if act == "TopK":
        state["b_enc"] -= 5  # mostly negative pre-activations: some of the kept top-k are negative
    params = {"top_k": 4} if act != "Relu" else {}
    _saev_file(tmp_path / "sae.pt", {"cls": act, "params": params}, state)
    enc = load_saev(tmp_path / "sae.pt")
    x = torch.randn(200, D_IN, generator=gen)
    # saev's SparseAutoencoder.encode (src/saev/nn/modeling.py): h = x @ W_enc + b_enc, then the activation (eval mode)
    h = x @ state["W_enc"] + state["b_enc"]
    if act == "Relu":
        want = torch.relu(h)
    elif act == "TopK":
        _, idx = torch.topk(h, 4, dim=-1)
        want = torch.zeros_like(h).scatter(-1, idx, 1.0) * h
    else:
        want = torch.where(h > 0.4, h, torch.zeros_like(h))
    got = enc.encode(x.numpy(), device=device)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    if act == "TopK":
        assert (got < 0).any()  # saev keeps the k largest signed


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("dict_class", ["AutoEncoder", "JumpReluAutoEncoder", "AutoEncoderTopK", "BatchTopKSAE"])
def test_dictionary_learning_checkpoints(tmp_path, dict_class, device):
    gen = torch.Generator().manual_seed(2)
    W = torch.randn(D_SAE, D_IN, generator=gen)
    b = torch.randn(D_SAE, generator=gen) * 0.3
    bd = torch.randn(D_IN, generator=gen)
    if dict_class == "JumpReluAutoEncoder":
        state = {
            "W_enc": W.T.contiguous(),
            "b_enc": b,
            "W_dec": torch.randn(D_SAE, D_IN, generator=gen),
            "b_dec": bd,
            "threshold": torch.rand(D_SAE, generator=gen),
        }
    else:
        state = {"encoder.weight": W, "encoder.bias": b, "decoder.weight": torch.randn(D_IN, D_SAE, generator=gen)}
        state["bias" if dict_class == "AutoEncoder" else "b_dec"] = bd
        if dict_class in ("AutoEncoderTopK", "BatchTopKSAE"):
            state |= {"k": torch.tensor(4, dtype=torch.int), "threshold": torch.tensor(0.3)}
    folder = tmp_path / "trainer_0"
    folder.mkdir()
    torch.save(state, folder / "ae.pt")
    (folder / "config.json").write_text(
        json.dumps({"trainer": {"dict_class": dict_class, "activation_dim": D_IN, "dict_size": D_SAE}})
    )
    enc = load_dictionary_learning(folder)
    x = torch.randn(200, D_IN, generator=gen)
    # dictionary_learning's encode (dictionary.py, trainers/top_k.py, trainers/batch_top_k.py at 60ec6bf)
    if dict_class == "AutoEncoder":
        want = torch.relu((x - bd) @ W.T + b)
    elif dict_class == "JumpReluAutoEncoder":
        pre = x @ state["W_enc"] + b
        want = torch.relu(pre * (pre > state["threshold"]))
    elif dict_class == "AutoEncoderTopK":
        post = torch.relu((x - bd) @ W.T + b)
        vals, idx = post.topk(4, sorted=False, dim=-1)
        want = torch.zeros_like(post).scatter(-1, idx, vals)
    else:
        post = torch.relu((x - bd) @ W.T + b)
        want = post * (post > 0.3)
    np.testing.assert_allclose(enc.encode(x.numpy(), device=device), want.numpy(), rtol=1e-5, atol=1e-5)
    assert load_dictionary_learning(folder / "ae.pt").n_features == D_SAE


def test_directions_npy_and_safetensors(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    W = rng.standard_normal((D_IN, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    np.save(tmp_path / "w.npy", W)
    np.save(tmp_path / "b.npy", b)
    save_file({"W": W, "b": b}, str(tmp_path / "w.safetensors"))
    x = rng.standard_normal((50, D_IN)).astype(np.float32)
    for enc in (
        load_directions(tmp_path / "w.npy", tmp_path / "b.npy"),
        load_directions(tmp_path / "w.safetensors"),
        load(directions=tmp_path / "w.safetensors"),
    ):
        np.testing.assert_allclose(enc.encode(x), x @ W + b, rtol=1e-5, atol=1e-5)
        assert (enc.encode(x) < 0).any()  # probes are signed
    assert load_directions(tmp_path / "w.npy").b is None


def test_bad_direction_sources(tmp_path):
    sae, folder = _saelens("standard", tmp_path)
    raw = (folder / "sae_weights.safetensors").read_bytes()
    (folder / "sae_weights.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(EncoderError, match="is not a readable safetensors file .*re-save it"):
        load_saelens(folder)
    with pytest.raises(
        EncoderError, match="is not an SAELens checkpoint: it needs cfg.json and sae_weights.safetensors"
    ):
        load_saelens(tmp_path)
    np.save(tmp_path / "w3.npy", np.zeros((2, 3, 4), np.float32))
    with pytest.raises(
        EncoderError, match=r"holds an array of shape \(2, 3, 4\): directions must be a \(d_model, F\) matrix"
    ):
        load_directions(tmp_path / "w3.npy")
    np.save(tmp_path / "w.npy", np.zeros((4, 3), np.float32))
    np.save(tmp_path / "b.npy", np.zeros(4, np.float32))
    with pytest.raises(
        EncoderError, match=r"the bias in .*b\.npy has 4 values but the directions matrix \(4, 3\) of .*w\.npy has F=3"
    ):  # both files named
        load_directions(tmp_path / "w.npy", tmp_path / "b.npy")
    np.save(tmp_path / "nan.npy", np.full((4, 3), np.nan, np.float32))
    with pytest.raises(EncoderError, match="NaN or infinite"):
        load_directions(tmp_path / "nan.npy")
    (tmp_path / "x.pt").write_bytes(b"not a header\n")
    with pytest.raises(EncoderError, match="does not start with saev's JSON header line"):
        load_saev(tmp_path / "x.pt")
    with pytest.raises(EncoderError, match="name exactly one direction source"):
        load(sae=folder, directions=tmp_path / "w.npy")


def test_cuda_device(tmp_path):
    """--device cuda: the same values as the CPU where an accelerator is present, a clear
    error before any work where none is."""
    from actstore.errors import DeviceError

    sae, folder = _saelens("jumprelu", tmp_path)
    enc = load_saelens(folder)
    x = np.random.default_rng(5).standard_normal((64, D_IN)).astype(np.float32)
    if torch.cuda.is_available():
        np.testing.assert_allclose(enc.encode(x, device="cuda"), enc.encode(x, device="cpu"), rtol=1e-4, atol=1e-4)
    else:
        with pytest.raises(DeviceError, match=r"--device cuda: torch .* sees no CUDA device here; use cpu"):
            enc.encode(x, device="cuda")


@pytest.mark.parametrize("dict_class", ["AutoEncoder", "JumpReluAutoEncoder", "AutoEncoderTopK", "BatchTopKSAE"])
def test_dictionary_learning_package_own_encode(tmp_path, dict_class):
    """Checkpoints saved from dictionary-learning 0.1.0's own classes (scripts/setup.sh
    installs it) encode as its encode does."""
    from dictionary_learning import dictionary
    from dictionary_learning.trainers import batch_top_k, top_k

    gen = torch.Generator().manual_seed(7)
    ae = {
        "AutoEncoder": lambda: dictionary.AutoEncoder(D_IN, D_SAE),
        "JumpReluAutoEncoder": lambda: dictionary.JumpReluAutoEncoder(D_IN, D_SAE),
        "AutoEncoderTopK": lambda: top_k.AutoEncoderTopK(D_IN, D_SAE, k=4),
        "BatchTopKSAE": lambda: batch_top_k.BatchTopKSAE(D_IN, D_SAE, k=4),
    }[dict_class]()
    with torch.no_grad():
        for name, p in ae.named_parameters():
            p.copy_(
                torch.rand(p.shape, generator=gen) * 0.3
                if name == "threshold"
                else torch.randn(p.shape, generator=gen) * 0.5
            )
        if dict_class == "BatchTopKSAE":
            ae.threshold.fill_(0.2)
    folder = tmp_path / "trainer_0"
    folder.mkdir()
    torch.save(ae.state_dict(), folder / "ae.pt")
    (folder / "config.json").write_text(json.dumps({"trainer": {"dict_class": dict_class}}))
    x = torch.randn(150, D_IN, generator=gen)
    with torch.no_grad():
        want = ae.encode(x).numpy()
    got = load_dictionary_learning(folder).encode(x.numpy())
    assert (want > 0).sum() > 50
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_saelens_checkpoint(tmp_path):
    """An SAE saved in bfloat16 (numpy has no bfloat16) is read through torch, exactly widened."""
    import sae_lens

    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, dtype="bfloat16", device="cpu"))
    _randomize(sae, torch.Generator().manual_seed(3))
    sae.save_model(tmp_path / "bf")
    enc = load_saelens(tmp_path / "bf")
    np.testing.assert_array_equal(enc.W, sae.W_enc.detach().float().numpy())
    np.testing.assert_array_equal(enc.b_pre, sae.b_dec.detach().float().numpy())


@pytest.mark.parametrize("kind,cfg", [("topk", {"k": 5}), ("standard", {"normalize_activations": "layer_norm"})])
def test_reconstruction_quality_every_sink(tmp_path, kind, cfg):
    """An SAE's quality figures over a pass's tokens (two segments, the default mask) are the
    same from the numpy encode, the torch encode, the torch update (DeviceConsumer, as on a GPU)
    and a feature subset (all latents encoded again), and equal SAELens's over those tokens."""
    from factory import text_store

    from actstore.features.topk.layerpass import top_activations
    from actstore.features.topk.quality import Reconstruction
    from actstore.read.masks import leaves_out_special

    sae, folder = _saelens(kind, tmp_path, **cfg)
    st = text_store(tmp_path / "s.store", n=80, d_model=D_IN, kinds=True)
    assert leaves_out_special(st)
    enc = load_saelens(folder)
    results = []
    for device, kernel, features in (
        (None, "numpy", None),
        ("cpu", "auto", None),
        ("cpu", "torch", None),
        (None, "auto", [3, 9]),
    ):
        q = Reconstruction(enc)
        top_activations(st, 3, enc, device=device, kernel=kernel, features=features, quality=q, batch_elements=4000)
        results.append(q.result())
    x = np.concatenate(
        [
            np.asarray(st.segment(seg)[e, 3], np.float32)[
                np.asarray(st.field(seg + "_token_labels"))[e, : st.lengths(e)[seg]] == 0
            ]
            for e in range(len(st))
            for seg in ("prompt", "response")
        ]
    )
    f = sae.encode(torch.from_numpy(x))
    err = (torch.from_numpy(x) - sae.decode(f)).pow(2).sum(1).double()
    var = (x.astype(np.float64) ** 2).sum(1).mean() - (x.astype(np.float64).mean(0) ** 2).sum()
    fires = (f != 0).sum(0)
    for r in results:
        assert r["n_tokens"] == len(x) > 100
        assert (r["l0"], r["dead"], r["dense"]) == (
            pytest.approx(float((f != 0).sum(1).double().mean())),
            int((fires == 0).sum()),
            int((fires > 0.1 * len(x)).sum()),
        )
        assert r["mse"] == pytest.approx(float(err.mean()), rel=1e-5)
        assert r["fve"] == pytest.approx(1 - float(err.mean()) / var, rel=1e-5)
