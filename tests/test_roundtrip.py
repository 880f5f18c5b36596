"""Property round trip: every store[ex, layer] equals what was appended, bit for bit."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from factory import examples, expected_view, random_acts, store_cases, writer_kwargs
from hypothesis import HealthCheck, given, settings

import actstore
from actstore import ActStore, ShardWriter


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(store_cases())
def test_every_read_equals_what_was_appended(case):
    rng = np.random.default_rng(case["seed"])
    tmp = tempfile.mkdtemp()
    try:
        path = f"{tmp}/s"
        logged = []  # per global example: {segment: (L, len, D) values}, in shard-major order
        kw = writer_kwargs(case)
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
