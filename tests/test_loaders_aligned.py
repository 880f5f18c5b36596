"""Aligned token streams (TokenStream.aligned(...)): row i of every source's tensor is
the same token, checked by token ids written into the vectors themselves, over whole
epochs, with DataLoader workers and resumed mid-epoch; two stores of two models; refused
when their tokens differ; per-source normalisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factory import examples, tagged_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
from actstore import ActStore, ShardWriter
from actstore.loaders.aligned import AlignedTokenStream, AlignmentError
from actstore.loaders.source import stats_tables
from actstore.torch import TokenStream

LAYERS = [2, 5, 9]
SEGS = {"prompt": 9, "response": 4}


def every_token(store):
    return sorted(
        (ex, si, t) for ex in range(len(store)) for si, name in enumerate(SEGS) for t in range(store.lengths(ex)[name])
    )


def check_aligned(store, batches, layers, widths=None):
    """Each batch: one tensor per source, row i the same token (id, example, segment,
    position) in all, each from its own layer; returns the tokens in order."""
    seen = []
    for b in batches:
        assert isinstance(b, tuple) and len(b) == len(layers)
        ref = b[0][:, [0, 2, 3, 4]]
        for k, t in enumerate(b):
            assert t.dtype == torch.float32 and t.shape[0] == ref.shape[0]
            if widths is not None:
                assert t.shape[1] == widths[k]
            assert torch.equal(t[:, [0, 2, 3, 4]], ref)
            assert torch.all(t[:, 1] == layers[k])
        for tid, ex, si, pos in ref.numpy().astype(np.int64):
            name = list(SEGS)[si]
            assert int(store.field(f"{name}_token_ids")[ex, pos]) == tid
            seen.append((int(ex), int(si), int(pos)))
    return seen


def test_one_store_three_layers_in_step_over_an_epoch(tmp_path):
    store = tagged_store(tmp_path / "s")
    ts = TokenStream.aligned(store, layers=LAYERS, batch_size=5, seed=1, buffer_bytes=5 * 3 * 24 * 2)
    assert isinstance(ts, AlignedTokenStream) and len(ts) == -(-len(every_token(store)) // 5)
    seen = check_aligned(store, list(ts), LAYERS)
    assert sorted(seen) == every_token(store) and seen != every_token(store)  # every token once, shuffled
    assert ts.epoch == 1
    # Values are exactly the store's.
    b = next(iter(TokenStream.aligned(store, layers=[5, 9], batch_size=4, return_index=True)))
    for i in range(4):
        ex, si, tok = int(b["example"][i]), int(b["segment"][i]), int(b["token"][i])
        at = (store.lengths(ex)["prompt"] if si == 1 else 0) + tok
        for k, layer in enumerate([5, 9]):
            np.testing.assert_array_equal(b["acts"][k][i].numpy(), np.asarray(store[ex, layer])[at])
    assert b["layer"].tolist() == [5, 9]


def test_stack_gives_one_tensor_and_same_order_as_the_tuple(tmp_path):
    store = tagged_store(tmp_path / "s")
    tup = list(TokenStream.aligned(store, layers=[9, 2], batch_size=6, seed=4))
    stk = list(TokenStream.aligned(store, layers=[9, 2], batch_size=6, seed=4, stack=True))
    assert len(tup) == len(stk)
    for a, b in zip(tup, stk):
        assert b.shape == (len(a[0]), 2, 6) and torch.equal(b[:, 0], a[0]) and torch.equal(b[:, 1], a[1])


def _run(make, num_workers, state=None, n=None):
    ts = make()
    loader = ts.loader(num_workers=num_workers, multiprocessing_context="fork")
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for b in loader:
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out, loader.state_dict()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_workers_and_mid_epoch_resume_keep_alignment(tmp_path, num_workers):
    store = tagged_store(tmp_path / "s")

    def make():
        return TokenStream.aligned(store, layers=LAYERS, batch_size=4, seed=2, buffer_bytes=4 * 3 * 24 * 2)

    full, end = _run(make, num_workers)
    assert end["epoch"] == 1 and end["batches_done"] == 0
    seen = check_aligned(store, full, LAYERS)
    assert sorted(seen) == every_token(store)
    for cut in (1, 5, len(full) - 1):
        head, state = _run(make, num_workers, n=cut)
        assert state["batches_done"] == cut and state["sources"] == [[str(store.path), x] for x in LAYERS]
        tail, _ = _run(make, num_workers, state=state)
        got = head + tail
        assert len(got) == len(full) and all(all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(got, full))


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 9),
    window=st.integers(1, 3),
    cut=st.integers(0, 40),
    seed=st.integers(0, 9),
    layers=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=3, unique=True),
    workers=st.sampled_from([0, 0, 2]),
)
def test_property_alignment_by_token_ids_whole_epoch_resumed(tmp_path, batch, window, cut, seed, layers, workers):
    path = tmp_path / "hyp"
    store = ActStore(path) if path.exists() else tagged_store(path)

    def make():
        return TokenStream.aligned(
            store,
            layers=layers,
            batch_size=batch,
            seed=seed,
            buffer_bytes=batch * len(layers) * 24 * window,
        )

    full, _ = _run(make, workers)
    cut = min(cut, len(full))
    head, state = _run(make, workers, n=cut) if cut else ([], None)
    tail, _ = _run(make, workers, state=state)
    seen = check_aligned(store, head + tail, layers)
    assert sorted(seen) == every_token(store)
    assert seen == check_aligned(store, full, layers)


@pytest.mark.parametrize("layout", [{}, {"zarr_format": 3, "shard_examples": 4}])
def test_two_stores_of_two_models_on_the_same_tokens(tmp_path, layout):
    a = tagged_store(tmp_path / "a", d=6, seed=1, **layout)
    b = tagged_store(tmp_path / "b", d=10, seed=2, layers=[0, 1], **layout)  # another model: other width and layers
    ts = TokenStream.aligned([a, b], layers=[[5], [0, 1]], batch_size=7, seed=3)
    batches = list(ts)
    seen = check_aligned(a, [tuple(x) for x in batches], [5, 0, 1], widths=[6, 10, 10])
    assert sorted(seen) == every_token(a)


def test_mismatched_token_ids_are_refused_naming_the_first(tmp_path):
    a = tagged_store(tmp_path / "a")
    b = tagged_store(tmp_path / "b", ids_seed=5)
    ids_a, ids_b = a.field("prompt_token_ids"), b.field("prompt_token_ids")
    within = np.arange(9)[None, :] < a.field("prompt_len")[:, None]
    ex, t = (int(v) for v in np.argwhere((ids_a != ids_b) & within)[0])
    with pytest.raises(AlignmentError) as e:
        TokenStream.aligned([a, b], layers=[2])
    assert str(e.value) == (
        f"example {ex}, segment 'prompt', token {t}: token id {ids_a[ex, t]} in {a.path} but "
        f"{ids_b[ex, t]} in {b.path}: aligned stores must be captured on the same tokens"
    )


def test_other_lengths_or_example_counts_are_refused(tmp_path):
    a = tagged_store(tmp_path / "a")
    c = tagged_store(tmp_path / "c", shards=1)
    with pytest.raises(
        AlignmentError, match=r"holds 7 examples, .* 14: aligned stores must be captured on the same inputs"
    ):
        TokenStream.aligned([a, c], layers=[2])
    with pytest.raises(ValueError, match="gives 1 lists for 2 stores"):
        TokenStream.aligned([a, a], layers=[[2]])
    with pytest.raises(ValueError, match="stack=True needs sources of one width"):
        TokenStream.aligned([a, tagged_store(tmp_path / "w", d=10)], layers=[2], stack=True)


def test_each_source_is_normalised_with_its_own_statistics(tmp_path):
    a = tagged_store(tmp_path / "a", scale=1.0)
    b = tagged_store(tmp_path / "b", scale=50.0, seed=9)
    raw = list(TokenStream.aligned([a, b], layers=[2, 9], batch_size=8, seed=5))
    nrm = list(TokenStream.aligned([a, b], layers=[2, 9], batch_size=8, seed=5, normalize="standardize"))
    segs = TokenStream(a, batch_size=8).segments
    tables = [stats_tables(s, (layer,), segs, "standardize") for s in (a, b) for layer in (2, 9)]
    assert not np.allclose(tables[0][1], tables[2][1])  # the two stores' scales differ
    for r, n in zip(raw, nrm):
        for k in range(4):
            shift, scale = tables[k]
            # both segments of one layer have their own key; tokens of either kind appear
            rows_prompt = r[k][:, 3] == 0
            for si, rows in ((0, rows_prompt), (1, ~rows_prompt)):
                want = (r[k][rows] - torch.from_numpy(shift[si])) * torch.from_numpy(scale[si])
                torch.testing.assert_close(n[k][rows], want, rtol=1e-5, atol=1e-5)


def test_on_s3(tmp_path, s3_url):
    local = tagged_store(tmp_path / "s")
    remote = tagged_store(s3_url)
    seen = check_aligned(local, list(TokenStream.aligned(remote, layers=[2, 9], batch_size=6, seed=1)), [2, 9])
    assert sorted(seen) == every_token(local)


@pytest.mark.parametrize("mmap", [True, False])
def test_fixed_token_vit_store_mapped_or_read(tmp_path, mmap):
    """A ViT-like store (one fixed segment, no token ids): layers in step, every patch once."""
    rng = np.random.default_rng(0)
    n, t, d = 10, 5, 6
    acts = rng.standard_normal((n, 2, t, d)).astype(np.float32)
    acts[..., 0] = np.arange(n)[:, None, None]
    acts[..., 1] = np.array([3, 7])[None, :, None]
    acts[..., 2] = np.arange(t)[None, None, :]
    with ShardWriter(tmp_path / "v", layers=[3, 7], d_model=d, tokens=t, dtype="float32") as w:
        w.append(acts)
    actstore.finalize(tmp_path / "v")
    st = ActStore(tmp_path / "v")
    batches = list(TokenStream.aligned(st, layers=[3, 7], batch_size=7, seed=2, mmap=mmap))
    seen = []
    for a, b in batches:
        assert torch.equal(a[:, [0, 2]], b[:, [0, 2]]) and torch.all(a[:, 1] == 3) and torch.all(b[:, 1] == 7)
        seen += [tuple(r) for r in a[:, [0, 2]].numpy().astype(int).tolist()]
        for row in range(len(a)):
            ex, tok = int(a[row, 0]), int(a[row, 2])
            np.testing.assert_array_equal(b[row].numpy(), acts[ex, 1, tok])
    assert sorted(seen) == [(e, k) for e in range(n) for k in range(t)]
