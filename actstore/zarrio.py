"""zarr-python plumbing: the arrays of a new writer shard (names, shapes, chunks, codecs,
dimension names), created through any zarr store; sample keys to and from their bytes."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from actstore.layout import keys, spec
from actstore.layout.config import StoreConfig


def create_shard_arrays(group: Any, cfg: StoreConfig, compressor: Any = None) -> None:
    """Create every array of an empty shard (shape 0 along examples)."""
    L, D = cfg.n_layers, cfg.d_model
    v3 = cfg.zarr_format == 3
    common: dict[str, Any] = {"fill_value": spec.FILL_VALUE}
    if not v3:
        common["filters"] = None
    comp = {"compressors": compressor} if compressor is not None else {"compressors": None}
    for seg in cfg.segments:
        t_pad = seg.n_chunks * seg.t_chunk
        kw: dict[str, Any] = dict(common, **comp)
        if cfg.shard_examples is not None:
            kw["shards"] = (cfg.shard_examples, L, t_pad, D)
        attrs = {"actstore_dtype": cfg.dtype, "layers": list(cfg.layers), "segment": seg.name}
        group.create_array(
            keys.acts_array(seg.name),
            shape=(0, L, seg.t_max, D),
            chunks=(1, 1, seg.t_chunk, D),
            dtype=cfg.zarr_dtype,
            **_dims(v3, (spec.EXAMPLE_DIM, spec.LAYER_DIM, spec.token_dim(seg.name), spec.D_MODEL_DIM), attrs),
            **kw,
        )
        per_sample(group, keys.len_array(seg.name), "<i4", (), dims=(spec.EXAMPLE_DIM,))
        if cfg.token_labels:
            per_sample(group, keys.labels_array(seg.name), "|u1", (seg.t_max,), dims=(spec.EXAMPLE_DIM, spec.token_dim(seg.name)))
    if v3:
        per_sample(group, keys.field_array(spec.SAMPLE_KEY), "|u1", (spec.SAMPLE_KEY_BYTES,),
                   dims=(spec.EXAMPLE_DIM, spec.SAMPLE_KEY_BYTE_DIM))
    else:
        per_sample(group, keys.field_array(spec.SAMPLE_KEY), f"|S{spec.SAMPLE_KEY_BYTES}", (), dims=(spec.EXAMPLE_DIM,))
    for name, dt in cfg.fields.items():
        per_sample(group, keys.field_array(name), dt, (), dims=(spec.EXAMPLE_DIM,))


def _dims(v3: bool, dims: tuple[str, ...] | None, attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    """create_array keywords for `attrs` and dimension names the way xarray reads them:
    `dimension_names` in format 3, the `_ARRAY_DIMENSIONS` attribute in format 2."""
    attrs = dict(attrs or {})
    if dims is not None and not v3:
        attrs["_ARRAY_DIMENSIONS"] = list(dims)
    out: dict[str, Any] = {"attributes": attrs} if attrs else {}
    if dims is not None and v3:
        out["dimension_names"] = dims
    return out


def per_sample(
    group: Any, name: str, dtype: str, tail: tuple[int, ...], dims: tuple[str, ...] | None = None
) -> Any:
    rows = max(1, min(spec.PER_SAMPLE_CHUNK, (4 * 2**20) // max(1, int(np.prod(tail or (1,))) * np.dtype(dtype).itemsize)))
    fill = b"" if np.dtype(dtype).kind == "S" else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return group.create_array(
            name, shape=(0, *tail), chunks=(rows, *tail), dtype=dtype, compressors=None, fill_value=fill,
            **_dims(group.metadata.zarr_format == 3, dims),
        )


def encode_keys(names: list[str], zarr_format: int) -> np.ndarray:
    raw = [k.encode("utf-8") for k in names]
    long = [k for k in raw if len(k) > spec.SAMPLE_KEY_BYTES]
    if long:
        raise ValueError(
            f"sample_key {long[0][:80]!r}... has {len(long[0])} bytes; keys hold at most "
            f"{spec.SAMPLE_KEY_BYTES} UTF-8 bytes (use a hash such as sha256 hex)"
        )
    arr = np.array(raw, dtype=f"S{spec.SAMPLE_KEY_BYTES}")
    if zarr_format == 3:
        return arr.view(np.uint8).reshape(len(raw), spec.SAMPLE_KEY_BYTES)
    return arr


def decode_keys(arr: np.ndarray) -> list[str]:
    if arr.dtype == np.uint8:
        arr = arr.reshape(-1).view(f"S{spec.SAMPLE_KEY_BYTES}") if arr.size else np.zeros(0, f"S{spec.SAMPLE_KEY_BYTES}")
    return [k.decode("utf-8") for k in arr]
