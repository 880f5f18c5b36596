"""ActStore: random access to (example, layer) activations over a finalized manifest.

The reader does not import torch. On local uncompressed shards it reads chunk files
directly (actstore.chunkio); compressed arrays go through zarr-python.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from actstore import spec
from actstore.chunkio import ChunkLayout, layout_from_metadata, load_array_meta
from actstore.config import SegmentSpec, StoreConfig
from actstore.dtypes import bf16_bits_to_f32
from actstore.errors import CorruptStoreError, StoreNotFoundError
from actstore.fsutil import safe_child
from actstore.index import ExampleIndex, layer_position
from actstore.manifest import Manifest, ShardEntry, load_manifest


class _ShardReader:
    """Lazily opened handles of one writer shard: chunk layouts, lengths, zarr fallback."""

    def __init__(self, root: Path, entry: ShardEntry, cfg: StoreConfig):
        self.dir = safe_child(root, f"{spec.SHARDS_DIR}/{entry.name}")
        self.entry = entry
        self.cfg = cfg
        if not self.dir.is_dir():
            raise StoreNotFoundError(
                f"shard {entry.name} listed in the manifest of {root} is missing (holds examples "
                f"{entry.start}..{entry.start + entry.n_examples - 1}); shards present: {_present_shards(root)}"
            )
        self.layouts: dict[str, ChunkLayout | None] = {}
        self._zarr: dict[str, Any] = {}
        self._lengths: dict[str, np.ndarray] = {}
        self._per_sample: dict[str, np.ndarray] = {}
        self._rows_checked = False
        from actstore.writer import _read_commit

        committed = _read_commit(self.dir)["n_committed"]  # counts are checked before anything is allocated
        if committed < entry.n_examples:
            raise CorruptStoreError(
                f"shard {self.dir} has committed {committed} examples but the manifest says {entry.n_examples}; "
                "the manifest does not belong to these shards (run `actstore verify`)"
            )
        try:
            self._meta = _consolidated(self.dir)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # untrusted JSON: any shape
            raise CorruptStoreError(f"shard {self.dir} has damaged consolidated metadata ({e!r})") from None
        for seg in cfg.segments:
            rel = f"{spec.ARRAYS_GROUP}/{seg.name}{spec.ACTS_SUFFIX}"
            meta = self._meta.get(rel) if self._meta else None
            if meta is None:
                try:
                    meta = load_array_meta(self.dir / rel)
                except FileNotFoundError:
                    raise CorruptStoreError(f"shard {self.dir} has no array {rel}") from None
                except ValueError as e:
                    raise CorruptStoreError(f"array metadata of {self.dir / rel} is damaged ({e})") from None
            shape = meta.get("shape") if isinstance(meta, dict) else None
            if not isinstance(shape, list) or len(shape) != 4 or shape[1:] != [cfg.n_layers, seg.t_max, cfg.d_model]:
                raise CorruptStoreError(
                    f"array {self.dir / rel} has shape {shape}, expected (n, {cfg.n_layers}, {seg.t_max}, {cfg.d_model})"
                )
            if not isinstance(shape[0], int) or shape[0] < entry.n_examples:
                raise CorruptStoreError(
                    f"array {self.dir / rel} holds {shape[0]} examples; the manifest says {entry.n_examples}"
                )
            try:
                lay = layout_from_metadata(self.dir / rel, meta, cfg.n_layers, cfg.d_model)
            except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
                raise CorruptStoreError(f"array metadata of {self.dir / rel} is damaged ({e!r})") from None
            if lay is not None and (lay.t_chunk != seg.t_chunk or lay.dtype != np.dtype(cfg.zarr_dtype)):
                raise CorruptStoreError(
                    f"array {self.dir / rel} has chunks of {lay.t_chunk} tokens of {lay.dtype}; the store config says "
                    f"{seg.t_chunk} tokens of {cfg.zarr_dtype}"
                )
            self.layouts[seg.name] = lay

    def per_sample(self, name: str) -> np.ndarray:
        arr = self._per_sample.get(name)
        if arr is None:
            import zarr

            try:
                z = zarr.open_array(str(safe_child(self.dir, f"{spec.ARRAYS_GROUP}/{name}")), mode="r")
            except (ValueError, TypeError, KeyError, OSError) as e:
                raise CorruptStoreError(f"array {self.dir / spec.ARRAYS_GROUP / name} cannot be opened ({e!r})") from None
            n = self.entry.n_examples
            if z.shape[0] < n:
                raise CorruptStoreError(f"array {self.dir / spec.ARRAYS_GROUP / name} holds {z.shape[0]} values; the manifest says {n}")
            if not self._rows_checked:
                rows = rows_on_disk(self.dir)
                if rows < n:
                    raise CorruptStoreError(
                        f"shard {self.dir}: its {spec.SAMPLE_KEY} array has chunk files for at most {rows} examples but the "
                        f"manifest says {n}; the store's counts are damaged (run `actstore verify`)"
                    )
                self._rows_checked = True
            arr = np.asarray(z[:n])  # n is now bounded by files on disk
            self._per_sample[name] = arr
        return arr

    def lengths(self, seg: SegmentSpec) -> np.ndarray:
        arr = self._lengths.get(seg.name)
        if arr is None:
            arr = self.per_sample(seg.name + spec.LEN_SUFFIX)
            if arr.size and (arr.min() < 0 or arr.max() > seg.t_max):
                raise CorruptStoreError(f"shard {self.dir}: lengths of segment {seg.name!r} lie outside 0..{seg.t_max}")
            self._lengths[seg.name] = arr
        return arr

    def read_padded(self, seg: SegmentSpec, local: int, lp: int, out: np.ndarray) -> None:
        """Fill `out` (n_chunks * t_chunk, D) in the stored dtype with every token chunk."""
        lay = self.layouts[seg.name]
        if lay is not None:
            lay.read_into(local, lp, out)
            return
        z = self._zarr.get(seg.name)
        if z is None:
            import zarr

            z = zarr.open_array(str(self.dir / spec.ARRAYS_GROUP / f"{seg.name}{spec.ACTS_SUFFIX}"), mode="r")
            self._zarr[seg.name] = z
        out[: seg.t_max] = z[local, lp]
        out[seg.t_max :] = 0


class SegmentView:
    """`store.segment(name)[ex, layer]` -> (length, D) of one segment."""

    def __init__(self, store: ActStore, seg: SegmentSpec):
        self._store = store
        self.spec = seg
        self.name = seg.name
        self.t_max = seg.t_max

    def __getitem__(self, key: tuple[int, int]) -> np.ndarray:
        ex, layer = _split_key(key)
        return self._store._read_segment(self.spec, ex, layer, pad=False)

    def padded(self, ex: int, layer: int) -> np.ndarray:
        """(T_max, D) with the zero padding, as stored."""
        return self._store._read_segment(self.spec, ex, layer, pad=True)

    def lengths(self) -> np.ndarray:
        """Lengths of this segment for every example, in global order."""
        return self._store._global_per_sample(self.name + spec.LEN_SUFFIX)


class ActStore:
    """A finalized actstore store, read-only.

    `store[ex, layer]` returns the (T_i, D) activations of example `ex` at model layer
    number `layer`, exactly as logged (prompt[:p] then response[:r] for several segments).
    Safe to use from many processes, and picklable (workers reopen it lazily).

    Args:
        path: the store root (holding manifest.json).
    """

    def __new__(cls, path: str | os.PathLike | None = None, *args: Any, **kwargs: Any):
        # A saev 2.0/2.1 shard directory opens as a SaevStore (same reading API, np.memmap).
        if cls is ActStore and path is not None:
            from actstore.saev.reader import SaevStore, is_saev_dir

            if is_saev_dir(path):
                return SaevStore(path)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, *, verify: str | None = None):
        if verify not in (None, False, "fast", "deep"):
            raise ValueError(f"verify must be one of [None, 'fast', 'deep']. Got {verify!r}.")
        self.path = Path(path)
        self._verify = verify
        self._open()

    def _open(self) -> None:
        if not self.path.exists():
            raise StoreNotFoundError(f"no store at {self.path}")
        self.manifest: Manifest = load_manifest(self.path)
        self.config: StoreConfig = self.manifest.config
        self.index = ExampleIndex([s.n_examples for s in self.manifest.shards])
        self._shards: dict[int, _ShardReader] = {}
        self._segs = {s.name: s for s in self.config.segments}
        if self._verify:
            from actstore.verify import verify_store

            verify_store(self.path, deep=self._verify == "deep", raise_on_error=True)

    # ---- pickling: only the path travels -------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "verify": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self._verify = state["verify"]
        self._open()

    # ---- description ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.n_examples

    def __repr__(self) -> str:
        segs = ", ".join(f"{s.name}={s.t_max}" for s in self.config.segments)
        return f"ActStore({str(self.path)!r}, n={len(self)}, layers={list(self.layers)}, d_model={self.d_model}, {segs}, {self.dtype})"

    @property
    def layers(self) -> tuple[int, ...]:
        return self.config.layers

    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self._segs)

    @property
    def meta(self) -> dict[str, Any]:
        """Global metadata: model id, layers, d_model, dtype, segments, attrs, truncation."""
        cfg = self.config
        return {
            "model_id": cfg.model_id,
            "layers": list(cfg.layers),
            "d_model": cfg.d_model,
            "dtype": cfg.dtype,
            "segments": {s.name: {"t_max": s.t_max, "t_chunk": s.t_chunk, "fixed": s.fixed} for s in cfg.segments},
            "n_examples": len(self),
            "truncation": self.manifest.truncation,
            "nonfinite": self.manifest.nonfinite,
            "overflow": self.manifest.overflow,
            "created": self.manifest.created,
            "actstore_version": self.manifest.actstore_version,
            **dict(cfg.attrs),
        }

    def segment(self, name: str) -> SegmentView:
        return SegmentView(self, self.config.segment(name))

    # ---- reads ---------------------------------------------------------------------
    def __getitem__(self, key: tuple[int, int]) -> np.ndarray:
        ex, layer = _split_key(key)
        segs = self.config.segments
        if len(segs) == 1:
            return self._read_segment(segs[0], ex, layer, pad=False)
        parts = [self._read_segment(s, ex, layer, pad=False) for s in segs]
        return np.concatenate(parts, axis=0)  # one copy to join the segments

    def lengths(self, ex: int) -> dict[str, int]:
        """True (capped) token counts of example `ex`, per segment."""
        pos, local = self.index.locate(ex)
        sh = self._shard(pos)
        return {s.name: int(sh.lengths(s)[local]) for s in self.config.segments}

    def read_into(self, ex: int, layer: int, segment: str, out: np.ndarray) -> int:
        """Read segment `segment` of (ex, layer) padded to T_max into `out` (stored dtype,
        shape (>= n_chunks*t_chunk, D)); returns the example's length. For loaders."""
        seg = self.config.segment(segment)
        sh, local, lp = self._where(ex, layer)
        sh.read_padded(seg, local, lp, out)
        return int(sh.lengths(seg)[local])

    def read_cached(self, ex: int, layer: int, segment: str, out: np.ndarray) -> bool:
        """read_into, but only if every byte is in the page cache (it never waits for the
        disk); returns False otherwise (then call read_into). For loaders: cached reads are
        memory copies, best done on one thread, and only the others need I/O threads."""
        seg = self.config.segment(segment)
        sh, local, lp = self._where(ex, layer)
        lay = sh.layouts[seg.name]
        return lay is not None and lay.read_cached(local, lp, out)

    def _read_segment(self, seg: SegmentSpec, ex: int, layer: int, *, pad: bool) -> np.ndarray:
        sh, local, lp = self._where(ex, layer)
        n_pad = seg.n_chunks * seg.t_chunk
        buf = np.empty((n_pad, self.config.d_model), dtype=spec.ACT_DTYPES[self.config.dtype])
        sh.read_padded(seg, local, lp, buf)
        n = seg.t_max if pad else int(sh.lengths(seg)[local])
        out = buf[:n]
        if self.config.dtype == "bfloat16":
            return bf16_bits_to_f32(out)
        return out

    def sample(self, ex: int) -> dict[str, Any]:
        """Per-sample metadata of example `ex`: sample_key, lengths, fields and texts."""
        from actstore.zarrio import decode_keys

        pos, local = self.index.locate(ex)
        sh = self._shard(pos)
        out: dict[str, Any] = {"example": ex if ex >= 0 else ex + len(self)}
        out["sample_key"] = decode_keys(sh.per_sample(spec.SAMPLE_KEY)[local : local + 1])[0]
        out["lengths"] = {s.name: int(sh.lengths(s)[local]) for s in self.config.segments}
        for name in self.config.fields:
            out[name] = sh.per_sample(name)[local].item()
        for name in self.config.texts:
            out[name] = _jsonl_line(safe_child(sh.dir, f"{spec.TEXT_DIR}/{name}.jsonl"), local, name)
        return out

    def field(self, name: str) -> np.ndarray:
        """A per-sample field (or `sample_key`, or `<segment>_len`) over all examples."""
        if name == spec.SAMPLE_KEY:
            from actstore.zarrio import decode_keys

            return np.array([k for pos in range(len(self.manifest.shards)) for k in decode_keys(self._shard(pos).per_sample(name))])
        allowed = list(self.config.fields) + [s + spec.LEN_SUFFIX for s in self._segs]
        if self.config.token_labels:
            allowed += [s + spec.TOKEN_LABELS_SUFFIX for s in self._segs]
        if name not in allowed:
            raise KeyError(f"no per-sample field {name!r}; this store has {[spec.SAMPLE_KEY, *allowed]}")
        return self._global_per_sample(name)

    def texts(self, name: str) -> Iterator[Any]:
        """Every value of text field `name`, in global example order."""
        if name not in self.config.texts:
            raise KeyError(f"no text field {name!r}; this store has {list(self.config.texts)}")
        for pos, entry in enumerate(self.manifest.shards):
            path = safe_child(self._shard(pos).dir, f"{spec.TEXT_DIR}/{name}.jsonl")
            with open(path, "rb") as f:
                for i, line in enumerate(f):
                    if i >= entry.n_examples:
                        break
                    yield _text_value(line, path, i, name)

    def to_xarray(self, ex: int, segment: str | None = None):
        """Example `ex` as an xarray.DataArray (layer, token, d_model), every stored layer.

        Coordinates: `layer` holds the model layer numbers, `token` the positions 0..T_i-1
        (and a `segment` coordinate naming each token's segment). One read per layer.
        """
        import xarray as xr

        names = [segment] if segment is not None else list(self._segs)
        views = [self.segment(n) for n in names]
        data = np.stack([np.concatenate([v[ex, layer] for v in views], axis=0) for layer in self.layers])
        seg_of_token = np.concatenate([np.full(self.lengths(ex)[n], n, dtype=object) for n in names])
        return xr.DataArray(
            data,
            dims=("layer", "token", "d_model"),
            coords={"layer": list(self.layers), "token": np.arange(data.shape[1]), "segment": ("token", seg_of_token)},
            attrs={"example": ex, "model_id": self.config.model_id or "", "dtype": self.dtype},
        )

    def stats(self):
        """Running statistics merged over all shards (RunningStats), or None if not kept."""
        if self.manifest.stats is None:
            return None
        import zipfile

        from actstore.stats import RunningStats

        path = safe_child(self.path, self.manifest.stats)
        try:
            return RunningStats.load(path)
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a damaged .npz raises any of these
            raise CorruptStoreError(f"statistics file {path} is unreadable ({e!r}); rerun `actstore finalize` to rewrite it") from None

    def _global_per_sample(self, name: str) -> np.ndarray:
        parts = [self._shard(pos).per_sample(name) for pos in range(len(self.manifest.shards))]
        return np.concatenate(parts) if parts else np.zeros(0)

    def _where(self, ex: int, layer: int) -> tuple[_ShardReader, int, int]:
        """(shard reader, local example, layer position) of (ex, layer); clear errors for either."""
        pos, local = self.index.locate(ex)
        lp = layer_position(self.config.layers, layer)
        return self._shard(pos), local, lp

    def _shard(self, pos: int) -> _ShardReader:
        sh = self._shards.get(pos)
        if sh is None:
            sh = _ShardReader(self.path, self.manifest.shards[pos], self.config)
            self._shards[pos] = sh
        return sh


def _split_key(key: Any) -> tuple[int, int]:
    if not isinstance(key, tuple) or len(key) != 2:
        raise TypeError(f"index the store as store[example, layer] with two ints, got {key!r}")
    ex, layer = key
    if not isinstance(ex, (int, np.integer)) or isinstance(ex, bool):
        raise TypeError(f"example index must be an int, got {ex!r}")
    return int(ex), layer


def rows_on_disk(shard_dir: Path) -> int:
    """An upper bound on a shard's examples from the files its sample_key array holds.

    Checked before per-sample arrays are read, so that metadata claiming more examples than
    were ever written cannot make a reader allocate for them. (zarr omits only chunks of all
    zero bytes; the writer's default keys are never empty, and a whole chunk of empty
    user-given keys is refused here.)
    """
    adir = shard_dir / spec.ARRAYS_GROUP / spec.SAMPLE_KEY
    try:
        meta = load_array_meta(adir)
        chunks = meta["chunks"] if meta.get("zarr_format") == 2 else meta["chunk_grid"]["configuration"]["chunk_shape"]
        rows = int(chunks[0])
        cdir = adir / "c" if meta.get("zarr_format") == 3 else adir
        heads = [e.name.split(".")[0] for e in os.scandir(cdir)] if cdir.is_dir() else []
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptStoreError(f"array {adir} has damaged metadata ({e!r})") from None
    top = max((int(h) for h in heads if h.isdigit()), default=-1)
    return (top + 1) * rows


def _consolidated(shard_dir: Path) -> dict[str, Any] | None:
    """Array metadata keyed by path from consolidated metadata, when the shard has it."""
    p = shard_dir / ".zmetadata"
    if p.exists():
        meta = json.loads(p.read_text())["metadata"]
        return {k[: -len("/.zarray")]: v for k, v in meta.items() if k.endswith("/.zarray")}
    p = shard_dir / "zarr.json"
    if p.exists():
        root = json.loads(p.read_text())
        cm = (root.get("consolidated_metadata") or {}).get("metadata")
        if cm:
            return {k: v for k, v in cm.items() if v.get("node_type") == "array"}
    return None


def _present_shards(root: Path) -> list[str]:
    d = root / spec.SHARDS_DIR
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.exists() else []


def _jsonl_line(path: Path, i: int, name: str) -> Any:
    with open(path, "rb") as f:
        for k, line in enumerate(f):
            if k == i:
                return _text_value(line, path, i, name)
    raise CorruptStoreError(f"{path} has fewer than {i + 1} lines")


def _text_value(line: bytes, path: Path, i: int, name: str) -> Any:
    """The value of text `name` on line i of its .jsonl file, refusing damaged lines."""
    try:
        rec = json.loads(line)
        return rec[name]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptStoreError(f"{path}: line {i + 1} is damaged ({e!r}); run `actstore verify --deep`") from None
