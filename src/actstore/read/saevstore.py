"""SaevStore: a saev 2.0 / 2.1 shard directory read through np.memmap with ActStore's API.

`actstore.open(path)` returns one when `path` holds metadata.json and shards.json and no
manifest.json. The directory is one fixed segment "tokens" of T = content tokens (+1 for
CLS at token 0) float32 vectors per (example, layer).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FieldNotFoundError, SaevFormatError
from actstore.index import ExampleIndex, layer_position
from actstore.layout import saevspec as P
from actstore.layout import spec
from actstore.layout.config import StoreConfig, make_config
from actstore.read.interface import Reader
from actstore.read.saevschema import check_metadata, check_shards_json, read_json, regular_size
from actstore.read.select import is_pair, select

SEGMENT = spec.DEFAULT_SEGMENT
# What a saev directory name looks like (saevspec.metadata_hash): 2.0 a full sha256, 2.1 its first 8 hex digits.
_HASH_SHAPE = {"2.0": re.compile(r"[0-9a-f]{64}"), "2.1": re.compile(r"[0-9a-f]{8}")}


def is_saev_dir(path: str | os.PathLike) -> bool:
    """True when `path` looks like a saev shard directory rather than an actstore store."""
    p = Path(path)
    return (p / P.METADATA_FILE).is_file() and (p / P.SHARDS_FILE).is_file() and not (p / spec.MANIFEST_FILE).exists()


class SaevSegmentView:
    """`store.segment("tokens")[ex, layer]`, as ActStore's SegmentView."""

    def __init__(self, store: SaevStore):
        self._store = store
        self.name = SEGMENT
        self.t_max = store.tokens_per_example

    def __getitem__(self, key: tuple[int, int]) -> np.ndarray:
        return self._store[key]

    def padded(self, ex: int, layer: int) -> np.ndarray:
        return self._store[ex, layer]

    def lengths(self) -> np.ndarray:
        return np.full(len(self._store), self.t_max, dtype=np.int32)


class SaevStore(Reader):
    """A saev shard directory, read-only: `store[ex, layer]` -> (T, D) float32; a Reader
    (actstore.read.interface).

    Checks metadata.json, shards.json, the shard file sizes and (where the directory has a
    hash's name) that the name is metadata.json's hash on open (run `actstore verify-saev`
    for every rule). Picklable: only the path travels.

    Args:
        path: the `<HASH>` directory.
    """

    def __init__(self, path: str | os.PathLike, **_ignored: Any):
        self.path = Path(path)
        self._open()

    def _open(self) -> None:
        if not self.path.is_dir():
            raise SaevFormatError(f"{self.path} is not a saev shard directory (not a folder)")
        md, problem = read_json(self.path / P.METADATA_FILE)
        if problem:
            raise SaevFormatError(f"{self.path}: {problem}")
        proto, geom, problems = check_metadata(md)
        if geom is not None and proto is not None:
            entries, problem = read_json(self.path / P.SHARDS_FILE)
            problems += [problem] if problem else check_shards_json(entries, geom, proto)[1]
        if problems or geom is None:
            raise SaevFormatError(
                f"{self.path} is not a valid saev shard directory: {'; '.join(problems)} (run `actstore verify-saev {self.path}`)"
            )
        self.protocol: str = proto
        self.metadata: dict[str, Any] = md
        self.geometry: P.ShardGeometry = geom
        for i in range(geom.n_shards):
            f = self.path / P.SHARD_NAME_FORMAT.format(i)
            size = regular_size(f)  # never a FIFO, folder or link: np.memmap would open it
            if isinstance(size, str):
                raise SaevFormatError(
                    f"{f} is {size} where a shard file belongs; run `actstore verify-saev {self.path}`"
                )
            if size != geom.shard_nbytes:
                raise SaevFormatError(
                    f"{f} has {size if size is not None else 'no'} bytes, expected {geom.shard_nbytes} (full-size shard); "
                    f"run `actstore verify-saev {self.path}`"
                )
        self._check_name(md, proto)
        counts = geom.shard_counts()
        self.index = ExampleIndex(counts)
        self._maps: dict[int, np.memmap] = {}
        self._labels: np.memmap | None = None
        self.config: StoreConfig = make_config(
            layers=md["layers"],
            d_model=geom.d_model,
            dtype="float32",
            tokens=geom.tokens_per_example,
            token_labels=regular_size(self.path / P.LABELS_FILE) is not None,
            model_id=md["ckpt"],
            attrs=self._attrs(),
            zarr_format=2,  # a description of the saev files (read directly), not a layout written
        )

    def _check_name(self, md: dict[str, Any], proto: str) -> None:
        """metadata.json has no checksum of its own: the directory's name is its hash. A
        name of a hash's shape that is not this metadata's hash means metadata.json changed
        (a flipped digit of `layers` would pass every size rule and relabel the layers), so
        the directory is refused. Any other name (a directory renamed by hand, a stage being
        built) is not checked; `verify-saev` reports it."""
        name = Path(os.path.abspath(self.path)).name
        if not _HASH_SHAPE[proto].fullmatch(name):
            return
        try:
            want = P.metadata_hash(md, proto)
        except ValueError:  # a string no UTF-8 encodes (a lone surrogate escaped in the JSON)
            want = "(none: metadata.json holds text that UTF-8 cannot encode)"
        if name != want:
            raise SaevFormatError(
                f"{self.path}: directory name {name!r} is not the metadata hash {want!r} ({P.HASH_RULE[proto]}): "
                f"metadata.json was edited or damaged; run `actstore verify-saev {self.path}`"
            )

    def _attrs(self) -> dict[str, Any]:
        md = self.metadata
        out = {k: md[k] for k in ("family", "ckpt", "cls_token", "dataset", "data") if k in md}
        if md.get("pixel_agg") is not None:
            out["pixel_agg"] = md["pixel_agg"]
        out["saev_protocol"] = self.protocol
        out["saev_hash"] = self.path.name
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self._open()

    # ---- description ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.geometry.n_examples

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"SaevStore({str(self.path)!r}, protocol={self.protocol}, n={len(self)}, layers={list(self.layers)}, "
            f"d_model={g.d_model}, tokens={g.tokens_per_example}, cls_token={g.cls_token})"
        )

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.metadata["layers"])

    @property
    def d_model(self) -> int:
        return self.geometry.d_model

    @property
    def dtype(self) -> str:
        return P.DTYPE

    @property
    def tokens_per_example(self) -> int:
        return self.geometry.tokens_per_example

    @property
    def segments(self) -> tuple[str, ...]:
        return (SEGMENT,)

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "model_id": self.metadata["ckpt"],
            "layers": list(self.layers),
            "d_model": self.d_model,
            "dtype": self.dtype,
            "segments": {
                SEGMENT: {"t_max": self.tokens_per_example, "t_chunk": self.tokens_per_example, "fixed": True}
            },
            "n_examples": len(self),
            **self._attrs(),
        }

    def segment(self, name: str) -> SaevSegmentView:
        self.config.segment(name)  # raises SegmentNotFoundError naming "tokens"
        return SaevSegmentView(self)

    def to_xarray(self, *, chunks: Any = None):
        """The directory as a lazy xarray.Dataset, as ActStore.to_xarray() (no sample keys or fields)."""
        from actstore.read.xarray import to_dataset

        return to_dataset(self, chunks=chunks)

    # ---- reads ---------------------------------------------------------------------
    def __getitem__(self, key: tuple[Any, Any]) -> np.ndarray | list[np.ndarray]:
        if not is_pair(key):  # slices and lists of examples and layers, as ActStore
            return select(self, key)
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"index the store as store[example, layer] with two ints, got {key!r}")
        ex, layer = key
        if not isinstance(ex, (int, np.integer)) or isinstance(ex, bool):
            raise TypeError(f"example index must be an int, got {ex!r}")
        pos, local = self.index.locate(int(ex))
        lp = layer_position(self.layers, layer)
        return self.shard_map(pos)[local, lp].view(np.ndarray)  # a read-only view of the memory map

    def lengths(self, ex: int) -> dict[str, int]:
        self.index.locate(ex)
        return {SEGMENT: self.tokens_per_example}

    def read_into(self, ex: int, layer: int, segment: str, out: np.ndarray) -> int:
        """Copy (ex, layer) into out[:T] (float32, shape (>= T, D)); returns T. For loaders."""
        self.config.segment(segment)
        T = self.tokens_per_example
        out[:T] = self[ex, layer]
        return T

    def field(self, name: str) -> np.ndarray:
        """`tokens_len` or `tokens_token_labels` ((n, T) uint8, label 0 at a CLS token)."""
        if name == SEGMENT + spec.LEN_SUFFIX:
            return self.segment(SEGMENT).lengths()
        if name == SEGMENT + spec.TOKEN_LABELS_SUFFIX and self.config.token_labels:
            lab = self.labels()
            if not self.geometry.cls_token:
                return np.asarray(lab)
            out = np.zeros((len(self), self.tokens_per_example), dtype=np.uint8)
            out[:, 1:] = lab
            return out
        raise FieldNotFoundError(
            f"no per-sample field {name!r} in {self.path}; this saev directory has {list(self.field_names())}"
        )

    def field_names(self) -> tuple[str, ...]:
        """`tokens_len`, and `tokens_token_labels` where labels.bin exists."""
        return (SEGMENT + spec.LEN_SUFFIX,) + (
            (SEGMENT + spec.TOKEN_LABELS_SUFFIX,) if self.config.token_labels else ()
        )

    def labels(self) -> np.memmap:
        """labels.bin as a read-only (n_examples, content tokens) uint8 memory map."""
        if self._labels is None:
            g = self.geometry
            path = self.path / P.LABELS_FILE
            want = g.n_examples * g.content_tokens
            size = regular_size(path)
            if size is None:
                raise KeyError(f"{self.path} has no {P.LABELS_FILE}")
            if isinstance(size, str):
                raise SaevFormatError(f"{path} is {size} where a file belongs; run `actstore verify-saev {self.path}`")
            if size != want:
                raise SaevFormatError(
                    f"{path} has {size} bytes, expected {want}; run `actstore verify-saev {self.path}`"
                )
            self._labels = np.memmap(path, dtype=np.uint8, mode="r", shape=(g.n_examples, g.content_tokens))
        return self._labels

    def shard_map(self, pos: int) -> np.memmap:
        """The read-only memory map of shard file `pos` (opened once): the saev importer slices its rows."""
        mm = self._maps.get(pos)
        if mm is None:
            path = self.path / P.SHARD_NAME_FORMAT.format(pos)
            mm = np.memmap(path, dtype="<f4", mode="r", shape=self.geometry.shard_shape)
            self._maps[pos] = mm
        return mm
