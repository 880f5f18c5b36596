"""A lazy xarray view of a whole store: `store.to_xarray()` (and, through
actstore.xarray_backend, `xarray.open_dataset(path, engine="actstore")`).

Nothing is read when the Dataset is made: each variable is an xarray BackendArray over the
store's public reading API, so indexing (`ds.activations.isel(example=3).sel(layer=6)`)
reads only the asked (example, layer) pairs, through `read_into` (actstore.read.select).

The Dataset:
- `activations` (example, layer, token, d_model): every stored layer; the token axis is
  the concatenation of the segments, each padded to its t_max as stored (zeros past an
  example's length); bfloat16 stores read as float32;
- coordinates `layer` (the model's layer numbers) and `layer_name` (the hooked module
  path capture records in attrs["hooks"], else "layer <n>"); with several segments the
  token coordinates `segment` (the segment of each position) and `position` (its index
  inside that segment);
- per example: `<segment>_len` (true lengths), `sample_key`, the per-sample fields, and
  `token_labels` (example, token) when the store records them (a field whose name is
  taken by one of these is called `field_<name>`);
- attrs: the store's metadata (`store.meta`), JSON-safe: nested objects as JSON text,
  None values left out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from actstore.layout import spec
from actstore.read.interface import Reader
from actstore.read.select import read_padded, select

ACTIVATIONS = "activations"
TOKEN_LABELS = "token_labels"
EXAMPLE, LAYER, TOKEN, D_MODEL = spec.AXES


def to_dataset(store: Reader, *, chunks: Any = None) -> xr.Dataset:
    """The whole store as a lazy xarray.Dataset (see the module docstring).

    Args:
        store: an ActStore or a SaevStore.
        chunks: optional dask chunks (e.g. {"example": 256}); needs dask installed. Without
            it the Dataset is lazy already: only what is indexed is read.
    """
    segs = tuple(store.config.segments)
    n, layers = len(store), tuple(int(x) for x in store.layers)
    t_total = sum(s.t_max for s in segs)
    exposed = np.dtype(np.float32) if store.dtype == "bfloat16" else np.dtype(spec.ACT_DTYPES[store.dtype])
    data_vars: dict[str, Any] = {
        ACTIVATIONS: _lazy(
            (EXAMPLE, LAYER, TOKEN, D_MODEL), _Activations(store, (n, len(layers), t_total, store.d_model), exposed)
        ),
    }
    for s in segs:
        name = s.name + spec.LEN_SUFFIX
        data_vars[name] = _lazy((EXAMPLE,), _PerSample(lambda s=s: store.segment(s.name).lengths(), (n,), np.int32))
    if store.config.token_labels:
        load = lambda: np.concatenate([store.field(s.name + spec.TOKEN_LABELS_SUFFIX) for s in segs], axis=1)
        data_vars[TOKEN_LABELS] = _lazy((EXAMPLE, TOKEN), _PerSample(load, (n, t_total), np.uint8))
    if spec.SAMPLE_KEY in store.field_names():  # an actstore store; a saev directory has no sample keys
        data_vars[spec.SAMPLE_KEY] = _lazy((EXAMPLE,), _PerSample(lambda: store.field(spec.SAMPLE_KEY), (n,), object))
    coords: dict[str, Any] = {
        LAYER: (LAYER, np.array(layers, dtype=np.int64)),
        "layer_name": (LAYER, layer_names(store)),
    }
    if len(segs) > 1:
        coords["segment"] = (TOKEN, np.concatenate([np.full(s.t_max, s.name, dtype=object) for s in segs]))
        coords["position"] = (TOKEN, np.concatenate([np.arange(s.t_max, dtype=np.int64) for s in segs]))
    for name, dt in store.config.fields.items():
        key = f"field_{name}" if name in data_vars or name in coords or name in spec.AXES else name
        data_vars[key] = _lazy((EXAMPLE,), _PerSample(lambda name=name: store.field(name), (n,), np.dtype(dt)))
    ds = xr.Dataset(data_vars, coords=coords, attrs=json_safe_attrs(store.meta))
    if chunks is not None:
        try:
            import dask  # noqa: F401
        except ImportError:
            raise ImportError(
                "to_xarray(chunks=...) needs dask (pip install dask); without chunks= the Dataset is lazy already: "
                "index it (.isel, .sel) and only the selection is read"
            ) from None
        ds = ds.chunk(chunks)
    return ds


def example_dataarray(store: Reader, ex: int, segment: str | None = None) -> xr.DataArray:
    """Example `ex` in memory as a DataArray (layer, token, d_model), padding removed.

    Coordinates: `layer` (model layer numbers), `token` (0..T_i-1) and `segment` (the
    segment of each token). `segment`: that segment only.
    """
    segs = tuple(store.config.segments) if segment is None else (store.config.segment(segment),)
    data = select(store, (ex, slice(None)), segments=segs)  # (L, T_i, D), one read per (layer, segment)
    lens = store.lengths(ex)
    seg_of_token = np.concatenate([np.full(lens[s.name], s.name, dtype=object) for s in segs])
    return xr.DataArray(
        data,
        dims=(LAYER, TOKEN, D_MODEL),
        coords={LAYER: list(store.layers), TOKEN: np.arange(data.shape[1]), "segment": (TOKEN, seg_of_token)},
        attrs={"example": ex, "model_id": store.config.model_id or "", "dtype": store.dtype},
    )


def layer_names(store: Reader) -> np.ndarray:
    """The model's name of each stored layer: capture's attrs["hooks"][str(n)], else "layer <n>"."""
    hooks = store.config.attrs.get("hooks")
    hooks = hooks if isinstance(hooks, dict) else {}
    return np.array([str(hooks.get(str(n), f"layer {n}")) for n in store.layers], dtype=object)


def json_safe_attrs(meta: dict[str, Any]) -> dict[str, Any]:
    """Attributes that any xarray writer accepts: str, numbers, bools and flat lists of them
    as they are, other JSON values as JSON text; None values are left out."""
    out: dict[str, Any] = {}
    for k, v in meta.items():
        if v is None:
            continue
        if isinstance(v, (str, int, float, bool)) or (
            isinstance(v, list) and all(isinstance(x, (str, int, float, bool)) for x in v)
        ):
            out[k] = v
        else:
            out[k] = json.dumps(v, sort_keys=True, default=str)
    return out


class _Activations(BackendArray):
    """(example, layer, token, d_model) over read_padded: reads only the indexed pairs, and
    of those only the segments whose tokens are asked for."""

    def __init__(self, store: Reader, shape: tuple[int, int, int, int], dtype: np.dtype):
        self.store, self.shape, self.dtype = store, shape, dtype
        self._seg_bounds = np.cumsum([0] + [s.t_max for s in store.config.segments])

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.OUTER, self._raw)

    def __deepcopy__(self, memo: dict) -> _Activations:
        return self  # read-only: xarray's deep copies (where, copy) need not reopen the store

    def _raw(self, key: tuple[Any, ...]) -> np.ndarray:
        ex_k, layer_k, tok_k, d_k = key
        exs = np.arange(self.shape[0])[ex_k]
        layers = np.asarray(self.store.layers)[layer_k]
        toks = np.arange(self.shape[2])[tok_k]
        lo, hi = self._seg_bounds[:-1], self._seg_bounds[1:]
        tok_arr = np.atleast_1d(toks)
        needed = [bool(((tok_arr >= a) & (tok_arr < b)).any()) for a, b in zip(lo, hi)]
        data = read_padded(self.store, np.atleast_1d(exs), np.atleast_1d(layers).tolist(), needed)
        data = data[:, :, tok_k] if isinstance(tok_k, slice) else data[:, :, np.atleast_1d(tok_k)]
        data = data[..., d_k] if isinstance(d_k, slice) else data[..., np.atleast_1d(d_k)]
        drop = tuple(ax for ax, k in enumerate(key) if isinstance(k, (int, np.integer)))
        return data.reshape([s for ax, s in enumerate(data.shape) if ax not in drop]) if drop else data


class _PerSample(BackendArray):
    """A per-example array, loaded whole (from every shard) on first access and kept."""

    def __init__(self, load: Callable[[], np.ndarray], shape: tuple[int, ...], dtype: Any):
        self._load, self.shape, self.dtype = load, shape, np.dtype(dtype)
        self._data: np.ndarray | None = None

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.OUTER, self._raw)

    def __deepcopy__(self, memo: dict) -> _PerSample:
        return self  # read-only, as _Activations

    def _raw(self, key: tuple[Any, ...]) -> np.ndarray:
        if self._data is None:
            self._data = np.asarray(self._load()).astype(self.dtype, copy=False).reshape(self.shape)
        return self._data[key]


def _lazy(dims: tuple[str, ...], array: BackendArray) -> xr.Variable:
    return xr.Variable(dims, indexing.LazilyIndexedArray(array))
