"""xarray: `store.to_xarray()` (lazy, whole store), `xarray.open_dataset(engine="actstore")`,
and `xarray.open_zarr` on one writer shard (dimension names on disk)."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import xarray as xr
from factory import LAYOUTS, random_acts

import actstore
from actstore import ActStore, ShardWriter
from actstore.layout import spec
from actstore.layout.arrays import decode_keys

LAYERS = [2, 5, 9]
HOOKS = {"2": "model.layers.2", "5": "model.layers.5"}  # layer 9 unnamed: falls back to "layer 9"


def _qa_store(path, dtype="float32", **kw):
    """Two shards (4 + 3 examples), prompt (5 tokens in chunks of 2) + response (3), labels, a field."""
    rng = np.random.default_rng(7)
    for shard, n in enumerate((4, 3)):
        with ShardWriter(
            path,
            shard=shard,
            layers=LAYERS,
            d_model=4,
            segments={"prompt": 5, "response": 3},
            t_chunk={"prompt": 2, "response": 3},
            dtype=dtype,
            fields={"label": "int16"},
            token_labels=True,
            model_id="tiny/qa",
            attrs={"hooks": HOOKS, "dataset": "unit", "note": None},
            **kw,
        ) as w:
            w.append(
                prompt=random_acts(rng, (n, 3, 5, 4), dtype),
                response=random_acts(rng, (n, 3, 3, 4), dtype),
                lengths={"prompt": rng.integers(0, 6, n), "response": rng.integers(0, 4, n)},
                sample_keys=[f"k{shard}-{i}" for i in range(n)],
                fields={"label": np.arange(n) + 10 * shard},
                token_labels={
                    "prompt": rng.integers(0, 3, (n, 5)).astype(np.uint8),
                    "response": rng.integers(0, 3, (n, 3)).astype(np.uint8),
                },
            )
    actstore.finalize(path)
    return ActStore(path)


def _padded_all(store):
    """The eager (example, layer, token, d_model) array the Dataset stands for."""
    return np.stack(
        [
            np.stack(
                [np.concatenate([store.segment(s).padded(ex, layer) for s in store.segments]) for layer in store.layers]
            )
            for ex in range(len(store))
        ]
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def qa(request, tmp_path_factory):
    return _qa_store(tmp_path_factory.mktemp(request.param) / "s", **LAYOUTS[request.param])


def _counting(monkeypatch, store):
    calls = []
    real = store.read_into
    monkeypatch.setattr(store, "read_into", lambda *a: calls.append(a[:3]) or real(*a))
    return calls


def test_nothing_is_read_until_indexed(qa, monkeypatch):
    calls = _counting(monkeypatch, qa)
    ds = qa.to_xarray()
    repr(ds)
    sub = ds.activations.isel(example=slice(1, 5)).sel(layer=[5, 9])
    assert calls == [] and sub.shape == (4, 2, 8, 4)
    x = ds.activations.isel(example=3).sel(layer=5).values
    assert calls == [(3, 5, "prompt"), (3, 5, "response")]
    np.testing.assert_array_equal(
        x, np.concatenate([qa.segment("prompt").padded(3, 5), qa.segment("response").padded(3, 5)])
    )
    calls.clear()
    r = ds.activations.isel(example=6, layer=0).where(ds.segment == "response", drop=True).values
    assert calls == [(6, 2, "response")]  # only the segment whose tokens are asked for
    np.testing.assert_array_equal(r, qa.segment("response").padded(6, 2))


def test_values_dims_and_coordinates(qa):
    ds = qa.to_xarray()
    a = ds.activations
    assert a.dims == spec.AXES and a.shape == (7, 3, 8, 4) and a.dtype == np.float32
    assert list(ds.layer.values) == LAYERS
    assert list(ds.layer_name.values) == ["model.layers.2", "model.layers.5", "layer 9"]
    assert list(ds.segment.values) == ["prompt"] * 5 + ["response"] * 3
    assert list(ds.position.values) == [0, 1, 2, 3, 4, 0, 1, 2]
    want = _padded_all(qa)
    np.testing.assert_array_equal(a.values, want)
    # Outer and vectorised selections equal numpy's on the eager array.
    np.testing.assert_array_equal(
        a.isel(example=[6, 0, 6], layer=[2, 0], token=slice(3, 7), d_model=[3, 1]).values,
        want[[6, 0, 6]][:, [2, 0]][:, :, 3:7][..., [3, 1]],
    )
    np.testing.assert_array_equal(a[-1, 1, 4, 2].values, want[-1, 1, 4, 2])
    pts = xr.DataArray([0, 4, 5], dims="p")
    np.testing.assert_array_equal(
        a.isel(example=pts, layer=xr.DataArray([2, 1, 0], dims="p")).values, want[[0, 4, 5], [2, 1, 0]]
    )
    # Each example's true tokens are what store[ex, layer] returns.
    for ex in range(len(qa)):
        lens = qa.lengths(ex)
        keep = ((ds.segment == "prompt") & (ds.position < lens["prompt"])) | (
            (ds.segment == "response") & (ds.position < lens["response"])
        )
        np.testing.assert_array_equal(a.isel(example=ex).sel(layer=9).values[keep.values], qa[ex, 9])
    np.testing.assert_array_equal(ds.prompt_len.values, qa.segment("prompt").lengths())
    np.testing.assert_array_equal(ds.response_len.values, qa.segment("response").lengths())
    assert list(ds.sample_key.values) == [f"k{s}-{i}" for s, n in ((0, 4), (1, 3)) for i in range(n)]
    np.testing.assert_array_equal(ds.label.values, qa.field("label"))
    assert ds.label.dtype == np.int16
    labels = np.concatenate([qa.field("prompt_token_labels"), qa.field("response_token_labels")], axis=1)
    np.testing.assert_array_equal(ds.token_labels.values, labels)
    assert ds.token_labels.dims == ("example", "token")


def test_attrs_are_json_safe(qa):
    attrs = qa.to_xarray().attrs
    assert attrs["model_id"] == "tiny/qa" and attrs["dtype"] == "float32" and attrs["dataset"] == "unit"
    assert attrs["layers"] == LAYERS and json.loads(attrs["hooks"]) == HOOKS and "note" not in attrs
    assert json.loads(attrs["segments"])["prompt"] == {"t_max": 5, "t_chunk": 2, "fixed": False}
    json.dumps(attrs)


def test_one_segment_bfloat16_and_saev(tmp_path):
    rng = np.random.default_rng(3)
    x = random_acts(rng, (5, 2, 6, 4), "bfloat16")
    with ShardWriter(tmp_path / "bf", layers=[0, 3], d_model=4, tokens=6, dtype="bfloat16", zarr_format=3) as w:
        w.append(x)
    actstore.finalize(tmp_path / "bf")
    store = ActStore(tmp_path / "bf")
    ds = store.to_xarray()
    assert (
        ds.activations.dtype == np.float32
        and "segment" not in ds.coords
        and list(ds.layer_name.values) == ["layer 0", "layer 3"]
    )
    np.testing.assert_array_equal(ds.activations.values, x)
    np.testing.assert_array_equal(ds.tokens_len.values, np.full(5, 6))
    from actstore.saev import export_saev

    res = export_saev(
        store,
        tmp_path / "dump",
        protocol="2.0",
        patches_per_shard=24,
        cls="none",
        family="dinov2",
        ckpt="facebook/dinov2-small",
        dataset="/d",
        progress=False,
    )
    sds = actstore.open(res.path).to_xarray()
    np.testing.assert_array_equal(sds.activations.values, x)
    assert "sample_key" not in sds and sds.attrs["saev_protocol"] == "2.0"
    np.testing.assert_array_equal(xr.open_dataset(res.path, engine="actstore").activations.values, x)


def test_open_dataset_engine(qa, monkeypatch):
    calls = []
    real = ActStore.read_into
    monkeypatch.setattr(ActStore, "read_into", lambda self, *a: calls.append(a[:3]) or real(self, *a))
    ds = xr.open_dataset(qa.path, engine="actstore")
    assert calls == []
    x = ds.activations.isel(example=2).sel(layer=2).values
    assert calls == [(2, 2, "prompt"), (2, 2, "response")]
    np.testing.assert_array_equal(x, qa.to_xarray().activations.isel(example=2).sel(layer=2).values)
    assert list(ds.layer_name.values) == ["model.layers.2", "model.layers.5", "layer 9"]
    assert "label" not in xr.open_dataset(qa.path, engine="actstore", drop_variables=["label"])
    assert xr.open_dataset(qa.path, engine="actstore", verify="deep").sizes["example"] == 7
    xr.testing.assert_identical(xr.open_dataset(qa.path).load(), qa.to_xarray().load())  # the engine is guessed


def test_chunks_need_dask(qa):
    if importlib.util.find_spec("dask") is None:
        with pytest.raises(ImportError, match=r"to_xarray\(chunks=...\) needs dask \(pip install dask\)"):
            qa.to_xarray(chunks={"example": 2})
    else:
        ds = qa.to_xarray(chunks={"example": 2})
        assert ds.activations.chunks[0] == (2, 2, 2, 1)
        np.testing.assert_array_equal(ds.activations.values, _padded_all(qa))


def test_one_example_dataarray_is_unchanged(qa):
    da = qa.to_xarray(4)
    assert da.dims == ("layer", "token", "d_model") and list(da.layer.values) == LAYERS
    np.testing.assert_array_equal(da.sel(layer=5).values, qa[4, 5])
    lens = qa.lengths(4)
    assert list(da.segment.values) == ["prompt"] * lens["prompt"] + ["response"] * lens["response"]
    np.testing.assert_array_equal(qa.to_xarray(4, "response").sel(layer=2).values, qa.segment("response")[4, 2])
    with pytest.raises(TypeError, match="segment= goes with an example"):
        qa.to_xarray(segment="prompt")


# ---- one writer shard through xarray.open_zarr -------------------------------------------


@pytest.mark.parametrize("consolidated", [True, False])
def test_open_zarr_on_a_shard(qa, consolidated):
    shard_dir = qa.path / "shards" / "shard-00001.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr-python warns about v3 consolidated metadata
        ds = xr.open_zarr(shard_dir, group="arrays", consolidated=consolidated)
    assert ds.prompt_activations.dims == ("example", "layer", "prompt_token", "d_model")
    assert ds.response_activations.dims == ("example", "layer", "response_token", "d_model")
    assert ds.prompt_token_labels.dims == ("example", "prompt_token") and ds.label.dims == ("example",)
    for local in range(3):
        ex = 4 + local  # shard 1 holds examples 4..6
        for lp, layer in enumerate(LAYERS):
            for s in ("prompt", "response"):
                np.testing.assert_array_equal(ds[f"{s}_activations"][local, lp].values, qa.segment(s).padded(ex, layer))
    np.testing.assert_array_equal(ds.prompt_len.values, qa.segment("prompt").lengths()[4:])
    np.testing.assert_array_equal(ds.label.values, qa.field("label")[4:])
    keys = ds.sample_key.values
    assert decode_keys(keys) == ["k1-0", "k1-1", "k1-2"]
    assert ds.sample_key.dims == (("example", "sample_key_byte") if qa.config.zarr_format == 3 else ("example",))


def test_token_dim_names():
    assert spec.token_dim("tokens") == "token" and spec.token_dim("prompt") == "prompt_token"


def test_stores_without_dimension_names_still_read(qa, tmp_path):
    """Strip every dimension name (as stores written before them) and read the same values."""
    import shutil

    root = tmp_path / "old"
    shutil.copytree(qa.path, root)
    for meta in list(root.rglob(".zattrs")) + list(root.rglob(".zmetadata")) + list(root.rglob("zarr.json")):
        os_mode = meta.stat().st_mode
        meta.chmod(0o644)
        doc = json.loads(meta.read_text())
        meta.write_text(json.dumps(_strip(doc)))
        meta.chmod(os_mode)
    old = ActStore(root, verify="fast")
    for ex in range(len(qa)):
        np.testing.assert_array_equal(old[ex, 9], qa[ex, 9])
    np.testing.assert_array_equal(old.to_xarray().activations.values, _padded_all(qa))


def _strip(doc):
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in ("_ARRAY_DIMENSIONS", "dimension_names")}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc
