"""Trainer adapters, each training a few steps on CPU with the real library:
dictionary_learning 0.1.0 (trainSAE from DictionaryLearningSource; the paired source in
step by token ids), sparsify (eai-sparsify 1.3.3: its Trainer over a ReplayModel), and
the SAELens data provider (kept; its own tests are in test_saelens.py)."""

from __future__ import annotations

import json

import pytest
import torch
from factory import tagged_store

from actstore.loaders.aligned import AlignmentError
from actstore.trainers import DictionaryLearningSource, paired_source, sparsify_inputs


def test_dictionary_learning_trains_from_a_store(tmp_path):
    from dictionary_learning.dictionary import AutoEncoder
    from dictionary_learning.trainers.standard import StandardTrainer
    from dictionary_learning.training import trainSAE

    st = tagged_store(tmp_path / "s", d=6, n=40)
    data = DictionaryLearningSource(st, layer=5, batch_size=16, seed=1)
    first = next(iter(DictionaryLearningSource(st, layer=5, batch_size=16, seed=1)))
    assert first.shape == (16, 6) and first.dtype == torch.float32 and torch.all(first[:, 1] == 5)
    steps = 3 * len(data.stream) + 2  # over several epochs: the source is endless
    cfg = {
        "trainer": StandardTrainer,
        "dict_class": AutoEncoder,
        "activation_dim": 6,
        "dict_size": 12,
        "lr": 1e-3,
        "l1_penalty": 1e-2,
        "warmup_steps": 2,
        "sparsity_warmup_steps": 2,
        "resample_steps": None,
        "seed": 0,
        "device": "cpu",
        "layer": 5,
        "lm_name": "tiny",
        "submodule_name": "layer5",
        "steps": steps,
    }
    trainSAE(data, [cfg], steps=steps, save_dir=str(tmp_path / "out"), device="cpu")
    ae = torch.load(tmp_path / "out" / "trainer_0" / "ae.pt", weights_only=True)
    assert ae["encoder.weight"].shape == (12, 6) and torch.isfinite(ae["encoder.weight"]).all()
    saved = json.loads((tmp_path / "out" / "trainer_0" / "config.json").read_text())
    assert saved["buffer"]["layers"] == [5] and saved["buffer"]["out_batch_size"] == 16
    assert data.state_dict()["epoch"] == 3


def test_paired_source_is_in_step_by_token_ids_and_resumes(tmp_path):
    a = tagged_store(tmp_path / "a", d=6, seed=1)
    b = tagged_store(tmp_path / "b", d=6, seed=2)  # another model on the same tokens
    src = paired_source(a, b, layer=9, batch_size=5, seed=3)
    batches = [next(src) for _ in range(len(src.stream))]
    for x in batches:
        assert x.shape == (5, 2, 6)
        assert torch.equal(x[:, 0, [0, 2, 3, 4]], x[:, 1, [0, 2, 3, 4]])  # token id, example, segment, position
        assert not torch.equal(x[:, 0, 5], x[:, 1, 5])  # but each model's own vectors
    state = None
    again = paired_source(a, b, layer=9, batch_size=5, seed=3)
    for _ in range(3):
        next(again)
    state = again.state_dict()
    resumed = paired_source(a, b, layer=9, batch_size=5, seed=3)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed), batches[3])
    c = tagged_store(tmp_path / "c", ids_seed=9)
    with pytest.raises(AlignmentError, match="aligned stores must be captured on the same tokens"):
        paired_source(a, c, layer=9)


def test_sparsify_trainer_trains_from_a_store(tmp_path):
    from sparsify import SparseCoderConfig, TrainConfig, Trainer

    st = tagged_store(tmp_path / "s", d=8, n=40)
    ds, model = sparsify_inputs(st, layers=[2, 9], tokens_per_row=8, seed=0)
    cfg = TrainConfig(
        SparseCoderConfig(num_latents=16, k=4),
        batch_size=2,
        layers=[2, 9],
        log_to_wandb=False,
        save_dir=str(tmp_path / "ckpt"),
        save_every=10_000,
        lr_warmup_steps=1,
        optimizer="adam",
    )
    seen = []
    for i in (2, 9):
        model.layers[i].register_forward_hook(lambda m, inp, out, i=i: seen.append((i, out.detach().clone())))
    trainer = Trainer(cfg, ds, model)
    trainer.fit()
    assert trainer.global_step == -(-len(ds) // 2)  # the last, short DataLoader batch is a step too
    got = [x for i, x in seen if i == 2 and x.shape[1] == 8]
    assert len(got) == -(-len(ds) // 2)
    rows = torch.cat([g.reshape(-1, 8) for g in got])
    assert torch.all(rows[:, 1] == 2)
    nine = torch.cat([x.reshape(-1, 8) for i, x in seen if i == 9 and x.shape[1] == 8])
    assert torch.equal(rows[:, [0, 2, 3, 4]], nine[:, [0, 2, 3, 4]])  # both layers saw the same tokens
    toks = {tuple(r) for r in rows[:, [2, 3, 4]].numpy().astype(int).tolist()}
    assert len(toks) == len(rows)  # each token once
    for name, sae in trainer.saes.items():
        assert torch.isfinite(sae.encoder.weight).all() and sae.encoder.weight.shape == (16, 8)
    # sparsify's resume path: dataset.select(range(n, ...)) -> the model repositions the stream exactly
    ds2, model2 = sparsify_inputs(st, layers=[2, 9], tokens_per_row=8, seed=0)
    captured = []
    model2.layers[2].register_forward_hook(lambda m, inp, out: captured.append(out))
    for batch in torch.utils.data.DataLoader(ds2.select(range(3, len(ds2))), batch_size=2, shuffle=False):
        model2(batch["input_ids"])
    resumed = torch.cat([c.reshape(-1, 8) for c in captured])
    torch.testing.assert_close(resumed, rows[3 * 8 :], rtol=0, atol=0)
