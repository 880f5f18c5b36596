"""The Zarr arrays of a writer shard, described (no I/O): names, shapes, chunks, dtypes,
dimension names, sharding and attributes of each layout (format 2 chunk files, format 3
with or without Zarr shard files). actstore.write.zarr_arrays creates them through zarr-python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.errors import CorruptStoreError
from actstore.layout import keys, spec
from actstore.layout.config import StoreConfig


@dataclass(frozen=True, kw_only=True)
class ArraySpec:
    """One array of a new shard (0 examples long)."""

    key: str  # relative to the shard
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    dims: tuple[str, ...]
    fill_value: Any = spec.FILL_VALUE
    shards: tuple[int, ...] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    activations: bool = False  # takes the writer's compressor (per-sample arrays never do)
    legacy_chunks: tuple[int, ...] | None = None  # the chunks older writers gave this array, read as well


def shard_arrays(cfg: StoreConfig) -> list[ArraySpec]:
    """Every array of a writer shard of this store, in creation order."""
    L, D = cfg.n_layers, cfg.d_model
    out = []
    for seg in cfg.segments:
        t_pad = seg.t_pad
        out.append(
            ArraySpec(
                key=keys.acts_array(seg.name),
                shape=(0, L, seg.t_max, D),
                chunks=(1, 1, seg.t_chunk, D),
                dtype=cfg.zarr_dtype,
                dims=(spec.EXAMPLE_DIM, spec.LAYER_DIM, spec.token_dim(seg.name), spec.D_MODEL_DIM),
                shards=(cfg.shard_examples, L, t_pad, D) if cfg.shard_examples is not None else None,
                attrs={"actstore_dtype": cfg.dtype, "layers": list(cfg.layers), "segment": seg.name},
                activations=True,
            )
        )
        out.append(per_sample(keys.len_array(seg.name), "<i4", (), (spec.EXAMPLE_DIM,)))
        if cfg.token_labels:
            out.append(
                per_sample(
                    keys.labels_array(seg.name), "|u1", (seg.t_max,), (spec.EXAMPLE_DIM, spec.token_dim(seg.name))
                )
            )
        if cfg.token_ids:
            out.append(
                per_sample(
                    keys.token_ids_array(seg.name),
                    spec.TOKEN_ID_DTYPE,
                    (seg.t_max,),
                    (spec.EXAMPLE_DIM, spec.token_dim(seg.name)),
                )
            )
    if cfg.zarr_format == 3:  # no stable fixed-length bytes type in Zarr v3: uint8 rows
        out.append(
            per_sample(
                keys.field_array(spec.SAMPLE_KEY),
                "|u1",
                (spec.SAMPLE_KEY_BYTES,),
                (spec.EXAMPLE_DIM, spec.SAMPLE_KEY_BYTE_DIM),
            )
        )
    else:
        out.append(per_sample(keys.field_array(spec.SAMPLE_KEY), f"|S{spec.SAMPLE_KEY_BYTES}", (), (spec.EXAMPLE_DIM,)))
    for name, dt in cfg.fields.items():
        out.append(per_sample(keys.field_array(name), dt, (), (spec.EXAMPLE_DIM,)))
    return out


def array_specs(cfg: StoreConfig) -> dict[str, ArraySpec]:
    """Every array of a writer shard by its key (relative to the shard)."""
    return {a.key: a for a in shard_arrays(cfg)}


def per_sample(key: str, dtype: str, tail: tuple[int, ...], dims: tuple[str, ...]) -> ArraySpec:
    """A per-sample array: chunked along examples, up to PER_SAMPLE_CHUNK rows of about
    PER_SAMPLE_CHUNK_BYTES (stores written before: of at most LEGACY_PER_SAMPLE_CHUNK_BYTES)."""
    row_bytes = max(1, int(np.prod(tail or (1,))) * np.dtype(dtype).itemsize)

    def rows(target: int) -> int:
        return max(1, min(spec.PER_SAMPLE_CHUNK, target // row_bytes))

    fill = b"" if np.dtype(dtype).kind == "S" else 0
    return ArraySpec(
        key=key,
        shape=(0, *tail),
        chunks=(rows(spec.PER_SAMPLE_CHUNK_BYTES), *tail),
        dtype=dtype,
        dims=dims,
        fill_value=fill,
        attrs={spec.EVERY_CHUNK_ATTR: True},
        legacy_chunks=(rows(spec.LEGACY_PER_SAMPLE_CHUNK_BYTES), *tail),
    )


def every_chunk(attrs: dict[str, Any]) -> bool:
    """Whether a per-sample array's attributes promise every chunk of its published rows on
    disk (spec.EVERY_CHUNK_ATTR): then a missing chunk is damage, not a chunk of zeros."""
    return attrs.get(spec.EVERY_CHUNK_ATTR) is True


def encode_keys(names: list[str], zarr_format: int) -> np.ndarray:
    """Sample keys as the `sample_key` array stores them (|S64, or (n, 64) uint8 in format 3)."""
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


def decode_keys(arr: np.ndarray, where: str = "the sample_key array") -> list[str]:
    """The strings of a `sample_key` array's rows; a key that is not UTF-8 (damage) raises
    CorruptStoreError naming `where`."""
    if arr.dtype == np.uint8:
        arr = (
            arr.reshape(-1).view(f"S{spec.SAMPLE_KEY_BYTES}") if arr.size else np.zeros(0, f"S{spec.SAMPLE_KEY_BYTES}")
        )
    try:
        return [k.decode("utf-8") for k in arr]
    except UnicodeDecodeError as e:
        raise CorruptStoreError(f"{where} holds a sample key that is not UTF-8 ({e}); the array is damaged") from None
