"""The capture enters the writer through its internal door: it builds the checked Batch
itself (counts and statistics already known), never through `append`'s checks, and each
stored value is screened for inf/NaN once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from capture_support import tiny_llama
from screen_count import count_screens

import actstore
from actstore.write import batch as batches


def _refuse_prepare(monkeypatch) -> None:
    def refused(*a, **k):
        raise AssertionError("the capture went through append's checks")

    monkeypatch.setattr(batches, "prepare", refused)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_capture_builds_the_batch_and_screens_each_value_once(tmp_path, monkeypatch, dtype):
    model, _ = tiny_llama(layers=3)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(4, 60, (2, 5), generator=g) for _ in range(3)]
    _refuse_prepare(monkeypatch)
    calls = count_screens(monkeypatch)
    actstore.record(model, data, tmp_path / "s", layers=[0, 1], dtype=dtype)
    # one screen per (batch, layer, segment): 3 batches x 2 layers x 1 segment (before: twice
    # for a float32 model stored as float16, the device side's and append's)
    assert calls[0] == 3 * 2
    monkeypatch.undo()
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    assert len(store) == 6
    with torch.inference_mode():
        for b, ids in enumerate(data):
            hs = model(ids, output_hidden_states=True).hidden_states
            for i in range(2):
                for layer in (0, 1):
                    want = hs[layer + 1][i].numpy().astype(dtype)
                    np.testing.assert_array_equal(store[2 * b + i, layer], want)


def test_capture_counts_non_finite_values_as_append_did(tmp_path):
    """A NaN in a hooked output is counted once in the shard's commit record (value count)."""
    model, _ = tiny_llama(layers=2)
    ids = torch.randint(4, 60, (2, 5), generator=torch.Generator().manual_seed(2))

    def poison(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h[0, 1, :3] = float("nan")
        return out

    handle = model.model.layers[1].register_forward_hook(poison)
    try:
        actstore.record(model, [ids, ids], tmp_path / "s", layers=[0, 1], dtype="float16")
    finally:
        handle.remove()
    from actstore import catalog
    from actstore.storage import open_storage

    rec = catalog.read_commit(catalog.shard_storage(open_storage(tmp_path / "s"), 0))
    assert rec.nonfinite == {"tokens": 2 * 3}  # 2 batches x 3 values, layer 1 only
