"""top_activations against a brute-force numpy oracle: random stores of several writer
shards, padded segments, token-label masks, both layouts, local and S3 (moto); ties broken
by (example, token); statistics, histograms and interval samples; deterministic output."""

from __future__ import annotations

import numpy as np
import pytest
from feature_stores import D, make_store, oracle_tokens

import actstore
from actstore.errors import EncoderError, FeatureError, LayerNotFoundError
from actstore.features import top_activations
from actstore.features.encoders.encoder import Encoder, neurons
from actstore.features.topk.accum import HIST_EDGES, N_BINS, hash_keys, order_keys

NUMBA = pytest.param("numba", marks=pytest.mark.dev)  # the compiled kernel: numba comes with the views extra


def oracle_top(ex, tok, A, k):
    """Per feature: the k largest positive values, ties by (example, token)."""
    out = []
    for f in range(A.shape[1]):
        v = A[:, f]
        idx = [i for i in np.lexsort((tok, ex, -v)) if v[i] > 0][:k]
        out += [(f, r, ex[i], tok[i], v[i]) for r, i in enumerate(idx)]
    return out


def check_against_oracle(store, layer, enc, k, **kw):
    t = top_activations(store, layer, enc, k=k, **kw)
    ex, tok, X = oracle_tokens(store, layer, keep_special=kw.get("keep_special", False), segments=kw.get("segments"))
    A = enc.encode(X)
    want = oracle_top(ex, tok, A, k)
    got = list(zip(t.top["feature"], t.top["rank"], t.top["example"], t.top["token"], t.top["activation"]))
    assert [g[:4] for g in got] == [w[:4] for w in want]
    np.testing.assert_array_equal([g[4] for g in got], np.array([w[4] for w in want], np.float32))
    f = t.features
    np.testing.assert_array_equal(f["max"], A.max(axis=0))
    np.testing.assert_array_equal(f["n_active"], (A > 0).sum(axis=0))
    np.testing.assert_allclose(f["density"], (A > 0).mean(axis=0))
    pos_mean = [A[:, j][A[:, j] > 0].mean() if (A[:, j] > 0).any() else 0 for j in range(A.shape[1])]
    np.testing.assert_allclose(f["mean_active"], pos_mean, rtol=1e-5)
    for j in range(A.shape[1]):
        v = A[:, j][A[:, j] > 0]
        np.testing.assert_array_equal(
            f["histogram"][j], np.bincount(np.searchsorted(HIST_EDGES, v, side="right"), minlength=N_BINS)
        )
    assert f["n_tokens"][0] == len(ex)
    return t, (ex, tok, A)


@pytest.mark.parametrize("kernel", [NUMBA, "numpy"])
@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_neurons_match_the_oracle(tmp_path, zarr_format, dtype, kernel):
    store = make_store(tmp_path / "s", zarr_format=zarr_format, dtype=dtype)
    t, _ = check_against_oracle(store, 2, neurons(D), k=4, batch_elements=5 * D, kernel=kernel)  # batches of 5 tokens
    assert len(t.top["feature"]) == 4 * D  # enough positive tokens for every neuron


@pytest.mark.parametrize("kernel", [NUMBA, "numpy"])
def test_ties_are_broken_by_example_then_token(tmp_path, kernel):
    store = make_store(tmp_path / "s", ties=True, seed=3)
    t, (ex, tok, A) = check_against_oracle(store, 0, neurons(D), k=6, batch_elements=3 * D, kernel=kernel)
    assert len(np.unique(t.top["activation"])) < len(t.top["activation"])  # the test has ties to break


@pytest.mark.parametrize(
    "device,kernel",
    [
        (None, "numpy"),
        pytest.param("auto", "numba", marks=pytest.mark.dev),
        pytest.param(None, "numba", marks=pytest.mark.dev),
    ],
)  # torch encode on CPU
def test_special_tokens_segments_and_a_directions_encoder(tmp_path, device, kernel):
    store = make_store(tmp_path / "s", seed=5)
    rng = np.random.default_rng(1)
    # small integer weights: float16 inputs give exact sums in any order, so batching cannot change a value
    enc = Encoder(
        kind="directions",
        d_in=D,
        n_features=11,
        W=rng.integers(-2, 3, (D, 11)).astype(np.float32),
        b=(rng.integers(-4, 5, 11) / 4).astype(np.float32),
    )
    check_against_oracle(store, 0, enc, k=3, keep_special=True, batch_elements=64, device=device, kernel=kernel)
    check_against_oracle(store, 0, enc, k=3, segments=["response"], batch_elements=1000, device=device, kernel=kernel)
    a = top_activations(store, 0, enc, k=3, segments=["response", "prompt"], device=device)  # any order: the store's
    b = top_activations(store, 0, enc, k=3, device=device)
    for c in a.top:
        np.testing.assert_array_equal(a.top[c], b.top[c])
    # a feature subset gives those features' rows, numbered as in the encoder
    t = top_activations(store, 0, enc, k=3, features="2-4,9")
    full = top_activations(store, 0, enc, k=3)
    keep = np.isin(full.top["feature"], [2, 3, 4, 9])
    for c in ("feature", "rank", "example", "token", "activation"):
        np.testing.assert_array_equal(t.top[c], full.top[c][keep])


@pytest.mark.parametrize("kernel", [NUMBA, "numpy"])
def test_interval_samples_are_uniform_draws_from_each_interval(tmp_path, kernel):
    store = make_store(tmp_path / "s", per_shard=20, seed=7)
    kw = dict(k=5, n_intervals=4, per_interval=3, pool=6, seed=11, kernel=kernel)
    t, (ex, tok, A) = check_against_oracle(store, 2, neurons(D), **kw)
    iv = t.intervals
    ords = order_keys(ex, tok)
    key = hash_keys(ords, 11)
    assert len(iv["feature"]) > 0 and iv["exact"].any()
    for f in range(D):
        m = A[:, f].max()
        for i in range(4):
            lo, hi = np.float32(m * i / 4), np.float32(m * (i + 1) / 4)
            rows = np.flatnonzero((iv["feature"] == f) & (iv["interval"] == i))
            members = np.flatnonzero((A[:, f] > m * i / 4) & (A[:, f] <= m * (i + 1) / 4))
            if not len(rows):  # nothing of it reached the pool: only when the pool could not hold every active token
                assert not len(members) or (A[:, f] > 0).sum() > 6
                continue
            assert len(set(iv["exact"][rows])) == 1
            assert len(rows) == min(3, len(members)) or not iv["exact"][rows[0]]
            for r in rows:
                assert lo <= iv["activation"][r] <= hi
            if len(rows) and iv["exact"][rows[0]]:  # exact: the 3 smallest (key, ord) of the interval
                want = members[np.lexsort((ords[members], key[members]))[:3]]
                assert list(zip(iv["example"][rows], iv["token"][rows])) == list(zip(ex[want], tok[want]))


def test_same_call_same_tables(tmp_path):
    store = make_store(tmp_path / "s")
    a = top_activations(store, 0, neurons(D), k=3, batch_elements=7 * D)
    b = top_activations(store, 0, neurons(D), k=3, batch_elements=1000 * D)  # other batching, same answer
    for table in ("top", "features", "intervals"):
        for c in getattr(a, table):
            np.testing.assert_array_equal(getattr(a, table)[c], getattr(b, table)[c])


def test_s3_store_matches_the_oracle(tmp_path, s3_url):
    make_store(s3_url, zarr_format=3)
    store = actstore.open(s3_url)
    check_against_oracle(store, 2, neurons(D), k=4)


def test_bad_inputs_are_refused_before_the_pass(tmp_path):
    store = make_store(tmp_path / "s", n_shards=1)
    for k in (0, -1, 10**9, 2.5, True):
        with pytest.raises(FeatureError, match="--top-k must be an int"):
            top_activations(store, 0, neurons(D), k=k)
    with pytest.raises(EncoderError, match="takes d_in=9 but layer 0 .* has d_model=8"):
        top_activations(store, 0, neurons(9))
    with pytest.raises(LayerNotFoundError, match=r"layer 5 is not stored; this store holds layers \[0, 2\]"):
        top_activations(store, 5, neurons(D))
    with pytest.raises(FeatureError, match="features must be ids in 0..7"):
        top_activations(store, 0, neurons(D), features="3-8")
    with pytest.raises(FeatureError, match="--features takes ids and ranges"):
        top_activations(store, 0, neurons(D), features="a-b")
