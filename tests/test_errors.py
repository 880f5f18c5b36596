"""Bad input: each a clear error, tested with its message; nothing written is damaged."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import actstore
from actstore import ActStore, ShardWriter
from actstore.errors import (
    AppendError,
    ExampleIndexError,
    Float16OverflowError,
    LayerNotFoundError,
    NonFiniteError,
    NotFinalizedError,
    SegmentNotFoundError,
    ShardCompleteError,
    ShardExistsError,
    StoreMismatchError,
    StoreNotFoundError,
)

KW = dict(layers=[2, 5], d_model=8, tokens=6)


def _ok(rng, b=2):
    return rng.standard_normal((b, 2, 6, 8)).astype(np.float16)


def _store(path, rng, n=4, shard=0, **kw):
    data = _ok(rng, n)
    with ShardWriter(path, shard=shard, **{**KW, **kw}) as w:
        w.append(data)
    return data


def test_append_wrong_shape_dtype_layers(store_path, rng):
    with ShardWriter(store_path, shard=0, **KW) as w:
        with pytest.raises(
            AppendError, match=re.escape("expected a batch of shape (b, L=2, T, D=8), got shape (2, 6, 8)")
        ):
            w.append(np.zeros((2, 6, 8), np.float16))
        with pytest.raises(AppendError, match=re.escape("batch has 3 layers, the store records 2 (layers [2, 5])")):
            w.append(np.zeros((2, 3, 6, 8), np.float16))
        with pytest.raises(AppendError, match=re.escape("batch has d_model 9, the store has d_model 8")):
            w.append(np.zeros((2, 2, 6, 9), np.float16))
        with pytest.raises(AppendError, match=re.escape("holds exactly 6 tokens per example; the batch has 5")):
            w.append(np.zeros((2, 2, 5, 8), np.float16))
        with pytest.raises(AppendError, match="activations must be float16, bfloat16, float32 or float64, got int64"):
            w.append(np.zeros((2, 2, 6, 8), np.int64))
        with pytest.raises(AppendError, match="do not pass lengths"):
            w.append(_ok(rng), lengths=[6, 6])
        w.append(_ok(rng))  # the writer is still usable after refused batches
        assert w.n_written == 2


def test_lengths_beyond_t_max(store_path, rng):
    with ShardWriter(store_path, shard=0, layers=[0], d_model=4, segments={"prompt": 5, "response": 3}) as w:
        p = np.ones((2, 1, 5, 4), np.float16)
        r = np.ones((2, 1, 3, 4), np.float16)
        with pytest.raises(
            AppendError, match=re.escape("segment 'prompt': length 7 is beyond the batch's 5 tokens (T_max 5)")
        ):
            w.append(prompt=p, response=r, lengths={"prompt": [7, 2], "response": [1, 1]})
        with pytest.raises(
            AppendError, match=re.escape("batch has 6 tokens but the store holds at most 5; truncate it to 5")
        ):
            w.append(prompt=np.ones((2, 1, 6, 4), np.float16), response=r)
        with pytest.raises(
            AppendError, match=re.escape("append needs activations for segments ['prompt', 'response']; got ['prompt']")
        ):
            w.append(prompt=p)
        w.append(
            prompt=p, response=r, lengths={"prompt": [5, 2], "response": [0, 3]}, source_lengths={"prompt": [9, 2]}
        )
    actstore.finalize(store_path)
    s = ActStore(store_path)
    assert s.lengths(0) == {"prompt": 5, "response": 0} and s[0, 0].shape == (5, 4)
    assert s.meta["truncation"]["prompt"] == {"count": 1, "fraction": 0.5}


def test_path_holding_a_different_store(store_path, rng):
    _store(store_path, rng)
    with pytest.raises(
        StoreMismatchError,
        match=re.escape("already holds a different actstore store (d_model: store has 8, asked for 16)"),
    ):
        ShardWriter(store_path, shard=1, layers=[2, 5], d_model=16, tokens=6)
    with pytest.raises(
        StoreMismatchError,
        match=re.escape("layers: store has [2, 5], asked for [2, 6]; dtype: store has 'float16', asked for 'float32'"),
    ):
        ShardWriter(store_path, shard=1, layers=[2, 6], d_model=8, tokens=6, dtype="float32")


def test_path_holding_foreign_files(tmp_path, rng):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        StoreMismatchError, match=re.escape("already holds files that are not an actstore store (notes.txt)")
    ):
        ShardWriter(tmp_path, shard=0, **KW)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_existing_shard_needs_resume_or_overwrite(store_path, rng):
    _store(store_path, rng)
    with pytest.raises(
        ShardExistsError, match="shard 0 of .* already exists \\(4 committed examples\\); pass resume=True"
    ):
        ShardWriter(store_path, shard=0, **KW)
    with pytest.raises(ShardCompleteError, match="is complete with 4 examples; nothing to resume"):
        ShardWriter(store_path, shard=0, resume=True, **KW)
    actstore.finalize(store_path)
    with pytest.raises(ShardExistsError, match="it is part of the finalized manifest"):
        ShardWriter(store_path, shard=0, overwrite=True, **KW)


def test_nonfinite_counted_and_reported_or_refused(store_path, rng):
    x = _ok(rng, 3)
    x[1, 0, 2, 3] = np.nan
    x[2, 1, 0, 0] = np.inf
    with ShardWriter(store_path, shard=0, on_nonfinite="raise", **KW) as w:
        with pytest.raises(
            NonFiniteError, match="the batch holds 2 NaN or infinite values; nothing of this batch was written"
        ):
            w.append(x)
        assert w.n_written == 0
    with ShardWriter(store_path, shard=1, stats=True, **KW) as w:
        w.append(x)
    actstore.finalize(store_path)
    s = ActStore(store_path)
    assert s.meta["nonfinite"] == {"tokens": 2}
    assert np.isnan(s[1, 2][2, 3])
    st = s.stats()
    assert st.summary()["layer2/tokens"]["nonfinite"] == 1 and st.summary()["layer5/tokens"]["nonfinite"] == 1


@pytest.mark.parametrize("src", ["numpy", "torch"])
def test_float32_overflowing_float16_is_never_stored_as_inf(store_path, rng, src):
    x = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    x[0, 1, 3, 2] = 70000.0
    x[1, 0, 0, 0] = -1e6
    batch = torch.from_numpy(x) if src == "torch" else x
    with ShardWriter(store_path, shard=0, **KW) as w:
        with pytest.raises(
            Float16OverflowError,
            match=re.escape(
                "2 finite float32 values lie beyond the range of float16 (|x| > 65504) and would be stored as inf; nothing of this batch was written"
            ),
        ):
            w.append(batch)
        assert w.n_written == 0
    with ShardWriter(store_path, shard=1, on_overflow="clip", **KW) as w:
        w.append(batch)
    actstore.finalize(store_path)
    s = ActStore(store_path)
    assert len(s) == 2 and s.meta["overflow"] == {"tokens": 2}
    assert s[0, 5][3, 2] == np.float16(65504) and s[1, 2][0, 0] == np.float16(-65504)
    assert np.isfinite(s[0, 5]).all()


def test_read_errors_say_what_exists(store_path, rng):
    _store(store_path, rng, n=4)
    _store(store_path, rng, n=3, shard=1)
    actstore.finalize(store_path)
    s = ActStore(store_path)
    with pytest.raises(LayerNotFoundError, match=re.escape("layer 3 is not stored; this store holds layers [2, 5]")):
        s[0, 3]
    with pytest.raises(
        ExampleIndexError, match=re.escape("example 7 is out of range: this store holds 7 examples (0..6)")
    ):
        s[7, 2]
    with pytest.raises(
        SegmentNotFoundError, match=re.escape("segment 'prompt' is not in this store; it has segments ['tokens']")
    ):
        s.segment("prompt")
    assert s[-1, 2].shape == (6, 8)
    import shutil

    shutil.rmtree(store_path / "shards" / "shard-00001.zarr")
    s = ActStore(store_path)
    with pytest.raises(
        StoreNotFoundError,
        match=re.escape("shard shard-00001.zarr listed in the manifest of")
        + ".*"
        + re.escape("is missing (holds examples 4..6); shards present: ['shard-00000.zarr']"),
    ):
        s[5, 2]


def test_never_finalized_and_missing_stores(store_path, tmp_path, rng):
    _store(store_path, rng)
    with pytest.raises(NotFinalizedError, match="has writer shards but was never finalized .* run `actstore finalize"):
        ActStore(store_path)
    with pytest.raises(StoreNotFoundError, match="no store at"):
        ActStore(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFoundError, match="is not an actstore store"):
        ActStore(tmp_path / "empty")


def test_bad_writer_arguments(store_path):
    with pytest.raises(
        ValueError, match=re.escape("dtype must be one of ['float16', 'float32', 'bfloat16']. Got 'int8'.")
    ):
        ShardWriter(store_path, shard=0, layers=[1], d_model=4, tokens=3, dtype="int8")
    with pytest.raises(ValueError, match="give exactly one of tokens=T"):
        ShardWriter(store_path, shard=0, layers=[1], d_model=4)
    with pytest.raises(
        ValueError, match=re.escape("layers must be a non-empty list of distinct non-negative ints. Got [1, 1].")
    ):
        ShardWriter(store_path, shard=0, layers=[1, 1], d_model=4, tokens=3)
    with pytest.raises(ValueError, match="shard_examples \\(Zarr sharding\\) needs zarr_format=3"):
        ShardWriter(store_path, shard=0, layers=[1], d_model=4, tokens=3, zarr_format=2, shard_examples=8)
    assert not store_path.exists()  # arguments are checked before anything is created


def test_torch_inputs_bit_exact(store_path):
    g = torch.Generator().manual_seed(0)
    x16 = torch.randn(3, 2, 6, 8, generator=g).to(torch.float16)
    xbf = torch.randn(3, 2, 6, 8, generator=g).to(torch.bfloat16)
    with ShardWriter(store_path / "a", shard=0, **KW) as w:
        w.append(x16)
    with ShardWriter(store_path / "b", shard=0, dtype=torch.bfloat16, **KW) as w:
        w.append(xbf)
    for p in ("a", "b"):
        actstore.finalize(store_path / p)
    a, b = ActStore(store_path / "a"), ActStore(store_path / "b")
    assert b.dtype == "bfloat16"
    for ex in range(3):
        for k, layer in enumerate([2, 5]):
            assert np.array_equal(a[ex, layer], x16[ex, k].numpy())
            got = torch.from_numpy(b[ex, layer]).to(torch.bfloat16)  # exact: float32 widening of bf16
            assert torch.equal(got.view(torch.int16), xbf[ex, k].contiguous().view(torch.int16))


def test_refused_batch_leaves_counters_untouched(store_path):
    with ShardWriter(
        store_path, shard=0, layers=[0], d_model=4, segments={"prompt": 5, "response": 3}, on_overflow="clip"
    ) as w:
        p = np.ones((2, 1, 5, 4), np.float32)
        p[0, 0, 0, 0] = 1e6  # clipped overflow in the first segment, counted...
        bad_r = np.ones((2, 1, 3, 5), np.float32)  # ...then the second segment is refused
        with pytest.raises(AppendError, match="batch has d_model 5"):
            w.append(prompt=p, response=bad_r, source_lengths={"prompt": [9, 9]})
        assert w.overflow == {"prompt": 0, "response": 0} and w.truncated == {"prompt": 0, "response": 0}
        w.append(prompt=p, response=np.ones((2, 1, 3, 4), np.float32), source_lengths={"prompt": [9, 1]})
        assert w.overflow == {"prompt": 1, "response": 0} and w.truncated == {"prompt": 1, "response": 0}
