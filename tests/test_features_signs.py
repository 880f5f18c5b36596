"""Both tails (`sign`) and the torch update (`kernel="torch"`, the device pass, run here on
torch's CPU device) against the brute-force oracle of test_features_topk and against the
numba and numpy updates: the same tables, ties included."""

from __future__ import annotations

import numpy as np
import pytest
from feature_stores import D, make_store, oracle_tokens

from actstore.errors import FeatureError
from actstore.features import top_activations
from actstore.features.encoders.encoder import Encoder, neurons
from actstore.features.topk.accum import HIST_EDGES, N_BINS, hash_keys, order_keys

pytestmark = pytest.mark.torch  # the torch update against the numba one

KERNELS = ["numba", "numpy", "torch"]


def oracle_tail(ex, tok, A, k, sign):
    """Per feature: the k values of largest magnitude on one side, ties by (example, token)."""
    out = []
    for f in range(A.shape[1]):
        v = A[:, f] * sign
        idx = [i for i in np.lexsort((tok, ex, -v)) if v[i] > 0][:k]
        out += [(f, sign, r, ex[i], tok[i], A[i, f]) for r, i in enumerate(idx)]
    return out


def hist(v):
    return np.bincount(np.searchsorted(HIST_EDGES, v, side="right"), minlength=N_BINS)


def check(store, layer, enc, k, sign, **kw):
    t = top_activations(store, layer, enc, k=k, sign=sign, **kw)
    ex, tok, X = oracle_tokens(store, layer, keep_special=kw.get("keep_special", False))
    A = enc.encode(X)
    want = []
    for s in (1,) if sign == "positive" else (-1,) if sign == "negative" else (1, -1):
        want += oracle_tail(ex, tok, A, k, s)
    want.sort(key=lambda w: (w[0], -w[1], w[2]))
    cols = ("feature", "sign", "rank", "example", "token", "activation")
    got = list(zip(*(t.top[c] for c in cols)))
    assert [g[:5] for g in got] == [w[:5] for w in want]
    np.testing.assert_array_equal(t.top["activation"], np.array([w[5] for w in want], np.float32))
    assert t.top["sign"].dtype == np.int8 and t.intervals["sign"].dtype == np.int8
    f = t.features
    np.testing.assert_array_equal(f["max"], A.max(axis=0))  # the positive side, whatever the sign
    np.testing.assert_array_equal(f["n_active"], (A > 0).sum(axis=0))
    for j in range(A.shape[1]):
        np.testing.assert_array_equal(f["histogram"][j], hist(A[:, j][A[:, j] > 0]))
    if sign == "positive":
        assert "min" not in f and "histogram_negative" not in f
    else:
        np.testing.assert_array_equal(f["min"], A.min(axis=0))
        np.testing.assert_array_equal(f["n_negative"], (A < 0).sum(axis=0))
        np.testing.assert_allclose(f["density_negative"], (A < 0).mean(axis=0))
        neg_mean = [A[:, j][A[:, j] < 0].mean() if (A[:, j] < 0).any() else 0 for j in range(A.shape[1])]
        np.testing.assert_allclose(f["mean_negative"], neg_mean, rtol=1e-5)
        for j in range(A.shape[1]):
            np.testing.assert_array_equal(f["histogram_negative"][j], hist(-A[:, j][A[:, j] < 0]))
    return t, (ex, tok, A)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sign", ["positive", "negative", "both"])
def test_neurons_both_tails_match_the_oracle(tmp_path, kernel, sign):
    store = make_store(tmp_path / "s", zarr_format=3, dtype="float16")
    t, _ = check(store, 2, neurons(D), 4, sign, batch_elements=5 * D, kernel=kernel)
    assert set(t.top["sign"]) == ({1} if sign == "positive" else {-1} if sign == "negative" else {1, -1})


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_torch_update_reads_every_stored_dtype(tmp_path, kernel, dtype):
    store = make_store(tmp_path / "s", zarr_format=2, dtype=dtype, seed=4)
    check(store, 0, neurons(D), 3, "both", batch_elements=7 * D, kernel=kernel, keep_special=True)


@pytest.mark.parametrize("kernel", KERNELS)
def test_ties_in_both_tails_go_by_example_then_token(tmp_path, kernel):
    store = make_store(tmp_path / "s", ties=True, seed=3)
    t, _ = check(store, 0, neurons(D), 6, "both", batch_elements=3 * D, kernel=kernel)
    for s in (1, -1):
        vals = t.top["activation"][t.top["sign"] == s]
        assert len(np.unique(vals)) < len(vals)  # the test has ties to break on both sides


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_signed_directions_encoder_and_intervals_of_both_tails(tmp_path, kernel):
    store = make_store(tmp_path / "s", per_shard=20, seed=7)
    rng = np.random.default_rng(1)
    enc = Encoder(
        kind="directions",  # small integer weights: exact sums in any order
        d_in=D,
        n_features=5,
        W=rng.integers(-2, 3, (D, 5)).astype(np.float32),
        b=(rng.integers(-4, 5, 5) / 4).astype(np.float32),
    )
    kw = dict(n_intervals=4, per_interval=3, pool=6, seed=11, kernel=kernel, batch_elements=50)
    t, (ex, tok, A) = check(store, 2, enc, 5, "both", **kw)
    iv = t.intervals
    ords = order_keys(ex, tok)
    key = hash_keys(ords, 11)
    assert set(iv["sign"]) == {1, -1} and iv["exact"].any()
    for f in range(5):
        m = -A[:, f].min()
        for i in range(4):
            rows = np.flatnonzero((iv["feature"] == f) & (iv["interval"] == i) & (iv["sign"] == -1))
            lo, hi = np.float32(-m * (i + 1) / 4), np.float32(-m * i / 4)
            members = np.flatnonzero((A[:, f] >= -m * (i + 1) / 4) & (A[:, f] < -m * i / 4))
            for r in rows:
                assert iv["lo"][r] == lo and iv["hi"][r] == hi and lo <= iv["activation"][r] < hi
            if len(rows) and iv["exact"][rows[0]]:  # exact: the 3 smallest (key, ord) of the interval
                want = members[np.lexsort((ords[members], key[members]))[:3]]
                assert list(zip(iv["example"][rows], iv["token"][rows])) == list(zip(ex[want], tok[want]))


@pytest.mark.parametrize("sign", ["positive", "both"])
def test_the_torch_update_gives_the_cpu_paths_tables(tmp_path, sign):
    """Float weights (not exact in float32): the same encode, so the same tables, to the bit."""
    store = make_store(tmp_path / "s", per_shard=25, seed=9)
    rng = np.random.default_rng(2)
    enc = Encoder(
        kind="saelens",
        d_in=D,
        n_features=40,
        W=rng.standard_normal((D, 40)).astype(np.float32),
        b=rng.standard_normal(40).astype(np.float32) - 0.5,
        b_pre=rng.standard_normal(D).astype(np.float32) / 4,
        activation="jumprelu",
        threshold=np.float32(0.3),
    )
    kw = dict(k=7, sign=sign, seed=5, n_intervals=3, per_interval=2, batch_elements=40 * 9, device="cpu")
    a = top_activations(store, 0, enc, kernel="torch", **kw)
    b = top_activations(store, 0, enc, kernel="numba", **kw)
    for table in ("top", "features", "intervals"):
        ta, tb = getattr(a, table), getattr(b, table)
        assert sorted(ta) == sorted(tb)
        for c in ta:
            if c in ("mean_active", "mean_negative"):  # float64 sums in another order: the last bits
                np.testing.assert_allclose(ta[c], tb[c], rtol=1e-6)
            else:
                np.testing.assert_array_equal(ta[c], tb[c], err_msg=f"{table}.{c}")
    assert len(a.top["feature"]) > 40 and len(a.intervals["feature"]) > 40


def test_bad_sign_and_kernel_are_refused(tmp_path):
    store = make_store(tmp_path / "s", n_shards=1)
    with pytest.raises(FeatureError, match=r"--sign must be one of \['positive', 'negative', 'both'\]. Got 'up'"):
        top_activations(store, 0, neurons(D), sign="up")
    with pytest.raises(FeatureError, match=r"kernel must be one of \['auto', 'numba', 'numpy', 'torch'\]. Got 'cuda'"):
        top_activations(store, 0, neurons(D), kernel="cuda")
    with pytest.raises(FeatureError, match="kernel='torch' needs torch: pass device='cpu' or 'cuda'"):
        top_activations(store, 0, neurons(D), kernel="torch", device=None)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_mapped_and_read_groups_give_the_same_tables(tmp_path, zarr_format):
    from actstore.features.topk.groups import GroupReader

    store = make_store(tmp_path / "s", zarr_format=zarr_format, per_shard=12, seed=6)
    assert GroupReader(store, 2, None, False).region is not None  # this store's files can be mapped
    enc = Encoder(kind="directions", d_in=D, n_features=6, W=np.eye(D, 6, dtype=np.float32))
    for e in (neurons(D), enc):
        a = top_activations(store, 2, e, k=4, sign="both", mmap=True)
        b = top_activations(store, 2, e, k=4, sign="both", mmap=False)
        for table in ("top", "features", "intervals"):
            for c in getattr(a, table):
                np.testing.assert_array_equal(getattr(a, table)[c], getattr(b, table)[c])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_device_groups_hold_the_read_groups_rows(tmp_path, dtype, monkeypatch):
    """The torch pass's groups (reused buffers, through hostmem's HostBuffer; no device copy on
    torch's CPU device) hold the same rows as the numpy reader's, group after group."""
    import torch

    from actstore.features.topk import groups as G

    store = make_store(tmp_path / "s", dtype=dtype, per_shard=7, seed=4)
    t_all = G.GroupReader(store, 2, None, False, mmap=False).t_all  # rows of one example's block
    monkeypatch.setattr(G, "READ_BYTES", 5 * t_all * D * 2)  # groups of 5 examples: the ring of 3 goes round
    on_torch = G.GroupReader(store, 2, None, False, device=torch.device("cpu"))
    on_host = G.GroupReader(store, 2, None, False, mmap=False)
    assert on_torch.copy is None and on_torch.group == 5
    seen = []
    for (ex_t, flat_t, rows_t, ords_t), (ex_h, flat_h, rows_h, ords_h) in zip(on_torch, on_host, strict=True):
        assert ex_t == ex_h and np.array_equal(rows_t, rows_h) and np.array_equal(ords_t, ords_h)
        np.testing.assert_array_equal(flat_t.float().numpy()[rows_t], np.asarray(flat_h, np.float32)[rows_h])
        seen.append(flat_t.untyped_storage().data_ptr())
    assert len(seen) == 5 and seen[:2] == seen[3:] and len(set(seen)) == 3  # 21 examples: 5 groups on 3 buffers
