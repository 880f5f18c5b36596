"""TokenStream invariants on small stores: each epoch yields every kept token vector exactly
once with the value ActStore holds; the order is a function of (seed, epoch); workers and
ranks are disjoint and complete; a resumed run yields exactly the remaining batches."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from factory import examples
from factory import pairs_store as qa_store
from factory import plain_vit_store as vit_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_checks import check_values, expected_rows, rows_of

import actstore
from actstore import ActStore
from actstore.torch import PairBatchSampler, TokenStream


def content(store):
    """The default mask of a store whose labels mark token kinds: label 0 (content) only."""
    return {name: store.field(f"{name}_token_labels") == 0 for name in store.segments}


def test_epoch_yields_every_token_once_with_store_values(tmp_path):
    store = qa_store(tmp_path / "s")
    ts = TokenStream(store, batch_size=7, buffer_bytes=7 * 8 * 2 * 3, return_index=True)
    assert ts.window_batches == 3
    batches = list(ts)
    rows = rows_of(batches)
    assert sorted(rows) == sorted(expected_rows(store, keep=content(store)))  # the default mask: content tokens
    assert len(rows) == ts.n_tokens < len(expected_rows(store)) and len(batches) == len(ts) == -(-ts.n_tokens // 7)
    assert all(len(b["acts"]) == 7 for b in batches[:-1]) and batches[0]["acts"].dtype == torch.float16
    check_values(store, ts, batches)
    assert ts.epoch == 1 and ts.state_dict()["batches_done"] == 0
    as_f32 = TokenStream(store, batch_size=7, buffer_bytes=7 * 8 * 2 * 3, return_index=True, dtype=torch.float32)
    batches32 = list(as_f32)
    assert batches32[0]["acts"].dtype == torch.float32 and rows_of(batches32) == rows
    check_values(store, as_f32, batches32)


def test_layers_segments_and_stored_dtype(tmp_path):
    store = qa_store(tmp_path / "s", dtype="bfloat16")
    ts = TokenStream(
        store, batch_size=5, layers=[9], segments="response", dtype=None, return_index=True, buffer_bytes=1
    )
    batches = list(ts)
    assert batches[0]["acts"].dtype == torch.bfloat16 and ts.window_batches == 1
    assert sorted(rows_of(batches)) == sorted(
        expected_rows(store, layers=[9], segments=["response"], keep=content(store))
    )
    for b in batches:
        for i in range(len(b["acts"])):
            ref = store.segment("response")[int(b["example"][i]), 9][int(b["token"][i])]
            np.testing.assert_array_equal(b["acts"][i].float().numpy(), ref)


def test_plain_tensors_without_index(tmp_path):
    store = vit_store(tmp_path / "s")
    ts = TokenStream(store, batch_size=16, shuffle=False)
    got = torch.cat(list(ts)).numpy()
    want = np.stack([store[ex, layer] for ex in range(len(store)) for layer in store.layers]).reshape(-1, 6)
    np.testing.assert_array_equal(got, want)  # no shuffle: store order, stored dtype


def test_token_mask_skips_masked_tokens(tmp_path):
    store = qa_store(tmp_path / "s")
    labels = {name: store.field(f"{name}_token_labels") for name in store.segments}
    ts = TokenStream(store, batch_size=6, token_mask="token_labels", return_index=True)
    rows = rows_of(list(ts))
    assert sorted(rows) == sorted(expected_rows(store, keep={k: v != 0 for k, v in labels.items()}))
    assert all(labels[store.segments[s]][e, t] != 0 for e, _, s, t in rows)
    content = rows_of(list(TokenStream(store, batch_size=6, token_mask="content", return_index=True)))
    assert sorted(content) == sorted(expected_rows(store, keep={k: v == 0 for k, v in labels.items()}))
    assert set(content).isdisjoint(rows) and len(content) + len(rows) == len(expected_rows(store))
    only_prompt = TokenStream(store, batch_size=6, token_mask={"prompt": labels["prompt"] == 1}, return_index=True)
    keep = {"prompt": labels["prompt"] == 1, "response": np.ones_like(labels["response"], dtype=bool)}
    assert sorted(rows_of(list(only_prompt))) == sorted(expected_rows(store, keep=keep))


def test_runs_of_units_stay_together(tmp_path):
    store = vit_store(tmp_path / "s", n=40)  # units of 5 tokens x 6 x 2 bytes = 60 bytes
    ts = TokenStream(store, batch_size=5, run_bytes=4 * 60, buffer_bytes=5 * 12, return_index=True)
    assert ts.run == 4 and ts.window_batches == 1  # one batch = one unit per window
    units = [(int(b["example"][0]), int(b["layer"][0])) for b in ts]
    assert sorted(units) == [(e, l) for e in range(40) for l in (0, 1)]
    ids = [2 * e + l for e, l in units]
    assert ids != sorted(ids) and all(ids[j + 1] == ids[j] + 1 for r in range(0, 80, 4) for j in range(r, r + 3))


def test_same_seed_same_order_other_seed_and_epoch_another(tmp_path):
    store = qa_store(tmp_path / "s")

    def run(seed, epoch=0):
        ts = TokenStream(store, batch_size=8, seed=seed, return_index=True, buffer_bytes=8 * 16 * 2)
        ts.set_epoch(epoch)
        return rows_of(list(ts))

    a = run(1)
    assert a == run(1)
    assert a != run(2) and sorted(a) == sorted(run(2))
    assert a != run(1, epoch=1) and sorted(a) == sorted(run(1, epoch=1))
    ts = TokenStream(store, batch_size=8, seed=1, return_index=True, buffer_bytes=8 * 16 * 2)
    first, second = rows_of(list(ts)), rows_of(list(ts))  # iterating again gives the next epoch
    assert (first, second) == (a, run(1, epoch=1))


def test_ranks_and_workers_are_disjoint_and_complete(tmp_path):
    store = qa_store(tmp_path / "s")
    everything = Counter()
    counts = []
    for rank in range(3):
        ts = TokenStream(
            store, batch_size=5, rank=rank, world_size=3, return_index=True, buffer_bytes=5 * 16 * 2, token_mask="all"
        )
        batches = list(ts.loader(num_workers=2, multiprocessing_context="fork"))
        counts.append(len(batches))
        assert len(batches) == len(ts)
        check_values(store, ts, batches)
        everything.update(rows_of(batches))
    assert max(everything.values()) == 1
    assert sorted(everything) == sorted(expected_rows(store))
    assert max(counts) - min(counts) <= 1


def test_drop_last_gives_every_rank_the_same_full_batches(tmp_path):
    store = qa_store(tmp_path / "s")
    lens = []
    for rank in range(2):
        batches = list(TokenStream(store, batch_size=6, rank=rank, world_size=2, drop_last=True))
        lens.append([len(b) for b in batches])
    assert lens[0] == lens[1] and set(lens[0]) == {6}


def _run(store, state=None, n=None, num_workers=0, **kw):
    ts = TokenStream(store, batch_size=5, seed=3, buffer_bytes=5 * 16 * 2, return_index=True, **kw)
    loader = ts.loader(num_workers=num_workers, multiprocessing_context="fork")
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for b in loader:
        out.append(rows_of([b]))
        if n is not None and len(out) == n:
            break
    return out, loader.state_dict()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_exactly_the_remaining_batches(tmp_path, num_workers):
    store = qa_store(tmp_path / "s")
    full, end_state = _run(store, num_workers=num_workers)
    assert end_state["epoch"] == 1 and end_state["batches_done"] == 0
    for cut in (1, 4, 5, len(full) - 1):
        head, state = _run(store, n=cut, num_workers=num_workers)
        assert head == full[:cut] and state["batches_done"] == cut and state["epoch"] == 0
        tail, _ = _run(store, state=state, num_workers=num_workers)
        assert tail == full[cut:]


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 9),
    window=st.integers(1, 3),
    cut=st.integers(0, 60),
    seed=st.integers(0, 9),
    run=st.integers(0, 6),
)
def test_resume_property_in_process(tmp_path, batch, window, cut, seed, run):
    path = tmp_path / "hyp"
    store = ActStore(path) if path.exists() else qa_store(path)

    def make():
        return TokenStream(
            store,
            batch_size=batch,
            seed=seed,
            buffer_bytes=batch * 16 * window,
            return_index=True,
            run_bytes=run * 8 * 16 * 13 // 2,
        )  # units average (12 + 4) / 2 rows of 16 bytes

    full = [rows_of([b]) for b in make()]
    cut = min(cut, len(full))
    ts = make()
    it = iter(ts)
    head = [rows_of([next(it)]) for _ in range(cut)]
    state = ts.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [rows_of([b]) for b in resumed] == full


def test_normalize_standardize_and_scale(tmp_path):
    store = qa_store(tmp_path / "s")
    st_ = store.stats()
    ts = TokenStream(store, batch_size=64, normalize="standardize", return_index=True)
    for b in ts:
        for i in range(len(b["acts"])):
            name = ts.segments[int(b["segment"][i])].name
            k = st_.keys.index(f"layer{int(b['layer'][i])}/{name}")
            x = (
                store.segment(name)
                .padded(int(b["example"][i]), int(b["layer"][i]))[int(b["token"][i])]
                .astype(np.float64)
            )
            want = (x - st_.mean[k]) / np.sqrt(st_.m2[k] / st_.count[k] + 1e-6)
            np.testing.assert_allclose(b["acts"][i].numpy(), want, rtol=1e-5, atol=1e-5)
    one = TokenStream(store, batch_size=1000, layers=[5], segments="prompt", normalize="scale")
    x = torch.cat(list(one)).numpy().astype(np.float64)
    assert x.shape[0] == st_.count[st_.keys.index("layer5/prompt")]
    np.testing.assert_allclose(np.linalg.norm(x, axis=1).mean(), np.sqrt(8), rtol=1e-3)


def test_bad_arguments_have_clear_errors(tmp_path):
    store = qa_store(tmp_path / "s", stats=False)
    with pytest.raises(KeyError, match=r"layer 4 is not stored; this store holds layers \[2, 5, 9\]"):
        TokenStream(store, layers=[4])
    with pytest.raises(
        KeyError, match=r"segments \['answer'\] are not in this store; it has segments \['prompt', 'response'\]"
    ):
        TokenStream(store, segments=["answer"])
    with pytest.raises(ValueError, match=r"batch_size must be a positive int\. Got 0\."):
        TokenStream(store, batch_size=0)
    with pytest.raises(
        ValueError, match=r"normalize='standardize' needs the store's statistics, but this store kept none"
    ):
        TokenStream(store, normalize="standardize")
    with pytest.raises(
        ValueError,
        match=r"token mask of segment 'prompt' must have shape \(n_examples, T_max\) = \(14, 9\); got \(14, 4\)",
    ):
        TokenStream(store, token_mask={"prompt": np.ones((14, 4))})
    with pytest.raises(KeyError, match=r"reads the per-token array 'prompt_special', which this store lacks"):
        TokenStream(store, token_mask="special")
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.world_size-1"):
        TokenStream(store, rank=2, world_size=2)
    ts = TokenStream(store, batch_size=4)
    state = ts.state_dict()
    with pytest.raises(ValueError, match=r"batch_size: saved 4, this stream 5"):
        TokenStream(store, batch_size=5).load_state_dict(state)
    state.update(batches_done=3, num_workers=2)
    ts.load_state_dict(state)
    with pytest.raises(
        ValueError,
        match=r"saved position was taken with num_workers=2; resume with the same number of workers \(got 0\)",
    ):
        ts.loader(num_workers=0)


def test_rank_and_world_size_default_from_torch_distributed(tmp_path, monkeypatch):
    store = vit_store(tmp_path / "s")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 3)
    ts = TokenStream(store, batch_size=4, return_index=True)
    assert (ts.rank, ts.world_size) == (1, 3)
    mine = rows_of(list(ts))
    others = [rows_of(list(TokenStream(store, batch_size=4, rank=r, world_size=3, return_index=True))) for r in (0, 2)]
    assert sorted(mine + others[0] + others[1]) == sorted(expected_rows(store)) and len(mine) == 4 * len(ts)
    smp = PairBatchSampler(10, layers=[0, 1], batch_size=2)
    assert (smp.rank, smp.world_size) == (1, 3)


def test_a_damaged_chunk_raises_in_the_training_loop(tmp_path):
    store = vit_store(tmp_path / "s")
    chunk = store._shard(0).io["tokens"].chunk_path(7, 1, 0)
    with open(chunk, "r+b") as f:
        f.truncate(100)
    with pytest.raises(actstore.CorruptChunkError, match=r"has 100 bytes, expected 60: the file is damaged"):
        for _ in TokenStream(store, batch_size=4, buffer_bytes=4 * 12 * 3):
            pass
    with pytest.raises(actstore.CorruptChunkError, match=r"has 100 bytes, expected 60"):
        list(TokenStream(store, batch_size=4).loader(num_workers=2, multiprocessing_context="fork"))


@pytest.mark.slow
@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "read"])
def test_next_epochs_first_window_is_read_ahead_and_serves_only_that_epoch(tmp_path, monkeypatch, mmap):
    store = vit_store(tmp_path / "s", n=40, t=5, d=6)
    kw = dict(batch_size=8, buffer_bytes=8 * 6 * 2 * 4, seed=3, mmap=mmap)  # windows of 4 batches

    def fresh(epoch):
        ts = TokenStream(store, **kw)
        ts.set_epoch(epoch)
        return [b.clone() for b in ts]

    want = {e: fresh(e) for e in (1, 5, 6)}
    ts = TokenStream(store, **kw)
    assert [b.clone() for b in ts] and ts.epoch == 1
    assert ts.spares.reading_ahead  # the reader of epoch 0 finishes its read-ahead in the background
    ahead = ts.spares.kept().ahead  # (waits for it)
    assert ahead[1].start == 0 and ahead[0] == (3, 1) and not ts.spares.reading_ahead  # seed 3, epoch 1, window 0
    calls = []
    from actstore.loaders.windows import MappedFill

    owner, name = (MappedFill, "_unit") if mmap else (type(store), "read_cached")  # how a window's units are reached
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda self, *a: calls.append(a[:2]) or real(self, *a))
    got = [b.clone() for b in ts]  # epoch 1: its first window is already in memory
    assert len(got) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got, want[1]))
    ts.spares.kept()  # epoch 2's first window, read in the background: wait for it
    p1, p2 = ts.plan(1), ts.plan(2)
    assert len(calls) == sum(len(p1.window(j).units) for j in range(1, p1.n_windows)) + len(p2.window(0).units)
    ts.set_epoch(5)  # the window read ahead (epoch 2) is not epoch 5's
    ts.discard_read_ahead()
    assert ts.spares.kept().ahead is None and ts.spares.kept().slots  # forgotten, its slots kept
    region = ts.spares.kept().region
    assert (region is not None) == mmap
    if mmap:  # mapped: the store's files stay mapped for the next epochs, none pinned now
        assert region.stats()["mapped"] == 80 and region.stats()["pinned"] == 0
    ts.set_epoch(2)
    assert all(torch.equal(a, b) for a, b in zip(ts, fresh(2)))  # read again, not from memory
    ts.set_epoch(5)
    got = [b.clone() for b in ts]
    assert all(torch.equal(a, b) for a, b in zip(got, want[5])) and len(got) == len(want[5])
    it = iter(ts)  # epoch 6 was read ahead; stop after 3 batches and resume elsewhere
    first3 = [next(it).clone() for _ in range(3)]
    state = ts.state_dict()
    del it
    resumed = TokenStream(store, **kw)
    resumed.load_state_dict(state)
    rest = [b.clone() for b in resumed]
    assert all(torch.equal(a, b) for a, b in zip(first3 + rest, want[6])) and len(first3 + rest) == len(want[6])


@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "read"])
def test_the_pipeline_hands_its_spare_buffers_to_the_next_epoch(tmp_path, mmap):
    """The window slots, the batch maker's ring and the mappings pass from one epoch's
    pipeline to the next through the stream's Spares: the next epoch's batches land in the
    same memory, with the values a fresh stream gives."""
    store = vit_store(tmp_path / "s", n=24, t=5, d=6)
    kw = dict(batch_size=8, buffer_bytes=8 * 6 * 2 * 3, seed=4, mmap=mmap)  # windows of 3 batches
    ts = TokenStream(store, **kw)
    first = [b.untyped_storage().data_ptr() for b in ts]  # (each batch dropped: its ring slot is reused)
    kept = ts.spares.kept()
    maker, slots, region = kept.maker, list(kept.slots), kept.region
    bufs = {id(s.buf) for s in slots if s.buf is not None}
    assert (region is not None) == mmap and len(slots) == 3 and (len(bufs) == 0) == mmap
    ring = len(maker.ring.slots)
    assert len(first) == 30 and len(set(first)) <= ring < len(first)  # batches in reused buffers
    fresh = TokenStream(store, **kw)
    fresh.set_epoch(1)
    want = [b.clone() for b in fresh]
    second, got = [], []
    for b in ts:  # epoch 1: its pipeline took the spares
        assert not ts.spares.kept().slots  # (taken: the running pipeline holds them)
        second.append(b.untyped_storage().data_ptr())
        got.append(b.clone())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert set(second) <= set(first)  # no batch of epoch 1 took fresh memory
    again = ts.spares.kept()  # handed back at the end of epoch 1
    assert again.maker is maker and again.region is region and {id(s) for s in again.slots} == {id(s) for s in slots}
    assert {id(s.buf) for s in again.slots if s.buf is not None} == bufs
    assert not hasattr(ts, "_spare")
