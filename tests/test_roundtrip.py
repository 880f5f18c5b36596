"""Property round trip: every store[ex, layer] equals what was appended, bit for bit."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
from actstore import ActStore, ShardWriter
from tests.helpers import expected_view, random_acts


@st.composite
def store_cases(draw):
    n_layers = draw(st.integers(1, 3))
    layers = sorted(draw(st.lists(st.integers(0, 40), min_size=n_layers, max_size=n_layers, unique=True)))
    d_model = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    multi = draw(st.booleans())
    if multi:
        segs = {"prompt": draw(st.integers(1, 9)), "response": draw(st.integers(1, 6))}
    else:
        segs = {"tokens": draw(st.integers(1, 12))}
    t_chunk = draw(st.one_of(st.none(), st.integers(1, 5)))
    storage = draw(st.sampled_from(["v2", "v2-zarr", "v3", "v3-sharded"]))
    n_writers = draw(st.integers(1, 3))
    writers = []
    for _ in range(n_writers):
        batches = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
        writers.append(batches)
    commit_bytes = draw(st.sampled_from([1, 10_000, 10**9]))
    return dict(layers=layers, d_model=d_model, dtype=dtype, multi=multi, segs=segs, t_chunk=t_chunk,
                storage=storage, writers=writers, commit_bytes=commit_bytes, seed=draw(st.integers(0, 2**16)))


def _writer_kwargs(case):
    kw = dict(layers=case["layers"], d_model=case["d_model"], dtype=case["dtype"], t_chunk=case["t_chunk"],
              commit_bytes=case["commit_bytes"])
    if case["multi"]:
        kw["segments"] = case["segs"]
    else:
        kw["tokens"] = case["segs"]["tokens"]
    s = case["storage"]
    if s == "v2-zarr":
        kw["engine"] = "zarr"
    elif s == "v3":
        kw["zarr_format"] = 3
    elif s == "v3-sharded":
        kw["zarr_format"] = 3
        kw["shard_examples"] = 2
    return kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(store_cases())
def test_every_read_equals_what_was_appended(case):
    rng = np.random.default_rng(case["seed"])
    tmp = tempfile.mkdtemp()
    try:
        path = f"{tmp}/s"
        logged = []  # per global example: {segment: (L, len, D) values}, in shard-major order
        kw = _writer_kwargs(case)
        L = len(case["layers"])
        for shard, batches in enumerate(case["writers"]):
            with ShardWriter(path, shard=shard, **kw) as w:
                for b in batches:
                    if case["multi"]:
                        arrays, lengths = {}, {}
                        for name, t_max in case["segs"].items():
                            t = int(rng.integers(1, t_max + 1))  # a batch may be shorter than T_max
                            arrays[name] = random_acts(rng, (b, L, t, case["d_model"]), case["dtype"])
                            lengths[name] = rng.integers(0, t + 1, size=b)
                        w.append(**arrays, lengths=lengths)
                        for i in range(b):
                            logged.append({n: arrays[n][i, :, : lengths[n][i]] for n in arrays})
                    else:
                        x = random_acts(rng, (b, L, case["segs"]["tokens"], case["d_model"]), case["dtype"])
                        w.append(x)
                        logged.extend({"tokens": x[i]} for i in range(b))
        actstore.finalize(path)
        store = ActStore(path)
        assert len(store) == len(logged)
        names = list(case["segs"])
        for ex, want in enumerate(logged):
            for k, layer in enumerate(case["layers"]):
                full = np.concatenate([want[n][k] for n in names], axis=0)
                got = store[ex, layer]
                exp = expected_view(full, case["dtype"])
                assert got.dtype == exp.dtype and got.shape == exp.shape
                assert got.tobytes() == exp.tobytes(), (ex, layer)
                for n in names:
                    seg = store.segment(n)[ex, layer]
                    assert seg.tobytes() == expected_view(want[n][k], case["dtype"]).tobytes()
            assert store.lengths(ex) == {n: want[n].shape[1] for n in names}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
