"""PairDataset and PairBatchSampler: b random examples x k random layers, padded tensors
equal to the store's slices, under DataLoaders with 0, 2 and 8 workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factory import examples
from factory import pairs_store as qa_store
from factory import plain_vit_store as vit_store
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_checks import check_batch

from actstore.torch import PairBatchSampler, PairDataset, PairIndex


def test_batch_equals_store_slices(tmp_path):
    store = qa_store(tmp_path / "s")  # prompt t_max 9 in chunks of 4 (padded read), response 4
    ds = PairDataset(store, return_mask=True)
    seen = 0
    for batch in ds.loader(batch_size=4, k=2, seed=5):
        check_batch(store, ds, batch)
        assert batch["acts"].dtype == torch.float16
        seen += len(batch["examples"])
    assert seen == len(store)


def test_sampler_epoch_is_a_permutation_with_distinct_sorted_layers():
    smp = PairBatchSampler(23, layers=[3, 6, 9, 12], batch_size=5, k=3, seed=1)
    batches = list(smp)
    assert len(batches) == len(smp) == 5
    exs = np.concatenate([b.examples for b in batches])
    assert sorted(exs.tolist()) == list(range(23)) and exs.tolist() != list(range(23))
    for b in batches:
        assert b.layers.shape == (len(b.examples), 3)
        assert all(len(set(r)) == 3 and list(r) == sorted(r) for r in b.layers.tolist())
        assert set(b.layers.reshape(-1).tolist()) <= {3, 6, 9, 12}
    again = list(PairBatchSampler(23, layers=[3, 6, 9, 12], batch_size=5, k=3, seed=1))
    assert all((a.examples == b.examples).all() and (a.layers == b.layers).all() for a, b in zip(batches, again))
    other = PairBatchSampler(23, layers=[3, 6, 9, 12], batch_size=5, k=3, seed=1)
    other.set_epoch(1)
    assert np.concatenate([b.examples for b in other]).tolist() != exs.tolist()


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.integers(0, 50), world=st.integers(1, 4), b=st.integers(1, 9), drop_last=st.booleans(), seed=st.integers(0, 99)
)
def test_sampler_ranks_disjoint_and_complete(n, world, b, drop_last, seed):
    per_rank = []
    for rank in range(world):
        smp = PairBatchSampler(
            n, layers=[0, 1], batch_size=b, seed=seed, rank=rank, world_size=world, drop_last=drop_last
        )
        batches = list(smp)
        assert len(batches) == len(smp)
        per_rank.append(np.concatenate([x.examples for x in batches]).tolist() if batches else [])
        if drop_last:
            assert all(len(x.examples) == b for x in batches)
    flat = [e for r in per_rank for e in r]
    assert len(flat) == len(set(flat))
    if drop_last:
        assert len({len(r) for r in per_rank}) == 1 and n - len(flat) < world * b + world
    else:
        assert sorted(flat) == list(range(n))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2, 8])
def test_dataloader_workers_give_the_same_batches(tmp_path, num_workers):
    store = vit_store(tmp_path / "s", n=16, layers=(0, 1, 2))
    ds = PairDataset(store)
    direct = [{k: v.clone() for k, v in ds[idx].items()} for idx in ds.sampler(batch_size=3, seed=2)]
    got = list(ds.loader(batch_size=3, seed=2, num_workers=num_workers, multiprocessing_context="fork"))
    assert len(got) == len(direct) == 6
    for a, b in zip(got, direct):
        assert all(torch.equal(a[k], b[k]) for k in ("acts", "lengths", "examples", "layers"))
        check_batch(store, ds, a)


def test_main_process_reuses_buffers_only_when_dropped(tmp_path):
    store = vit_store(tmp_path / "s")
    ds = PairDataset(store, n_buffers=2)
    idx = [PairIndex(np.array([i, i + 1]), np.array([[0, 1], [0, 1]])) for i in range(4)]
    first = ds[idx[0]]["acts"]
    kept = first.clone()
    second = ds[idx[1]]["acts"]
    third = ds[idx[2]]["acts"]  # slot of `first`, which is still held: a new buffer
    assert torch.equal(first, kept) and len({first.data_ptr(), second.data_ptr(), third.data_ptr()}) == 3
    ptr = second.data_ptr()
    del second
    fourth = ds[idx[3]]["acts"]  # slot of `second`, dropped: reused
    assert fourth.data_ptr() == ptr
    check_batch(
        store,
        ds,
        {
            "acts": fourth,
            "layers": torch.from_numpy(idx[3].layers),
            "examples": torch.tensor([3, 4]),
            "lengths": torch.tensor([[5], [5]]),
        },
    )


def test_token_mask_in_mask(tmp_path):
    store = qa_store(tmp_path / "s")
    labels = store.field("response_token_labels")
    ds = PairDataset(store, segments=["response"], token_mask={"response": labels == 2}, return_mask=True)
    batch = ds[PairIndex(np.arange(6), np.full((6, 1), 5))]
    lens = store.field("response_len")[:6]
    want = (np.arange(4)[None] < lens[:, None]) & (labels[:6] == 2)
    assert batch["mask"].numpy().tolist() == want.tolist() and batch["acts"].shape == (6, 1, 4, 8)


def test_bad_input_has_clear_errors(tmp_path):
    store = vit_store(tmp_path / "s")
    ds = PairDataset(store)
    with pytest.raises(TypeError, match=r"PairDataset is indexed by whole batches, PairIndex\(examples, layers\)"):
        ds[3]
    with pytest.raises(ValueError, match=r"layers \[7\] are not among this dataset's layers \[0, 1\]"):
        ds[PairIndex(np.array([0]), np.array([[7]]))]
    with pytest.raises(IndexError, match=r"examples must lie in 0\.\.11; got 0\.\.12"):
        ds[PairIndex(np.array([0, 12]), np.array([[0], [1]]))]
    with pytest.raises(ValueError, match=r"k=3 layers per example, but only 2 layers to choose from: \[0, 1\]"):
        ds.sampler(k=3)
    with pytest.raises(ValueError, match=r"threads must be a positive int\. Got 0\."):
        PairDataset(store, threads=0)
