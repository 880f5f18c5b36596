"""ActStore behaviour: metadata, per-sample fields and texts, pickling, many processes."""

from __future__ import annotations

import pickle

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import actstore
from actstore import ActStore, ShardWriter


def _qa_store(path, rng, shards=2, n=5):
    logged = []
    for shard in range(shards):
        with ShardWriter(
            path,
            shard=shard,
            layers=[1, 3],
            d_model=4,
            segments={"prompt": 6, "response": 3},
            fields={"label": "int16", "split": "int8"},
            texts=["prompt", "response"],
            token_labels=True,
            model_id="tiny/llama",
            attrs={"dataset": "unit"},
        ) as w:
            p = rng.standard_normal((n, 2, 6, 4)).astype(np.float16)
            r = rng.standard_normal((n, 2, 3, 4)).astype(np.float16)
            pl, rl = rng.integers(0, 7, n), rng.integers(0, 4, n)
            labels = {
                "prompt": rng.integers(0, 5, (n, 6)).astype(np.uint8),
                "response": rng.integers(0, 5, (n, 3)).astype(np.uint8),
            }
            w.append(
                prompt=p,
                response=r,
                lengths={"prompt": pl, "response": rl},
                sample_keys=[f"k{shard}-{i}" for i in range(n)],
                fields={"label": np.arange(n) + 100 * shard, "split": np.full(n, shard)},
                texts={"prompt": [f"q{shard}{i} é" for i in range(n)], "response": [{"a": i} for i in range(n)]},
                token_labels=labels,
            )
            for i in range(n):
                logged.append((p[i], r[i], pl[i], rl[i], labels["prompt"][i]))
    actstore.finalize(path)
    return logged


def test_fields_texts_and_meta(store_path, rng):
    logged = _qa_store(store_path, rng)
    s = ActStore(store_path)
    assert len(s) == 10 and s.layers == (1, 3) and s.d_model == 4 and s.segments == ("prompt", "response")
    assert s.meta["model_id"] == "tiny/llama" and s.meta["dataset"] == "unit"
    assert s.meta["segments"]["response"] == {"t_max": 3, "t_chunk": 3, "fixed": False}
    assert list(s.field("sample_key")) == [f"k{sh}-{i}" for sh in range(2) for i in range(5)]
    assert list(s.field("label")) == [i + 100 * sh for sh in range(2) for i in range(5)]
    assert list(s.texts("prompt")) == [f"q{sh}{i} é" for sh in range(2) for i in range(5)]
    smp = s.sample(7)
    assert smp["sample_key"] == "k1-2" and smp["label"] == 102 and smp["split"] == 1 and smp["response"] == {"a": 2}
    np.testing.assert_array_equal(s.field("prompt_token_labels")[7], logged[7][4])
    for ex, (p, r, pl, rl, _) in enumerate(logged):
        np.testing.assert_array_equal(s[ex, 3], np.concatenate([p[1, :pl], r[1, :rl]]))
        np.testing.assert_array_equal(s.segment("prompt").padded(ex, 1), p[0])


def test_pickle_reopens_lazily(store_path, rng):
    _qa_store(store_path, rng)
    s = ActStore(store_path)
    s[3, 1]
    blob = pickle.dumps(s)
    assert len(blob) < 300  # only the path travels, not buffers or handles
    t = pickle.loads(blob)
    np.testing.assert_array_equal(t[3, 1], s[3, 1])


class _Pairs(Dataset):
    def __init__(self, store):
        self.store = store

    def __len__(self):
        return len(self.store) * 2

    def __getitem__(self, i):
        ex, k = divmod(i, 2)
        x = self.store.segment("prompt").padded(ex, self.store.layers[k])
        return torch.from_numpy(x.astype(np.float32)), ex, k


def test_many_dataloader_workers_read_the_same_values(store_path, rng):
    _qa_store(store_path, rng)
    s = ActStore(store_path)
    loader = DataLoader(_Pairs(s), batch_size=3, num_workers=4, multiprocessing_context="fork")
    n = 0
    for x, exs, ks in loader:
        for j in range(len(exs)):
            want = s.segment("prompt").padded(int(exs[j]), s.layers[int(ks[j])]).astype(np.float32)
            np.testing.assert_array_equal(x[j].numpy(), want)
            n += 1
    assert n == 20


def test_to_xarray_labels_layers_and_segments(store_path, rng):
    logged = _qa_store(store_path, rng)
    s = ActStore(store_path)
    da = s.to_xarray(4)
    p, r, pl, rl, _ = logged[4]
    assert da.dims == ("layer", "token", "d_model") and list(da.layer.values) == [1, 3]
    np.testing.assert_array_equal(da.sel(layer=3).values, np.concatenate([p[1, :pl], r[1, :rl]]))
    assert list(da.segment.values) == ["prompt"] * pl + ["response"] * rl
    np.testing.assert_array_equal(s.to_xarray(4, "response").sel(layer=1).values, r[0, :rl])
