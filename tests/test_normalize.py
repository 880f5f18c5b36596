"""actstore.read.normalize: normalisation from a store's statistics, in one home, checked
against the statistics' own arithmetic, and its errors (StatisticsError, a ValueError)."""

from __future__ import annotations

import numpy as np
import pytest
from factory import plain_vit_store

from actstore.errors import StatisticsError
from actstore.read.normalize import NORM_EPS, VAR_EPS, norm_tables, normalization


def test_normalization_and_the_tables_follow_the_statistics(tmp_path):
    store = plain_vit_store(tmp_path / "s", n=10, d=4, layers=(0, 3))
    st = store.stats()
    vecs = np.concatenate([store[i, 3] for i in range(10)]).astype(np.float64)  # every token of layer 3
    n = normalization(store, 3)
    assert n.count == len(vecs) == 50
    np.testing.assert_allclose(n.mean, vecs.mean(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(n.std, vecs.std(0), rtol=1e-6)
    assert n.mean_norm == pytest.approx(np.linalg.norm(vecs, axis=1).mean(), rel=1e-6)
    assert normalization(tmp_path / "s", 3).count == 50  # a path opens the store
    shift, scale = norm_tables(store, [0, 3], ["tokens"], "standardize")
    k = st.keys.index("layer3/tokens")
    np.testing.assert_allclose(shift[1], st.mean[k], rtol=1e-6)
    np.testing.assert_allclose(scale[1], 1 / np.sqrt(st.m2[k] / st.count[k] + VAR_EPS), rtol=1e-6)
    shift, scale = norm_tables(store, [3], ["tokens"], "scale")
    assert not shift.any() and scale[0] == pytest.approx(np.full(4, 2.0 / max(n.mean_norm, NORM_EPS)), rel=1e-6)


def test_missing_statistics_are_one_clear_error(tmp_path):
    bare = plain_vit_store(tmp_path / "bare", stats=False)
    with pytest.raises(
        StatisticsError, match=r"normalization\(\) needs the store's statistics, but this store kept none"
    ):
        normalization(bare, 0)
    store = plain_vit_store(tmp_path / "s")
    with pytest.raises(
        ValueError, match=r"the store's statistics lack 'layer7/tokens'; they hold \['layer0/tokens', 'layer1/tokens'\]"
    ):
        normalization(store, 7)
    with pytest.raises(
        StatisticsError, match=r"normalize must be one of \[None, 'standardize', 'scale'\]. Got 'zscore'."
    ):
        norm_tables(store, [0], ["tokens"], "zscore")
