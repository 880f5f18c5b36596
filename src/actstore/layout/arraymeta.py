"""What each Zarr array of a writer shard must declare, field by field (no I/O).

Every field of an array's metadata that decides how its bytes are read (Zarr format,
shape, dtype with its byte order, chunk and Zarr-shard shapes, fill value, compressor,
filters, memory order, codecs, chunk key encoding) is compared with what the format says
for that array (actstore.layout.arrays). A hand-edited `"<f2"` -> `">f2"` would make zarr
return byte-swapped values, a filter or codec inserted by an edit would change every
value read: readers and `actstore verify` refuse both. `array_problems` returns one
noun phrase per problem ("dtype >f2; the store config says <f2 ..."), so that a reader
says "array X has <problem>" and verify lists the problem.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.layout.arrays import ArraySpec

# The Zarr v3 data types the format uses, as numpy type codes (byte order from the codec).
V3_TYPES = {
    "bool": "b1",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
}
# Codecs that only transform the encoded bytes (compressors, checksums): allowed after
# the `bytes` codec of a compressed activation array, never on per-sample arrays.
BYTES_CODECS = ("blosc", "gzip", "zstd", "crc32c", "numcodecs.zlib", "numcodecs.bz2", "numcodecs.lzma", "numcodecs.lz4")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def declared_dtype(meta: dict[str, Any]) -> str:
    """The dtype an array's metadata declares, as a numpy dtype string with its byte order
    (`<f2`, `>i4`, `|u1`); ValueError when it declares none the format could use."""
    if meta.get("zarr_format") == 2:
        raw = meta.get("dtype")
        if not isinstance(raw, str):
            raise ValueError(f"dtype must be a string. Got {raw!r}")
        try:
            dt = np.dtype(raw)
        except TypeError:
            raise ValueError(f"dtype {raw!r} is not a data type") from None
        if dt.fields is not None or dt.subdtype is not None or dt.kind not in "biufS":
            raise ValueError(f"dtype {raw!r} is not one the format uses")
        return dt.str
    name = meta.get("data_type")
    code = V3_TYPES.get(name) if isinstance(name, str) else None
    if code is None:
        raise ValueError(f"data type {name!r} is not one the format uses ({', '.join(V3_TYPES)})")
    if code[1] == "1":
        return "|" + code
    return {"little": "<", "big": ">"}[_v3_endian(meta)] + code


def _v3_endian(meta: dict[str, Any]) -> str:
    codecs = meta.get("codecs")
    if (
        isinstance(codecs, list)
        and codecs
        and isinstance(codecs[0], dict)
        and codecs[0].get("name") == "sharding_indexed"
    ):
        conf = codecs[0].get("configuration")
        codecs = conf.get("codecs") if isinstance(conf, dict) else None
    for c in codecs if isinstance(codecs, list) else []:
        if isinstance(c, dict) and c.get("name") == "bytes":
            conf = c.get("configuration") or {}
            endian = conf.get("endian", "little") if isinstance(conf, dict) else None
            if endian not in ("little", "big"):
                raise ValueError(f"the bytes codec's endian must be 'little' or 'big'. Got {endian!r}")
            return endian
    raise ValueError(f"codecs {_names(codecs)} hold no bytes codec")


def _names(codecs: Any) -> list[Any]:
    if not isinstance(codecs, list):
        return [codecs]
    return [c.get("name") if isinstance(c, dict) else c for c in codecs]


def array_problems(meta: Any, want: ArraySpec, zarr_format: int, n: int, complete: bool = False) -> list[str]:
    """What is wrong with array metadata `meta` for the array `want` of a store of Zarr
    format `zarr_format` publishing `n` examples (empty: nothing). A `complete` shard's
    arrays hold exactly `n` examples (its writer's last commit set every shape); a shard
    whose writer never closed may hold uncommitted examples beyond them."""
    if not isinstance(meta, dict):
        return [f"metadata that is not a JSON object ({type(meta).__name__})"]
    fmt = meta.get("zarr_format")
    if not _is_int(fmt) or fmt != zarr_format:
        return [f"zarr_format {fmt!r}; the store config says {zarr_format}"]
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
        return [f"shape {shape!r}; a shape is a list of non-negative ints"]
    tail = list(want.shape[1:])
    if len(shape) != 1 + len(tail) or shape[1:] != tail:
        return [
            f"shape {shape}; the store config says (n, {', '.join(map(str, tail))})"
            if tail
            else f"shape {shape}; the store config says (n,)"
        ]
    if shape[0] < n:
        return [f"{shape[0]} examples; {n} are published"]
    if complete and shape[0] != n:
        return [f"{shape[0]} examples; the shard is complete with {n} (its writer set every shape to that)"]
    try:
        dtype = declared_dtype(meta)
    except (ValueError, KeyError) as e:
        return [f"an unusable data type ({e})"]
    want_dtype = np.dtype(want.dtype).str
    chunks, shards = _chunk_shapes(meta, want)
    if want.activations and chunks != list(want.chunks):
        c = chunks if isinstance(chunks, list) else []
        have = f"{c[2]} tokens" if len(c) == 4 and c[:2] == [1, 1] and c[3] == want.chunks[3] else f"shape {chunks}"
        return [
            f"chunks of {have} of {np.dtype(dtype).name}; the store config says {want.chunks[2]} tokens of {want_dtype}"
        ]
    if dtype != want_dtype:
        return [f"dtype {dtype}; the store config says {want_dtype} (the byte order and width decide every value read)"]
    if chunks != list(want.chunks) and (want.legacy_chunks is None or chunks != list(want.legacy_chunks)):
        return [f"chunk shape {chunks}; the format's is {list(want.chunks)}"]
    want_shards = list(want.shards) if want.shards is not None else None
    if shards != want_shards:
        return [f"Zarr shards of shape {shards}; the store config says {want_shards}"]
    fill = meta.get("fill_value")
    if not _fill_ok(fill, want):
        return [f"fill value {fill!r}; the format's is {want.fill_value!r} (missing chunks read as it)"]
    return _codec_problems(meta, want)


def chunk_rows(meta: dict[str, Any], want: ArraySpec) -> int:
    """Rows of a per-sample array's chunks as its metadata declare them (checked by
    array_problems: the format's, or an older writer's)."""
    return int(_chunk_shapes(meta, want)[0][0])


def _chunk_shapes(meta: dict[str, Any], want: ArraySpec) -> tuple[Any, Any]:
    """(inner chunk shape, Zarr shard shape or None) as declared."""
    if meta["zarr_format"] == 2:
        return meta.get("chunks"), None
    grid = meta.get("chunk_grid")
    conf = grid.get("configuration") if isinstance(grid, dict) and grid.get("name") == "regular" else None
    outer = conf.get("chunk_shape") if isinstance(conf, dict) else None
    codecs = meta.get("codecs")
    if (
        isinstance(codecs, list)
        and len(codecs) == 1
        and isinstance(codecs[0], dict)
        and codecs[0].get("name") == "sharding_indexed"
    ):
        sconf = codecs[0].get("configuration")
        return (sconf.get("chunk_shape") if isinstance(sconf, dict) else None), outer
    return outer, None


def _fill_ok(fill: Any, want: ArraySpec) -> bool:
    if np.dtype(want.dtype).kind == "S":
        return fill in ("", None) or fill == want.fill_value
    if np.dtype(want.dtype).kind == "b":
        return fill is False or (_is_int(fill) and fill == 0)
    return not isinstance(fill, bool) and isinstance(fill, (int, float)) and fill == want.fill_value


def _codec_problems(meta: dict[str, Any], want: ArraySpec) -> list[str]:
    """Compressor, filters, order and key encoding (format 2); codecs, key encoding and
    storage transformers (format 3)."""
    if meta["zarr_format"] == 2:
        comp = meta.get("compressor")
        if comp is not None and (
            not want.activations or not isinstance(comp, dict) or not isinstance(comp.get("id"), str)
        ):
            what = (
                "actstore never compresses per-sample arrays"
                if not want.activations
                else "a compressor is an object with an id"
            )
            return [f"compressor {comp!r}; {what}"]
        if meta.get("filters") not in (None, []):
            return [f"filters {meta.get('filters')!r}; actstore writes none (a filter changes every value read)"]
        if meta.get("order", "C") != "C":
            return [f"order {meta.get('order')!r}; actstore writes C order"]
        if meta.get("dimension_separator", ".") not in (".", "/", None):
            return [f"dimension_separator {meta.get('dimension_separator')!r}; Zarr allows '.' or '/'"]
        return []
    enc = meta.get("chunk_key_encoding")
    conf = enc.get("configuration", {}) if isinstance(enc, dict) else None
    if (
        not isinstance(conf, dict)
        or enc.get("name") not in ("default", "v2")
        or conf.get("separator", "/") not in ("/", ".")
    ):
        return [
            f"chunk_key_encoding {enc!r}; actstore writes {{'name': 'default', 'configuration': {{'separator': '/'}}}}"
        ]
    if meta.get("storage_transformers") not in (None, []):
        return [f"storage_transformers {meta.get('storage_transformers')!r}; actstore writes none"]
    codecs = meta.get("codecs")
    if want.shards is not None:
        inner = (codecs[0].get("configuration") or {}).get("codecs") if _is_sharding(codecs) else None
        index = (codecs[0].get("configuration") or {}).get("index_codecs") if _is_sharding(codecs) else None
        if inner is None or _names(index) not in (["bytes"], ["bytes", "crc32c"]):
            return [
                f"codecs {_names(codecs)}; the store config says Zarr shards (sharding_indexed, index codecs bytes + crc32c)"
            ]
        sconf = codecs[0]["configuration"]
        endian = (index[0].get("configuration") or {}).get("endian") if isinstance(index[0], dict) else None
        if endian != "little" or sconf.get("index_location", "end") != "end":
            return [
                f"a Zarr shard index {endian!r} endian at {sconf.get('index_location', 'end')!r}; actstore writes "
                "it little endian at the end (another byte order or place reads every offset wrong)"
            ]
        codecs = inner
    names = _names(codecs)
    if (
        not names
        or names[0] != "bytes"
        or (not want.activations and len(names) > 1)
        or any(n not in BYTES_CODECS for n in names[1:])
    ):
        extra = " and compressors" if want.activations else ""
        return [
            f"codecs {names}; actstore writes the bytes codec{extra} only (any other codec changes the values read)"
        ]
    return []


def _is_sharding(codecs: Any) -> bool:
    return (
        isinstance(codecs, list)
        and len(codecs) == 1
        and isinstance(codecs[0], dict)
        and codecs[0].get("name") == "sharding_indexed"
        and isinstance(codecs[0].get("configuration"), dict)
    )
