"""Chunk geometry of an activation array: which key holds which bytes (no I/O).

The Zarr specs define the bytes: an uncompressed chunk is its C-order elements, little
endian, always of full chunk size (edge chunks padded); a missing chunk is the fill value.
A v3 shard (sharding_indexed, index at the end) is the inner chunks followed by an index of
(offset, nbytes) little-endian uint64 pairs, one per inner chunk in C order, with
2**64-1 for an empty chunk, then (usually) a crc32c of the index. Readers and writers
that bypass zarr-python use exactly these bytes, so both read each other's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from actstore.errors import CorruptChunkError

EMPTY = np.uint64(2**64 - 1)


@dataclass(frozen=True, kw_only=True)
class ChunkGeometry:
    """Geometry and key naming of one activation array of raw (1, 1, T_chunk, D) chunks.

    Keys are relative to the shard (e.g. `arrays/tokens_activations/3.0.0.0`).
    """

    array: str
    zarr_format: int
    separator: str
    n_layers: int
    n_tchunks: int
    t_chunk: int
    d_model: int
    dtype: np.dtype
    shard_examples: int | None = None
    index_crc: bool = True

    @property
    def chunk_nbytes(self) -> int:
        return self.t_chunk * self.d_model * self.dtype.itemsize

    @property
    def prefix(self) -> str:
        return self.array + ("/c" + self.separator if self.zarr_format == 3 else "/")

    def chunk_key(self, ex: int, layer_pos: int, tc: int) -> str:
        """Key of the chunk (unsharded) holding (ex, layer_pos, token chunk tc)."""
        s = self.separator
        return f"{self.prefix}{ex}{s}{layer_pos}{s}{tc}{s}0"

    def shard_key(self, ex: int) -> str:
        """Key of the Zarr shard file holding example `ex` (sharded arrays)."""
        s = self.separator
        return f"{self.prefix}{ex // self.shard_examples}{s}0{s}0{s}0"

    @property
    def index_nbytes(self) -> int:
        """Bytes of a shard file's index (with its crc32c)."""
        return 16 * self.shard_examples * self.n_layers * self.n_tchunks + (4 if self.index_crc else 0)

    def encode_index(self, n: int) -> bytes:
        """The index of a shard file whose first `n` examples are stored densely, in order."""
        from crc32c import crc32c

        per_ex = self.n_layers * self.n_tchunks
        k = n * per_ex
        index = np.full((self.shard_examples * per_ex, 2), EMPTY, dtype="<u8")
        index[:k, 0] = np.arange(k, dtype=np.uint64) * np.uint64(self.chunk_nbytes)
        index[:k, 1] = self.chunk_nbytes
        raw = index.tobytes()
        return raw + crc32c(raw).to_bytes(4, "little") if self.index_crc else raw

    def decode_index(self, raw: bytes, data_nbytes: int, where: str) -> np.ndarray:
        """(S, L, n_tchunks, 2) (offset, nbytes) of a shard file's index; damage raises."""
        if self.index_crc:
            from crc32c import crc32c

            if crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
                raise CorruptChunkError(f"shard file {where} has a damaged index (crc32c mismatch)")
            raw = raw[:-4]
        index = np.frombuffer(raw, dtype="<u8").reshape(self.shard_examples, self.n_layers, self.n_tchunks, 2)
        used = index[..., 0] != EMPTY
        if used.any() and int((index[..., 0] + index[..., 1])[used].max()) > data_nbytes:
            raise CorruptChunkError(f"shard file {where} has an index that points past the end of its data")
        return index

    def chunk_keys_of(self, ex: int, layer_pos: int) -> list[str]:
        """The keys holding (ex, layer_pos): one per token chunk, or its shard file."""
        if self.shard_examples is not None:
            return [self.shard_key(ex)]
        return [self.chunk_key(ex, layer_pos, tc) for tc in range(self.n_tchunks)]


def parse_chunk_key(rel: str, zarr_format: int, separator: str, ndim: int = 4) -> tuple[int, ...] | None:
    """Chunk grid coordinates of a key relative to an `ndim`-d array's folder (for an
    activation array (example, layer, token chunk, d_model chunk): `3.0.1.0`, `c/3/0/1/0`),
    or None when it names no chunk. For a Zarr-sharded array: the shard file's."""
    if zarr_format == 3:
        if not rel.startswith("c" + separator):
            return None
        rel = rel[2:]
    if separator == "." and "/" in rel:
        return None
    parts = rel.split(separator)
    if len(parts) != ndim or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def row_chunk_key(array: str, zarr_format: int, separator: str, ndim: int, c: int) -> str:
    """The key of chunk `c` along the examples of an `ndim`-d per-sample array (its other
    axes are one chunk): `sample_key/3`, `token_ids/c/3/0`; parse_chunk_key's inverse."""
    tail = "".join(separator + "0" for _ in range(ndim - 1))
    return f"{array}/{'c' + separator if zarr_format == 3 else ''}{c}{tail}"


def array_shape(meta: Any) -> list[int]:
    """The shape an array's metadata declares (format 2 or 3); ValueError when it is not a
    list of non-negative ints."""
    shape = meta.get("shape") if isinstance(meta, dict) else None
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"shape must be a list of non-negative ints. Got {shape!r}.")
    return shape


class Declared(NamedTuple):
    """What an array's metadata declares about reading its values, whatever its codecs."""

    zarr_format: int
    dtype: np.dtype | None  # None: a data type actstore never writes
    chunks: list[int]  # the (inner) chunk shape
    shards: list[int] | None  # the Zarr shard shape (sharding_indexed), or None
    fill_value: Any  # what a missing chunk reads as


def declared(meta: dict[str, Any]) -> Declared:
    """What an array's Zarr metadata (format 2 or 3, compressed too) declares. Damaged
    metadata raises ValueError, TypeError, KeyError, AttributeError or IndexError."""
    fmt = meta.get("zarr_format")
    if fmt == 2:
        return Declared(2, np.dtype(meta["dtype"]), list(meta["chunks"]), None, meta.get("fill_value"))
    if fmt == 3:
        v3 = _v3_dtype(meta.get("data_type"))
        dtype = np.dtype(v3) if v3 is not None else None
        grid = list(meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = meta.get("codecs") or []
        if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
            return Declared(3, dtype, list(codecs[0]["configuration"]["chunk_shape"]), grid, meta.get("fill_value"))
        return Declared(3, dtype, grid, None, meta.get("fill_value"))
    raise ValueError(f"zarr_format must be one of [2, 3]. Got {fmt!r}.")


def geometry_from_metadata(array: str, meta: dict[str, Any], n_layers: int, d_model: int) -> ChunkGeometry | None:
    """A ChunkGeometry when the array's Zarr metadata allows raw reads, else None (use zarr).

    Raw reads need: no compressor, no filters, C order, little-endian dtype, chunks
    (1, 1, T_chunk, D); for v3 a lone `bytes` codec, or `sharding_indexed` with index at
    the end whose inner codecs are a lone `bytes` codec.
    """
    shape = meta.get("shape")
    if meta.get("zarr_format") == 2:
        dtype = np.dtype(meta["dtype"])
        if meta.get("compressor") is not None or meta.get("filters") or meta.get("order", "C") != "C":
            return None
        if dtype.byteorder == ">":
            return None
        chunks = meta["chunks"]
        sep = meta.get("dimension_separator") or "."
        shards = None
        index_crc = True
    elif meta.get("zarr_format") == 3:
        dtype = np.dtype(_v3_dtype(meta.get("data_type")) or "V0")
        if dtype.itemsize == 0:
            return None
        enc = meta.get("chunk_key_encoding", {})
        if enc.get("name") != "default":
            return None
        sep = enc.get("configuration", {}).get("separator", "/")
        chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codecs = meta.get("codecs", [])
        shards = None
        index_crc = True
        if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
            conf = codecs[0]["configuration"]
            if conf.get("index_location", "end") != "end" or not _is_plain_bytes(conf.get("codecs", [])):
                return None
            idx = [c.get("name") for c in conf.get("index_codecs", [])]
            if idx not in (["bytes"], ["bytes", "crc32c"]):
                return None
            index_crc = idx == ["bytes", "crc32c"]
            shards = chunks
            chunks = conf["chunk_shape"]
        elif not _is_plain_bytes(codecs):
            return None
    else:
        return None
    if len(chunks) != 4 or chunks[0] != 1 or chunks[1] != 1 or chunks[3] != d_model or len(shape) != 4:
        return None
    t_chunk = chunks[2]
    n_tchunks = -(-shape[2] // t_chunk)
    shard_examples = None
    if shards is not None:
        if shards[1] != shape[1] or shards[2] != n_tchunks * t_chunk or shards[3] != d_model:
            return None
        shard_examples = shards[0]
    return ChunkGeometry(
        array=array,
        zarr_format=meta["zarr_format"],
        separator=sep,
        n_layers=n_layers,
        n_tchunks=n_tchunks,
        t_chunk=t_chunk,
        d_model=d_model,
        dtype=dtype.newbyteorder("<"),
        shard_examples=shard_examples,
        index_crc=index_crc,
    )


def key_scheme(meta: dict[str, Any]) -> tuple[int, str]:
    """(zarr_format, chunk key separator) of an array's metadata."""
    if meta.get("zarr_format") == 3:
        enc = meta.get("chunk_key_encoding") or {}
        conf = enc.get("configuration") or {}
        if enc.get("name") == "v2":
            return 2, conf.get("separator", ".")
        return 3, conf.get("separator", "/")
    return 2, meta.get("dimension_separator") or "."


def array_meta_key(array: str, zarr_format: int) -> str:
    return f"{array}/.zarray" if zarr_format == 2 else f"{array}/zarr.json"


def _is_plain_bytes(codecs: list) -> bool:
    return (
        len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    )


def _v3_dtype(name: Any) -> str | None:
    return (
        {"float16": "<f2", "float32": "<f4", "uint16": "<u2", "bfloat16": "<u2"}.get(name)
        if isinstance(name, str)
        else None
    )
