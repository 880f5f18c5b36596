"""export-saelens and the SAETrainer adapter (docs/export.md, "SAELens"): SAELens itself
(sae-lens 6.x) reads the export, finds exactly the store's real vectors with their token
ids, and trains on it and on the adapter with no model forward pass."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.errors import LayerNotFoundError
from actstore.layout.spec import TOKEN_KIND_NAMES
from actstore.saelens import SaelensExportError, export_saelens, saelens_data_provider

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two padded segments with random lengths, token ids and labels; layers 0 and 3."""
    path = tmp_path_factory.mktemp("sl") / "s.store"
    rng = np.random.default_rng(0)
    n = 37
    with actstore.ShardWriter(
        path,
        layers=[0, 3],
        d_model=8,
        segments={"prompt": 6, "response": 4},
        token_ids=True,
        token_labels=True,
        token_label_names=TOKEN_KIND_NAMES,  # labels 0..2 are token kinds: the default mask keeps 0
        model_id="tiny",
        attrs={"hook_names": {"0": "blocks.0.hook_resid_post", "3": "blocks.3.hook_resid_post"}},
    ) as w:
        w.append(
            prompt=rng.standard_normal((n, 2, 6, 8)).astype(np.float16),
            response=rng.standard_normal((n, 2, 4, 8)).astype(np.float16),
            lengths={"prompt": rng.integers(1, 7, n), "response": rng.integers(0, 5, n)},
            token_ids={"prompt": rng.integers(0, 1000, (n, 6)), "response": rng.integers(0, 1000, (n, 4))},
            token_labels={
                "prompt": rng.integers(0, 3, (n, 6)).astype(np.uint8),
                "response": np.zeros((n, 4), np.uint8),
            },
        )
    actstore.finalize(path)
    return actstore.ActStore(path)


def _real(store, layer):
    """Every real (vector, token id) of a layer, sorted (a multiset)."""
    x = np.concatenate([np.asarray(store[i, layer], np.float32) for i in range(len(store))])
    ids = np.concatenate([store.token_ids(i) for i in range(len(store))])
    return _sorted(x, ids)


def _sorted(x, ids):
    order = np.lexsort([*x.T[::-1], ids])
    return x[order], ids[order]


@pytest.mark.slow
def test_saelens_reads_exactly_the_real_tokens(store, tmp_path):
    from sae_lens.training.activations_store import ActivationsStore

    res = export_saelens(
        store,
        tmp_path / "out",
        layer="blocks.3.hook_resid_post",
        context_size=16,
        seed=3,
        skip_special=False,
        progress=False,
    )  # every real token, special and template ones included
    cfg = json.loads((tmp_path / "out" / "saelens_config.json").read_text())
    assert cfg == res.config and cfg["hook_name"] == "blocks.3.hook_resid_post" and cfg["d_in"] == 8
    assert res.n_rows % cfg["store_batch_size_prompts"] == 0  # SAELens reads every row
    acts = ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=cfg["hook_name"],
        hook_head_index=None,
        context_size=16,
        d_in=8,
        n_batches_in_buffer=cfg["n_batches_in_buffer"],
        total_training_tokens=10**6,
        store_batch_size_prompts=cfg["store_batch_size_prompts"],
        train_batch_size_tokens=64,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(tmp_path / "out"),
        exclude_special_tokens=torch.tensor(cfg["exclude_special_tokens"]),
    )
    got_x, got_ids = [], []
    with pytest.raises(StopIteration):
        while True:  # one epoch, in disk order
            x, ids = acts.get_raw_llm_batch(raise_on_epoch_end=True)
            keep = ids != -1
            got_x.append(x[keep].numpy())
            got_ids.append(ids[keep].numpy().astype(np.int64))
    gx, gi = _sorted(np.concatenate(got_x), np.concatenate(got_ids))
    wx, wi = _real(store, 3)
    np.testing.assert_array_equal(gi, wi)  # every real token exactly once, none of the padding
    np.testing.assert_array_equal(gx, wx)  # float16 widened exactly
    first_row = acts.cached_activation_dataset[0]["token_ids"]
    assert first_row.tolist() != wi[:16].tolist()  # shuffled at token level, not store order


def test_saelens_trains_20_steps_from_the_export_without_a_model(store, tmp_path):
    import datasets
    import transformer_lens
    from sae_lens import LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAEConfig

    res = export_saelens(store, tmp_path / "out", layer=0, context_size=8, progress=False)
    c = res.config
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=8, d_sae=16),
        model_name="tiny",
        hook_name=c["hook_name"],
        context_size=8,
        use_cached_activations=True,
        cached_activations_path=c["cached_activations_path"],
        dataset_path="",
        n_batches_in_buffer=c["n_batches_in_buffer"],
        store_batch_size_prompts=c["store_batch_size_prompts"],
        train_batch_size_tokens=32,
        training_tokens=20 * 32,
        exclude_special_tokens=c["exclude_special_tokens"],
        logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=str(tmp_path / "ckpt"),
        output_path=str(tmp_path / "sae"),
        n_batches_for_norm_estimate=2,
        verbose=False,
        device="cpu",
    )
    runner = LanguageModelSAETrainingRunner(
        cfg,
        override_model=transformer_lens.hook_points.HookedRootModule(),
        override_dataset=datasets.Dataset.from_dict({"tokens": [[0] * 8]}),
    )
    sae = runner.run()
    w = sae.W_dec.detach()
    assert w.shape == (16, 8) and torch.isfinite(w).all()


def test_the_adapter_feeds_saetrainer_from_a_tokenstream(store):
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.training.sae_trainer import SAETrainer, SAETrainerConfig

    provider = saelens_data_provider(store, layer="blocks.0.hook_resid_post", batch_size=32, seed=1)
    first = next(provider)
    assert first.shape == (32, 8) and first.dtype == torch.float32
    real = {tuple(v) for v in _real(store, 0)[0].tolist()}
    assert all(tuple(v) in real for v in first.tolist())  # real vectors of the layer, no padding
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=8, d_sae=16))
    trainer = SAETrainer(
        cfg=SAETrainerConfig(
            total_training_samples=10 * 32, train_batch_size_samples=32, n_batches_for_norm_estimate=2, lr_end=3e-5
        ),
        sae=sae,
        data_provider=provider,
    )
    trained = trainer.fit()
    assert trainer.n_training_steps == 10 and torch.isfinite(trained.W_dec).all()


def test_cli_and_errors(store, tmp_path):
    res = CliRunner().invoke(
        main, ["export-saelens", str(store.path), str(tmp_path / "o"), "--layer", "3", "--json", "--quiet"]
    )
    assert res.exit_code == 0, res.output
    assert res.stderr == "actstore: warning: OUT as an argument is deprecated; use --out\n"  # for one release
    s = json.loads(res.stdout)
    content = sum(
        int((store.field(f"{g}_token_labels")[i, : store.lengths(i)[g]] == 0).sum())
        for i in range(len(store))
        for g in store.segments
    )
    assert (
        s["tokens"] == content < len(_real(store, 3)[1])
    )  # by default the labels' special and template tokens are left out
    assert s["config"]["hook_name"] == "blocks.3.hook_resid_post"
    every = CliRunner().invoke(
        main,
        [
            "export-saelens",
            str(store.path),
            "-o",
            str(tmp_path / "k"),
            "--layer",
            "3",
            "--json",
            "--quiet",
            "--special",
            "keep",
        ],
    )
    assert every.exit_code == 0 and json.loads(every.stdout)["tokens"] == len(_real(store, 3)[1])
    quiet = CliRunner().invoke(
        main, ["export-saelens", str(store.path), "--out", str(tmp_path / "q"), "--layer", "3", "--quiet"]
    )
    assert (quiet.exit_code, quiet.output) == (0, "") and (tmp_path / "q" / "saelens_config.json").exists()
    again = CliRunner().invoke(main, ["export-saelens", str(store.path), "-o", str(tmp_path / "o"), "--layer", "3"])
    assert again.exit_code == 1 and "exists and is not empty; export to a new folder" in again.output
    assert "or replace it with --overwrite" in again.output
    before = (tmp_path / "o" / "saelens_config.json").read_bytes()
    over = CliRunner().invoke(
        main, ["export-saelens", str(store.path), "-o", str(tmp_path / "o"), "--layer", "0", "--overwrite", "--json"]
    )
    assert over.exit_code == 0, over.output
    config = json.loads((tmp_path / "o" / "saelens_config.json").read_bytes())
    assert config["hook_name"] == "blocks.0.hook_resid_post" and before != json.dumps(config).encode()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".o.tmp", ".o.old"))]  # swapped in whole
    with pytest.raises(LayerNotFoundError, match=r"layer 5 is not stored; this store holds layers \[0, 3\]"):
        export_saelens(store, tmp_path / "x", layer=5, progress=False)
    with pytest.raises(SaelensExportError, match="context_size must be a positive int"):
        export_saelens(store, tmp_path / "x", layer=0, context_size=0, progress=False)
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".x.tmp")]


def test_the_default_column_is_the_name_the_capture_kept(tmp_path):
    """A module-path layer (model.layers.6.mlp, stored as layer 6) is not block 6's residual
    stream: its column is named by the path (what SAELens's HF wrapper hooks), not blocks.6."""
    path = tmp_path / "s.store"
    with actstore.ShardWriter(
        path,
        layers=[6, 8],
        d_model=4,
        segments={"tokens": 3},
        token_ids=True,
        attrs={"hook_names": {"6": "model.layers.6.mlp", "8": "blocks.8.hook_resid_post"}},
    ) as w:
        w.append(
            tokens=np.ones((2, 2, 3, 4), np.float16),
            lengths={"tokens": [3, 2]},
            token_ids={"tokens": np.ones((2, 3), np.int64)},
        )
    actstore.finalize(path)
    names = {
        layer: export_saelens(path, tmp_path / f"o{layer}", layer=layer, context_size=2, progress=False).hook_name
        for layer in (6, 8)
    }
    assert names == {6: "model.layers.6.mlp", 8: "blocks.8.hook_resid_post"}
    assert json.loads((tmp_path / "o6" / "dataset_info.json").read_text())["features"].keys() == {
        "model.layers.6.mlp",
        "token_ids",
    }
