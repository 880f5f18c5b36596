"""The compiled per-batch updates (actstore.features.topk.kernel, kernel16) against the numpy
reference update (FeatureAccumulator with kernel="numpy") on the same batches: the same
top k, pools, counts, histograms and max; sums equal to rounding. Float32 batches (encoded
features, bfloat16 / float32 stores) and float16 rows read in place (neurons of a float16
store), with the values that take the rare branches: ties, zeros, negative zeros,
subnormals, infinities, NaN, features that are never positive."""

from __future__ import annotations

import numpy as np
import pytest
from factory import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.features.topk.accum import FeatureAccumulator
from actstore.features.topk.kernel16 import sort_key

pytestmark = pytest.mark.dev  # numba's compiled kernel against the numpy reference

SPECIAL16 = np.array([0.0, -0.0, 6e-8, 3e-5, -3e-5, 6.1e-5, 65504, np.inf, -np.inf, np.nan, 1.0, 1.0, 0.5], np.float16)


def state(acc: FeatureAccumulator) -> dict[str, np.ndarray]:
    acc.finish()
    names = ("max", "n_pos", "sum_pos", "hist", "top_val", "top_ord", "pool_key", "pool_val", "pool_ord", "n_tokens")
    return {n: np.asarray(getattr(acc, n)) for n in names}


def assert_same(a: dict, b: dict) -> None:
    for name in a:
        if name == "sum_pos":
            np.testing.assert_allclose(a[name], b[name], rtol=1e-9, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def run(kernel: str, batches, *, k: int, pool: int, F: int, clipped: bool = False) -> dict:
    acc = FeatureAccumulator(F, k, pool, seed=3, kernel=kernel)
    start = 0
    for x, cols in batches:  # x: (N, F) token-major rows; cols: the tokens' rows (None: all)
        n = len(x) if cols is None else len(cols)
        ords = np.arange(start, start + n, dtype=np.int64) * 7 + 1  # increasing, not contiguous
        start += n
        if kernel == "numpy" and clipped:
            xx = x if cols is None else x[cols]
            acc.update(np.maximum(xx.T.astype(np.float32), 0), ords)
        elif x.dtype == np.float16 and kernel == "numba":
            acc.update(x.T, ords, cols)  # the stored rows, read in place
        else:
            xx = x if cols is None else x[cols]
            acc.update(np.ascontiguousarray(xx.T, np.float32), ords, clipped=clipped)
    return state(acc)


def random_batches(rng, dtype, F, sizes, special=0.0, sparse=False):
    out = []
    for n in sizes:
        x = rng.standard_normal((n + 3, F)).astype(np.float32)
        if sparse:
            x -= 2
        x = np.round(x * 4) / 4 if rng.random() < 0.5 else x  # ties, sometimes
        x = x.astype(dtype)
        if special:
            hit = rng.random(x.shape) < special
            x[hit] = rng.choice(SPECIAL16, hit.sum()).astype(dtype)
        x[:, 0] = -np.abs(x[:, 0]) if F > 1 else x[:, 0]  # feature 0 is never positive
        cols = np.sort(rng.choice(n + 3, n, replace=False))  # rows of a read buffer: padding left out
        out.append((x, cols))
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("pool", [0, 5])
def test_compiled_update_is_the_reference(dtype, pool):
    rng = np.random.default_rng(0)
    batches = random_batches(rng, dtype, 70, [1, 300, 4200, 17, 5000], special=0.01)
    assert_same(run("numba", batches, k=4, pool=pool, F=70), run("numpy", batches, k=4, pool=pool, F=70))


def test_relu_input_read_as_its_output():
    """clipped: the pre-activations of a ReLU stand for their ReLU (no ReLU pass)."""
    rng = np.random.default_rng(1)
    batches = random_batches(rng, np.float32, 40, [500, 900], sparse=True)
    got = run("numba", batches, k=3, pool=4, F=40, clipped=True)
    assert_same(got, run("numpy", batches, k=3, pool=4, F=40, clipped=True))
    assert got["max"][0] == 0  # a feature never positive: its max is the ReLU's, 0


def test_results_do_not_depend_on_threads_or_batch_cuts(monkeypatch):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6000, 100)).astype(np.float16)
    whole = [(x, None)]
    cut = [(x[:1234], None), (x[1234:1300], None), (x[1300:], None)]
    results = []
    for threads in ("1", "3"):
        monkeypatch.setenv("ACTSTORE_FEATURE_THREADS", threads)
        results += [run("numba", whole, k=5, pool=8, F=100), run("numba", cut, k=5, pool=8, F=100)]
    for r in results[1:]:
        assert_same(results[0], r)


@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**31),
    F=st.integers(1, 40),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    k=st.integers(1, 9),
    pool=st.integers(0, 6),
    f16=st.booleans(),
)
def test_property_compiled_equals_reference(seed, F, sizes, k, pool, f16):
    rng = np.random.default_rng(seed)
    batches = random_batches(rng, np.float16 if f16 else np.float32, F, sizes, special=0.05)
    assert_same(run("numba", batches, k=k, pool=pool, F=F), run("numpy", batches, k=k, pool=pool, F=F))


def test_float16_order_keys_sort_as_the_values():
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    v = u.view(np.float16).astype(np.float64)
    ok = ~np.isnan(v)
    key = sort_key(u)
    assert len(np.unique(key)) == 1 << 16  # one key a bit pattern
    order = np.argsort(key[ok], kind="stable")
    assert np.all(np.diff(v[ok][order]) >= 0)  # keys sort as the values (-0 just below +0)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be 'auto', 'numba' or 'numpy'"):
        FeatureAccumulator(3, 2, 0, 0, kernel="cuda")


def test_a_bad_thread_count_is_refused(monkeypatch):
    from actstore.errors import FeatureError

    monkeypatch.setenv("ACTSTORE_FEATURE_THREADS", "two")
    acc = FeatureAccumulator(4, 2, 0, 0, kernel="numba")
    with pytest.raises(FeatureError, match="ACTSTORE_FEATURE_THREADS must be a whole number >= 1. Got 'two'"):
        acc.update(np.ones((4, 1 << 17), np.float32), np.arange(1 << 17, dtype=np.int64))
