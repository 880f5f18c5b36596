"""The default saev budget fits the data (issue 23 item 8): every acts*.bin file holds
data, not gigabytes of zero padding (a 32 MB store exported as 5.5 GB apparent size), while
every shard file keeps the full shape saev's readers memory-map."""

from __future__ import annotations

import os

from factory import vit_store
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.layout import saevspec as P
from actstore.saev import export_saev, verify_saev
from actstore.saev.plan import fitted_budget


def test_a_small_store_exports_files_the_size_of_its_data(tmp_path):
    store = vit_store(tmp_path / "s", n=13, tokens=5, layers=(2, 5), d_model=8)
    res = export_saev(store, tmp_path / "d", progress=False)
    files = sorted(res.path.glob("acts*.bin"))
    example_bytes = 2 * 5 * 8 * 4  # layers x tokens x d_model x float32
    assert [os.path.getsize(f) for f in files] == [13 * example_bytes]
    assert res.metadata["patches_per_shard"] == 13 * 5 * 2 and verify_saev(res.path).problems == []
    given_budget = export_saev(
        store, tmp_path / "e", patches_per_shard=P.DEFAULT_BUDGET, progress=False
    )  # an explicit budget is kept
    assert given_budget.metadata["patches_per_shard"] == P.DEFAULT_BUDGET


@settings(deadline=None)
@given(st.integers(1, 10**7), st.integers(1, 5000))
def test_the_fitted_budget_keeps_the_shard_count_and_leaves_little_padding(n, per_example):
    cap = P.DEFAULT_BUDGET
    budget = fitted_budget(n, per_example, cap)
    eps = budget // per_example
    shards = -(-n // eps)
    assert budget % per_example == 0 and eps >= 1
    if per_example <= cap:
        assert budget <= cap and shards == -(-n // (cap // per_example))  # no more shards than the cap gives
    assert shards * eps - n < shards  # padding: less than one example per shard
