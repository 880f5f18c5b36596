"""The exports other tools read: Neuronpedia's import layout (every line's keys are columns of
the table its importer inserts into, as Neuronpedia's Prisma schema and converter define them)
and delphi's latent cache, read back by delphi's own LatentDataset (eai-delphi 0.1.3, installed
by scripts/setup.sh without its heavy dependencies) and by safetensors."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from click.testing import CliRunner
from factory import WORD_D as D
from factory import WORDS

import actstore
from actstore.cli import main

pytestmark = pytest.mark.torch  # the word store's tokenizer is a transformers one; delphi's loader imports torch

# Columns of Neuronpedia's tables (apps/webapp/prisma/schema.prisma at hijohnnylin/neuronpedia
# ebb8426f): the importer inserts a line's keys that are columns, so every key must be one.
NEURON_COLUMNS = set(
    "modelId layer index sourceSetName creatorId createdAt maxActApprox hasVector vector vectorLabel "
    "vectorDefaultSteerStrength hookName topkCosSimIndices topkCosSimValues neuron_alignment_indices "
    "neuron_alignment_values neuron_alignment_l1 correlated_neurons_indices correlated_neurons_pearson "
    "correlated_neurons_l1 correlated_features_indices correlated_features_pearson correlated_features_l1 "
    "neg_str neg_values pos_str pos_values frac_nonzero freq_hist_data_bar_heights freq_hist_data_bar_values "
    "logits_hist_data_bar_heights logits_hist_data_bar_values decoder_weights_dist umap_cluster "
    "umap_log_feature_sparsity umap_x umap_y".split()
)
NEURON_REQUIRED = {"modelId", "layer", "index"}
ACTIVATION_COLUMNS = set(
    "id tokens dataIndex index layer modelId dataSource maxValue maxValueTokenIndex minValue values dfaValues "
    "dfaTargetIndex dfaMaxValue zQIndices zKIndices zValues creatorId createdAt lossValues logitContributions "
    "binMin binMax binContains qualifyingTokenIndex".split()
)
ACTIVATION_REQUIRED = {
    "id",
    "tokens",
    "index",
    "layer",
    "modelId",
    "maxValue",
    "maxValueTokenIndex",
    "minValue",
    "values",
    "creatorId",
}


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def _jsonl_gz(path):
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


def test_neuronpedia_layout_has_the_importers_columns(text_store, tmp_path):
    path, tok = text_store
    np.save(tmp_path / "dirs.npy", np.eye(D, dtype=np.float32))
    W_U = np.zeros((D, len(WORDS)), np.float32)
    for i in range(D):
        W_U[i, 10 + i] = 1.0
    np.save(tmp_path / "wu.npy", W_U)
    _cli(
        "features",
        path,
        "--layer",
        4,
        "--directions",
        tmp_path / "dirs.npy",
        "--top-k",
        3,
        "--out",
        tmp_path / "feat",
        "--quiet",
    )
    out = _cli(
        "export-neuronpedia",
        tmp_path / "feat",
        "--out",
        tmp_path / "np",
        "--unembedding",
        tmp_path / "wu.npy",
        "--sae-set",
        "res-6",
    )
    src = tmp_path / "np" / "tok" / "4-res-6"  # model id: the tokenizer folder's name
    assert f"wrote {src} (Neuronpedia's layout) and 1 batch files to {tmp_path / 'np'}" in out
    assert sorted(p.name for p in src.iterdir()) == [
        "activations",
        "features",
        "model.jsonl",
        "release.jsonl",
        "source.jsonl",
        "sourceset.jsonl",
    ]
    source = json.loads((src / "source.jsonl").read_text())
    assert source["id"] == "4-res-6" and source["modelId"] == "tok" and source["setName"] == "res-6"
    assert json.loads((src / "sourceset.jsonl").read_text())["name"] == "res-6"
    neurons = _jsonl_gz(src / "features" / "batch-0.jsonl.gz")
    acts = _jsonl_gz(src / "activations" / "batch-0.jsonl.gz")
    assert [n["index"] for n in neurons] == [str(f) for f in range(D)]
    for n in neurons:
        assert NEURON_REQUIRED <= set(n) <= NEURON_COLUMNS and n["layer"] == "4-res-6" and n["modelId"] == "tok"
    for a in acts:
        assert ACTIVATION_REQUIRED <= set(a) <= ACTIVATION_COLUMNS
        assert a["maxValue"] == max(a["values"]) and a["values"][a["maxValueTokenIndex"]] == a["maxValue"]
        assert len(a["tokens"]) == len(a["values"]) and all(isinstance(t, str) for t in a["tokens"])
    assert len({a["id"] for a in acts}) == len(acts) and all(len(a["id"]) == 25 for a in acts)
    f0 = neurons[0]
    assert f0["pos_str"][0] == "red" and f0["topkCosSimValues"][0] == 0.0 and len(f0["topkCosSimIndices"]) == D - 1
    top0 = [a for a in acts if a["index"] == "0" and a["binMin"] == -1]
    assert (
        len(top0) == 3 and top0[0]["tokens"][top0[0]["qualifyingTokenIndex"]] == " zebra" and top0[0]["maxValue"] == 6.0
    )
    assert f0["maxActApprox"] == 6.0
    # the same dashboards as SAEDashboard's JSON
    from sae_dashboard.neuronpedia.neuronpedia_dashboard import NeuronpediaDashboardBatch

    data = json.loads((tmp_path / "np" / "batch-0.json").read_text())
    assert NeuronpediaDashboardBatch(**data).to_dict() == data
    assert [f["feature_index"] for f in data["features"]] == list(range(D))


def test_delphi_cache_reads_back_in_delphi(text_store, tmp_path):
    """Every non-zero of the SAE over the store's content tokens, in delphi's split files,
    as delphi's own LatentDataset loads and samples them."""
    from sae_lens import StandardSAE, StandardSAEConfig
    from safetensors.numpy import load_file

    from actstore.features import load_saelens

    path, tok_dir = text_store
    import torch

    torch.manual_seed(0)
    sae = StandardSAE(StandardSAEConfig(d_in=D, d_sae=12, dtype="float32", device="cpu"))
    sae.save_model(tmp_path / "sae")
    out = tmp_path / "delphi"
    _cli("export-delphi", path, "--layer", 4, "--sae", tmp_path / "sae", "--n-splits", 3, "--out", out, "--quiet")
    store = actstore.open(path)
    enc = load_saelens(tmp_path / "sae")
    want = set()
    for ex in range(len(store)):
        z = enc.encode(np.asarray(store[ex, 4], np.float32))
        z[0] = 0  # BOS (label 1) is left out, as the feature pass leaves it out
        for t, f in zip(*np.nonzero(z)):
            want.add((ex, int(t), int(f), float(np.float16(z[t, f]))))
    got = set()
    files = sorted((out / "layers.4").glob("*.safetensors"))
    assert [p.name for p in files] == ["0_3.safetensors", "4_7.safetensors", "8_11.safetensors"]
    for p in files:
        start = int(p.stem.split("_")[0])
        t = load_file(p)
        assert t["locations"].dtype == np.uint16 and t["activations"].dtype == np.float16
        np.testing.assert_array_equal(t["tokens"][:, :9], np.stack([store.token_ids(e) for e in range(len(store))]))
        for (ex, pos, lat), a in zip(t["locations"].tolist(), t["activations"].tolist()):
            got.add((ex, pos, lat + start, a))
    assert got == want and len(want) > 20
    cfg = json.loads((out / "layers.4" / "config.json").read_text())
    assert cfg["cache_ctx_len"] == 9 and cfg["n_splits"] == 3 and cfg["model_name"] == str(tok_dir)

    from delphi.config import ConstructorConfig, SamplerConfig
    from delphi.latents.loader import LatentDataset
    from transformers import AutoTokenizer

    ds = LatentDataset(
        out,
        SamplerConfig(n_examples_train=2, n_examples_test=2, n_quantiles=2, train_type="top"),
        ConstructorConfig(example_ctx_len=3, min_examples=1, n_non_activating=1),
        tokenizer=AutoTokenizer.from_pretrained(tok_dir),
        modules=["layers.4"],
    )
    assert ds.tokens.shape == (12, 9)
    records = list(ds)
    by_latent = {}
    for ex, pos, lat, a in want:
        by_latent.setdefault(lat, []).append(a)
    assert {r.latent.latent_index for r in records} == {lat for lat, v in by_latent.items() if v}
    for r in records:
        assert r.per_token_frequency == pytest.approx(len(by_latent[r.latent.latent_index]) / (12 * 9))
        top = max(float(e.activations.max()) for e in r.train)
        assert top == pytest.approx(max(by_latent[r.latent.latent_index]), rel=1e-3)


def test_delphi_writer_files_hold_the_reference_scatter_of_every_call(tmp_path):
    """The split files, written as calls arrive (two calls here), hold what the numpy
    reference scatter gives for each call, in call order; safetensors reads them; the side
    files are gone."""
    from safetensors.numpy import load_file

    from actstore.features.exports.delphi import DelphiWriter, _scatter_py

    rng = np.random.default_rng(3)
    n = 5000
    calls = [
        [rng.integers(0, 50, n), rng.integers(0, 30, n), rng.integers(0, 1000, n), rng.random(n).astype(np.float32)]
        for _ in range(2)
    ]
    w = DelphiWriter(tmp_path / "d", 1000, 50, 30, n_splits=4)
    for args in calls:
        w.add(*args)
    tokens = rng.integers(0, 49152, (50, 30)).astype(np.int32)
    paths = w.finish(tokens)
    assert [p.name for p in paths] == [
        "0_249.safetensors",
        "250_499.safetensors",
        "500_749.safetensors",
        "750_999.safetensors",
    ]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(p.name for p in paths)
    want_loc: list[list[np.ndarray]] = [[] for _ in range(4)]
    want_act: list[list[np.ndarray]] = [[] for _ in range(4)]
    for example, position, latent, value in calls:
        loc = np.empty((4, n, 3), np.uint16)
        act = np.empty((4, n), np.uint16)
        counts = np.zeros(4, np.int64)
        bits = value.astype(np.float16).view(np.uint16)  # numpy's own cast, not dtypes'
        _scatter_py(example, position, latent, bits, w.split_of, w.bounds, loc, act, counts)
        for i, c in enumerate(counts.tolist()):
            want_loc[i].append(loc[i, :c])
            want_act[i].append(act[i, :c])
    for i, path in enumerate(paths):
        got = load_file(path)
        assert got["locations"].dtype == np.uint16 and got["activations"].dtype == np.float16
        np.testing.assert_array_equal(got["locations"], np.concatenate(want_loc[i]))
        np.testing.assert_array_equal(got["activations"].view(np.uint16), np.concatenate(want_act[i]))
        np.testing.assert_array_equal(got["tokens"], tokens)
        assert (got["locations"][:, 2] < 250).all()  # latents relative to their split's start
    assert w.n_nonzero == 2 * n


def test_delphi_float16_cast_is_numpys_for_every_kind_of_float32():
    """The scatter's float32 -> float16 cast (dtypes.f32_to_f16, then the compiled loop) gives
    numpy's bits: zeros, subnormals of both formats, the halfway cases of rounding to even,
    overflow to infinity, NaN."""
    from actstore.features.exports.delphi import _scatter, _scatter_compiled

    assert _scatter_compiled is not None  # numba is a dependency of the views
    rng = np.random.default_rng(5)
    bits = np.concatenate(
        [
            rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32),  # every exponent
            (rng.integers(0x30000000, 0x48000000, 1_000_000, dtype=np.uint64) & ~np.uint64(0xFFF)).astype(np.uint32)
            | np.uint32(0x1000),  # exact halfway cases near float16's range
            np.arange(0x38000000 - 4096, 0x38000000 + 4096, dtype=np.uint32),  # the subnormal edge
            np.arange(0x477FE000, 0x47801000, dtype=np.uint32),  # the overflow edge
            np.array(
                [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x33000000, 0x33000001], np.uint32
            ),
        ]
    )
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    value = bits.view(np.float32)
    n = len(value)
    loc = np.empty((1, n, 3), np.uint32)
    act = np.empty((1, n), np.uint16)
    counts = np.zeros(1, np.int64)
    zeros = np.zeros(n, np.int64)
    _scatter(zeros, zeros, zeros, value, np.zeros(1, np.int32), np.array([0, 1]), loc, act, counts)
    with np.errstate(over="ignore", invalid="ignore"):
        want = value.astype(np.float16).view(np.uint16)
    nan = np.isnan(value)
    np.testing.assert_array_equal(act[0][~nan], want[~nan])
    assert np.isnan(act[0][nan].view(np.float16)).all()
    assert counts.tolist() == [n]
