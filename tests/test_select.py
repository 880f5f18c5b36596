"""Selections by slices and lists (actstore.read.select): every key checked against
`store[ex, layer]`, for fixed and padded segments, every dtype and layout, and saev dirs."""

from __future__ import annotations

import numpy as np
import pytest
from factory import examples, random_acts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import ZstdCodec

import actstore
from actstore import ActStore, ShardWriter
from actstore.errors import ExampleIndexError, LayerNotFoundError

LAYERS = (2, 5, 9)


def _fixed(path, dtype="float16", **kw):
    """Two shards of 4 + 3 examples, one fixed segment of 10 tokens in chunks of 4 (padded to 12)."""
    rng = np.random.default_rng(0)
    for shard, n in enumerate((4, 3)):
        with ShardWriter(
            path, shard=shard, layers=list(LAYERS), d_model=5, tokens=10, t_chunk=4, dtype=dtype, **kw
        ) as w:
            w.append(random_acts(rng, (n, 3, 10, 5), dtype))
    actstore.finalize(path)
    return ActStore(path)


def _padded(path, **kw):
    """Two shards, prompt (6 tokens in chunks of 4) then response (3), lengths 0..max."""
    rng = np.random.default_rng(1)
    for shard, n in enumerate((5, 4)):
        with ShardWriter(
            path,
            shard=shard,
            layers=list(LAYERS),
            d_model=3,
            segments={"prompt": 6, "response": 3},
            t_chunk={"prompt": 4, "response": 3},
            dtype="float32",
            **kw,
        ) as w:
            w.append(
                prompt=random_acts(rng, (n, 3, 6, 3), "float32"),
                response=random_acts(rng, (n, 3, 3, 3), "float32"),
                lengths={"prompt": rng.integers(0, 7, n), "response": rng.integers(0, 4, n)},
            )
    actstore.finalize(path)
    return ActStore(path)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from actstore.saev import export_saev

    tmp = tmp_path_factory.mktemp("select")
    out = {
        "fixed": _fixed(tmp / "fixed"),
        "bf16-v3-sharded": _fixed(tmp / "bf16", dtype="bfloat16", zarr_format=3, shard_examples=2),
        "padded": _padded(tmp / "padded"),
        "padded-v3-zstd": _padded(tmp / "zstd", zarr_format=3, compressor=ZstdCodec(level=1)),
    }
    res = export_saev(
        out["fixed"],
        tmp / "dump",
        protocol="2.0",
        patches_per_shard=60,
        cls="none",
        family="dinov2",
        ckpt="facebook/dinov2-small",
        dataset="/d",
        progress=False,
    )
    out["saev"] = actstore.open(res.path)
    return out


def _example_keys(n):
    idx = st.integers(-n, n - 1)
    bound = st.none() | st.integers(-n - 2, n + 2)
    step = st.none() | st.integers(-3, 3).filter(lambda s: s != 0)
    return st.one_of(
        idx,
        idx.map(np.int64),
        st.builds(slice, bound, bound, step),
        st.lists(idx, max_size=6),
        st.lists(idx, max_size=6).map(lambda xs: np.array(xs, dtype=np.int32)),
    )


def _layer_keys():
    layer = st.sampled_from(LAYERS)
    num = st.none() | st.integers(0, 12)
    return st.one_of(
        layer,
        st.just(slice(None)),
        st.lists(layer, max_size=4),
        st.builds(slice, num, num, st.none() | st.integers(1, 3)),
    )


def _expected_examples(key, n):
    return [int(x) for x in np.atleast_1d(np.arange(n)[key])]


def _expected_layers(key):
    if isinstance(key, slice):
        start = min(LAYERS) if key.start is None else key.start
        stop = max(LAYERS) + 1 if key.stop is None else key.stop
        return [x for x in LAYERS if x in range(start, stop, key.step or 1)]
    return list(key) if isinstance(key, list) else [key]


def _pairs(store, read):
    """Every pairwise read `read((ex, layer))` of the store, made once: the reference each
    selection is checked against (the store is only read, so a pair reads the same each time)."""
    return {(ex, layer): read((ex, layer)) for ex in range(len(store)) for layer in LAYERS}


def _check(store, key, read, pairs):
    got = read(key)
    ex_key, layer_key = key
    exs, layers = _expected_examples(ex_key, len(store)), _expected_layers(layer_key)
    one_ex = isinstance(ex_key, (int, np.integer))
    one_layer = not isinstance(layer_key, (slice, list))

    def want(ex):
        per = [pairs[ex, layer] for layer in layers]
        if one_layer:
            return per[0]
        return np.stack(per) if per else np.zeros((0, *pairs[ex, LAYERS[0]].shape))

    fixed = all(s.fixed for s in store.config.segments)
    if one_ex:
        assert isinstance(got, np.ndarray)
        _same(got, want(exs[0]))
    elif fixed:
        assert isinstance(got, np.ndarray)
        t = sum(s.t_max for s in store.config.segments)
        shape = (len(exs), t, store.d_model) if one_layer else (len(exs), len(layers), t, store.d_model)
        assert got.shape == shape
        for i, ex in enumerate(exs):
            _same(got[i], want(ex))
    else:
        assert isinstance(got, list) and len(got) == len(exs)
        for g, ex in zip(got, exs):
            _same(g, want(ex))


def _same(got, want):
    assert got.shape == want.shape
    if want.size:
        assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["fixed", "bf16-v3-sharded", "padded", "padded-v3-zstd", "saev"])
def test_every_key_equals_the_pairwise_reads(stores, kind):
    store = stores[kind]
    pairs = _pairs(store, store.__getitem__)

    @settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ex_key=_example_keys(len(store)), layer_key=_layer_keys())
    def run(ex_key, layer_key):
        _check(store, (ex_key, layer_key), store.__getitem__, pairs)

    run()


@pytest.mark.parametrize("kind", ["padded", "padded-v3-zstd"])
def test_segment_views_select_one_segment(stores, kind):
    store = stores[kind]
    views = {name: store.segment(name).__getitem__ for name in store.segments}
    pairs = {name: _pairs(store, read) for name, read in views.items()}

    @settings(max_examples=examples(80), deadline=None)
    @given(name=st.sampled_from(store.segments), ex_key=_example_keys(len(store)), layer_key=_layer_keys())
    def run(name, ex_key, layer_key):
        _check(store, (ex_key, layer_key), views[name], pairs[name])

    run()


def test_result_types_and_shapes(stores):
    fixed, padded = stores["fixed"], stores["padded"]
    assert fixed[0:100, 5].shape == (7, 10, 5) and fixed[[3, 3], :].shape == (2, 3, 10, 5)
    assert fixed[2, :].shape == (3, 10, 5) and fixed[2, [9]].shape == (1, 10, 5)
    assert fixed[2:2, 5].shape == (0, 10, 5) and fixed[1, []].shape == (0, 10, 5)
    assert fixed[0, 4:10].shape == (2, 10, 5)  # layers 5 and 9: numbers, not positions
    np.testing.assert_array_equal(fixed[np.int64(-1), np.int64(9)], fixed[6, 9])
    assert fixed[[0, 1], 5].flags.c_contiguous  # one buffer, no gaps: the result is the buffer
    lens = [sum(padded.lengths(ex).values()) for ex in range(len(padded))]
    got = padded[:, 9]
    assert isinstance(got, list) and [g.shape for g in got] == [(t, 3) for t in lens]
    assert padded[4, :].shape == (3, lens[4], 3) and padded[[], 9] == []
    assert stores["bf16-v3-sharded"][0:3, :].dtype == np.float32


def test_each_pair_is_read_once_into_one_buffer(stores, monkeypatch):
    store = stores["padded"]
    calls = []
    real = store.read_into
    monkeypatch.setattr(store, "read_into", lambda *a: calls.append(a[:3]) or real(*a))
    store[[1, 7, 1], [9, 2]]
    assert calls == [(ex, layer, seg) for ex in (1, 7, 1) for layer in (9, 2) for seg in ("prompt", "response")]


def test_clear_errors(stores):
    store = stores["padded"]
    with pytest.raises(ExampleIndexError, match=r"example 9 is out of range: this store holds 9 examples \(0..8\)"):
        store[9, :]
    with pytest.raises(
        ExampleIndexError, match=r"example -10 \(item 1 of the list\) is out of range: this store holds 9 examples"
    ):
        store[[0, -10], 2]
    with pytest.raises(LayerNotFoundError, match=r"layer 3 is not stored; this store holds layers \[2, 5, 9\]"):
        store[0:2, [2, 3]]
    with pytest.raises(LayerNotFoundError, match=r"layer 4 is not stored"):
        store[[0], 4]
    with pytest.raises(ValueError, match="step must be positive, got -1"):
        store[0, ::-1]
    with pytest.raises(TypeError, match=r"np.flatnonzero\(mask\)"):
        store[np.ones(9, bool), 2]
    with pytest.raises(TypeError, match="examples must be an int, a slice or a list / 1-D array of ints"):
        store[[0.5], 2]
    with pytest.raises(TypeError, match="examples must be"):
        store[np.zeros((2, 2), int), 2]
    with pytest.raises(TypeError, match=r"layer 2.0 is not a layer: give a stored layer number \(an int\)"):
        store[0, [2.0]]
    with pytest.raises(TypeError, match=r"index the store as store\[examples, layers\]"):
        store[0:3]
    with pytest.raises(TypeError, match="example slices take ints"):
        store["a":, 2]
