"""zarr-python plumbing: a new writer shard's arrays, as actstore.layout.arrays describes
them, created through any zarr store."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from actstore.layout.arrays import decode_keys, encode_keys, shard_arrays
from actstore.layout.config import StoreConfig

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

__all__ = ["check_compressor", "create_shard_arrays", "decode_keys", "encode_keys", "every_chunk"]


def check_compressor(compressor: Any, zarr_format: int) -> None:
    """Refuse a compressor that zarr-python cannot use for this Zarr format, before anything
    of the shard is written: format 2 takes a numcodecs codec, format 3 a bytes-to-bytes
    codec of zarr.codecs."""
    if compressor is None:
        return
    if zarr_format == 2:
        from numcodecs.abc import Codec

        if not isinstance(compressor, Codec):
            raise ValueError(
                f"compressor {compressor!r} is not a numcodecs codec; a Zarr format 2 store takes one "
                "(e.g. numcodecs.Zstd()), or pass zarr_format=3 for zarr.codecs.ZstdCodec()"
            )
        return
    from zarr.abc.codec import BytesBytesCodec

    if not isinstance(compressor, BytesBytesCodec):
        raise ValueError(
            f"compressor {compressor!r} is not a Zarr v3 bytes-to-bytes codec; a Zarr format 3 store takes one "
            "(e.g. zarr.codecs.ZstdCodec()); numcodecs codecs (numcodecs.Zstd()) go with zarr_format=2"
        )


def create_shard_arrays(group: Any, cfg: StoreConfig, compressor: Any = None) -> None:
    """Create every array of an empty shard (shape 0 along examples) in `group`."""
    v3 = cfg.zarr_format == 3
    for a in shard_arrays(cfg):
        kw: dict[str, Any] = {"fill_value": a.fill_value}
        if a.activations:
            if not v3:
                kw["filters"] = None
            kw["compressors"] = compressor
        else:
            kw["compressors"] = None
        if a.shards is not None:
            kw["shards"] = a.shards
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group.create_array(a.key, shape=a.shape, chunks=a.chunks, dtype=a.dtype, **kw, **_dims(v3, a.dims, a.attrs))


def every_chunk(group: Any, name: str) -> Any:
    """Array `name` of `group`, writing every chunk it is given, zeros included (Zarr omits
    chunks equal to the fill value by default): per-sample arrays promise it
    (spec.EVERY_CHUNK_ATTR), so a reader can tell a deleted chunk from one of zeros."""
    array = group[name]
    if hasattr(array, "with_config"):  # zarr >= 3.1.6
        return array.with_config({"write_empty_chunks": True})
    import zarr  # older: an array takes the global default when it is opened

    with zarr.config.set({"array.write_empty_chunks": True}):
        return group[name]


def _dims(v3: bool, dims: tuple[str, ...], attrs: dict[str, Any]) -> dict[str, Any]:
    """create_array keywords for `attrs` and dimension names the way xarray reads them:
    `dimension_names` in format 3, the `_ARRAY_DIMENSIONS` attribute in format 2."""
    attrs = dict(attrs)
    if not v3:
        attrs["_ARRAY_DIMENSIONS"] = list(dims)
    out: dict[str, Any] = {"attributes": attrs} if attrs else {}
    if v3:
        out["dimension_names"] = dims
    return out


def write_consolidated(zarr_store: ZarrStore) -> None:
    """Consolidated metadata of a finished shard (.zmetadata for v2; in zarr.json for v3),
    into the shard's zarr store (its buffered metadata, written out by the commit)."""
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(zarr_store)
