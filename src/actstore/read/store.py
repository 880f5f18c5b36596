"""ActStore: random access to (example, layer) activations over a finalized manifest.

The reader does not import torch. On local uncompressed shards it reads chunk files
directly (actstore.chunkio); compressed arrays go through zarr-python.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actstore import catalog
from actstore.dtypes import bf16_bits_to_f32
from actstore.errors import ActstoreError, FieldNotFoundError, StoreNotFoundError
from actstore.index import ExampleIndex, layer_position
from actstore.layout import keys, spec
from actstore.layout.config import SegmentSpec, StoreConfig
from actstore.layout.records import Manifest
from actstore.read.batched import MappedChunk
from actstore.read.family import is_family
from actstore.read.interface import Reader, ReadItem
from actstore.read.select import is_pair, select
from actstore.read.shard import UNCHECKED_READ_BYTES, ShardReader
from actstore.read.spool import RemovedExamples
from actstore.storage import Storage, open_storage
from actstore.storage.mapping import FileRegion

DEFAULT_CACHE_BYTES = 10 * 2**30  # the local read cache's default size limit


class SegmentView:
    """`store.segment(name)[ex, layer]` -> (length, D) of one segment."""

    def __init__(self, store: ActStore, seg: SegmentSpec):
        self._store = store
        self.spec = seg
        self.name = seg.name
        self.t_max = seg.t_max

    def __getitem__(self, key: tuple[Any, Any]) -> np.ndarray | list[np.ndarray]:
        if not is_pair(key):  # slices and lists: actstore.read.select, this segment only
            return select(self._store, key, segments=(self.spec,))
        ex, layer = _split_key(key)
        return self._store._read_segment(self.spec, ex, layer, pad=False)

    def padded(self, ex: int, layer: int) -> np.ndarray:
        """(T_max, D) with the zero padding, as stored."""
        return self._store._read_segment(self.spec, ex, layer, pad=True)

    def lengths(self) -> np.ndarray:
        """Lengths of this segment for every example, in global order (of a fixed segment,
        its t_max: nothing is read, so planning over many shards costs no request a shard)."""
        if self.spec.fixed:
            return np.full(len(self._store), self.t_max, np.int32)
        return self._store._global_per_sample(self.name + spec.LEN_SUFFIX)


VERIFY_MODES = (None, "fast", "deep", "reads")  # what `verify=` takes (False: None)


class ActStore(Reader):
    """A finalized actstore store, read-only: a Reader (actstore.read.interface).

    `store[ex, layer]` returns the (T_i, D) activations of example `ex` at model layer
    number `layer`, exactly as logged (prompt[:p] then response[:r] for several segments).
    Safe to use from many processes, and picklable (workers reopen it lazily).

    Args:
        path: the store root (holding manifest.json): a local folder, a URL
            (`s3://bucket/prefix`, `gs://...`, `az://...`, `file://...`), or a Storage
            (e.g. `LocalStorage(path, read_nowait=False)`).
        verify: None, "fast" or "deep": verify the store before use (raises
            VerificationError holding the report); "reads": check every activation read
            against its writer's crc32c as it is read (docs/format.md, section 3.4, says
            what reads check without it).
        cache_dir: a local folder keeping the chunk bytes read (e.g. of a store in object
            storage), so that later reads (the next epoch, other DataLoader workers) come
            from local disk; least recently used entries go first beyond `cache_bytes`.
            Entries belong to this store's manifest: a new finalize starts afresh.
        cache_bytes: the cache folder's size limit (default 10 GiB).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        verify: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        if verify not in VERIFY_MODES and verify is not False:
            raise ValueError(f"verify must be one of {list(VERIFY_MODES)}. Got {verify!r}.")
        self._location = path if isinstance(path, (str, Storage)) else os.fspath(path)
        self._verify = verify
        self._cache = (os.fspath(cache_dir), int(cache_bytes)) if cache_dir is not None else None
        self._open()

    def _open(self) -> None:
        self.storage = self._storage_opened = open_storage(self._location)
        local = self.storage.local_root
        # The store's location: a Path for a local folder, the URL string otherwise.
        self.path: Path | str = local if local is not None else self.storage.url
        catalog.check_folder(self.storage)
        if local is not None:
            _refuse_saev_dir(local)
            if is_family(local):
                raise StoreNotFoundError(
                    f"{local} is an aligned family of stores (family.json), not one store; open it with "
                    f"actstore.open({str(local)!r}), which returns a FamilyStore (docs/format.md, section 9)"
                )
            if not local.exists():
                raise StoreNotFoundError(f"no store at {local}")
        self.manifest, data = self._read_manifest()
        self.removed = RemovedExamples.of(self.storage, self.manifest)  # a spool's removed examples (None: no spool)
        self.manifest_sha256 = hashlib.sha256(data).hexdigest()  # the exact state opened (consumers record it)
        if self._cache is not None:
            self.storage = _cached(self.storage, *self._cache)
        for entry in self.manifest.shards:  # a shard folder that leaves the store is refused up front
            catalog.shard_storage(self.storage, entry.name)
        self.config: StoreConfig = self.manifest.config
        self.index = ExampleIndex([s.n_examples for s in self.manifest.shards])
        self._shards: dict[int, ShardReader] = {}
        self._segs = {s.name: s for s in self.config.segments}
        self._one_seg = self.config.segments[0] if len(self._segs) == 1 else None
        self._act_dtype = np.dtype(spec.ACT_DTYPES[self.config.dtype])
        if self._verify in ("fast", "deep"):
            from actstore.verify import verify_store

            verify_store(self._location, deep=self._verify == "deep", raise_on_error=True)

    def _read_manifest(self) -> tuple[Manifest, bytes]:
        """The manifest this reader serves and its bytes (a live view of a store still being
        written builds its own: actstore.loaders.follow)."""
        return catalog.read_manifest_bytes(self.storage)

    def manifest_sha256_now(self) -> str | None:
        """The sha256 of the manifest bytes at the store's location now (None: there is
        none, e.g. the store was deleted); `manifest_sha256` is the state it was opened in."""
        try:
            return hashlib.sha256(self._storage_opened.get(keys.MANIFEST)).hexdigest()
        except FileNotFoundError:
            return None

    # ---- pickling: only the location travels ---------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # A store in object storage travels as its Storage, which carries the provider
        # settings of this process's environment to the worker that unpickles it.
        remote = self._storage_opened if self._storage_opened.local_root is None else self._location
        return {"path": remote, "verify": "reads" if self._verify == "reads" else None, "cache": self._cache}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._location = state["path"]
        self._verify = state["verify"]
        self._cache = state.get("cache")
        self._open()

    # ---- description ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.n_examples

    def __repr__(self) -> str:
        segs = ", ".join(f"{s.name}={s.t_max}" for s in self.config.segments)
        return f"ActStore({str(self.path)!r}, n={len(self)}, layers={list(self.layers)}, d_model={self.d_model}, {segs}, {self.dtype})"

    # layers, d_model, dtype and segments: the Reader protocol's, from self.config

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
    def __getitem__(self, key: tuple[Any, Any]) -> np.ndarray | list[np.ndarray]:
        """`store[ex, layer]` -> (T_i, D); slices and lists of examples and layers
        (`store[0:100, 6]`, `store[[3, 9], :]`) as actstore.read.select describes. A layer
        is a stored layer number or one of its names (`layer_names()`)."""
        if (
            type(key) is tuple
            and len(key) == 2
            and type(key[0]) is int
            and type(key[1]) is int
            and self._one_seg is not None
        ):
            return self._read_segment(self._one_seg, key[0], key[1], pad=False)  # the common case, parsed no further
        key = self._numbered(key)
        if not is_pair(key):
            return select(self, key)
        ex, layer = _split_key(key)
        segs = self.config.segments
        if len(segs) == 1:
            return self._read_segment(segs[0], ex, layer, pad=False)
        parts = [self._read_segment(s, ex, layer, pad=False) for s in segs]
        return np.concatenate(parts, axis=0)  # one copy to join the segments

    def token_ids(self, ex: int) -> np.ndarray | None:
        """The vocabulary ids (int32) of example `ex`'s stored tokens, in the order of
        `store[ex, layer]` (every segment, padding removed); None when the store keeps none."""
        pos, local = self.index.locate(ex)  # (a bad index is refused, ids or not)
        if not self.config.token_ids:
            return None
        sh = self._shard(pos)
        parts = [
            sh.per_sample(keys.token_ids_field(s.name))[local, : int(sh.lengths(s)[local])]
            for s in self.config.segments
        ]
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def lengths(self, ex: int) -> dict[str, int]:
        """True (capped) token counts of example `ex`, per segment."""
        pos, local = self.index.locate(ex)
        sh = self._shard(pos)
        return {s.name: int(sh.lengths(s)[local]) for s in self.config.segments}

    def read_into(self, ex: int, layer: int, segment: str, out: np.ndarray) -> int:
        """Read segment `segment` of (ex, layer) padded to T_max into `out` (stored dtype,
        shape (>= seg.t_pad, D)); returns the example's length. For loaders."""
        seg = self.config.segment(segment)
        sh, local, lp = self._where(ex, layer)
        if out.nbytes > UNCHECKED_READ_BYTES:
            sh.check_backed(seg)
        sh.read_padded(seg, local, lp, out)
        return int(sh.lengths(seg)[local])

    def check_backed(self, ex: int, segments: Any = None) -> None:
        """Before a large read (more than UNCHECKED_READ_BYTES per example and layer): the
        chunk data that the metadata of each segment claim exist on disk (ShardReader.check_backed)."""
        pos, _ = self.index.locate(ex)
        for seg in segments or self.config.segments:
            self._shard(pos).check_backed(seg)

    def read_cached(self, ex: int, layer: int, segment: str, out: np.ndarray) -> bool:
        """read_into, but only if every byte is in the page cache (it never waits for the
        disk); returns False otherwise (then call read_into). For loaders: cached reads are
        memory copies, best done on one thread, and only the others need I/O threads."""
        seg = self.config.segment(segment)
        sh, local, lp = self._where(ex, layer)
        return sh.read_cached(seg, local, lp, out)

    def read_many_into(self, items: Sequence[ReadItem]) -> None:
        """read_into of many (ex, layer, segment, out) at once. The chunks that lie in one
        object are read together: on an object store, the (example, layer) ranges of one
        Zarr shard file come in one batched request (adjacent ranges: one GET). For loaders."""
        groups: dict[tuple[ShardReader, str], list[tuple[int, int, np.ndarray]]] = {}
        for ex, layer, segment, out in items:
            self.config.segment(segment)  # an unknown segment raises before anything is read
            sh, local, lp = self._where(ex, layer)
            groups.setdefault((sh, segment), []).append((local, lp, out))
        for (sh, segment), group in groups.items():
            sh.read_many(self.config.segment(segment), group)

    @property
    def groups_requests(self) -> bool:
        """True in object storage, where units of one object are best read together."""
        return self.storage.coalesce_bytes > 0

    def object_of(self, ex: int, layer: int, segment: str) -> str:
        """The object holding the first chunk of segment `segment` of (ex, layer): units
        that share it are best read by one read_many_into (one request)."""
        sh, local, lp = self._where(ex, layer)
        io = sh.io[segment]
        keys = io.geo.chunk_keys_of(local, lp) if io is not None else [f"{segment}/{local}.{lp}"]
        return sh.storage.where(keys[0])

    def mappable_files(self, segments: Sequence[str]) -> tuple[int, int] | None:
        """(files, largest file's bytes) holding the activations of `segments`, when every
        one can be mapped into a FileRegion (raw chunks on a local disk); else None."""
        n_files, largest = 0, 0
        for name in segments:
            seg = self.config.segment(name)
            for pos in range(len(self.manifest.shards)):
                got = self._shard(pos).files(seg)
                if got is None:
                    return None
                n_files, largest = n_files + got[0], max(largest, got[1])
        return n_files, largest

    def map_unit(self, region: FileRegion, ex: int, layer: int, segment: str) -> list[MappedChunk] | None:
        """Map the files holding segment `segment` of (ex, layer) into `region` (pinned:
        `region.unpin` the slots >= 0 when done): where each token chunk's rows lie. None
        when they cannot be mapped (read them instead). For loaders: a batch is then one
        gather from the page cache into its buffer, the only copy."""
        sh, local, lp = self._where(ex, layer)
        return sh.map_chunks(self.config.segment(segment), region, local, lp)

    def _read_segment(self, seg: SegmentSpec, ex: int, layer: int, *, pad: bool) -> np.ndarray:
        if self.removed is None:
            return self._read_kept(seg, ex, layer, pad=pad)
        pos, local = self.index.locate(ex)
        try:  # a spool: files deleted before or during the read have their removal record already
            out = self._read_kept(seg, ex, layer, pad=pad)
        except (ActstoreError, OSError):
            self.removed.check(ex, self.manifest.shards[pos].shard, local, fresh=True)
            raise
        self.removed.check(ex, self.manifest.shards[pos].shard, local, fresh=True)
        return out

    def _read_kept(self, seg: SegmentSpec, ex: int, layer: int, *, pad: bool) -> np.ndarray:
        sh, local, lp = self._where(ex, layer)
        n = seg.t_max if pad else int(sh.lengths(seg)[local])
        rows = seg.t_pad if pad else -(-n // seg.t_chunk) * seg.t_chunk  # only the chunks holding tokens
        dtype = self._act_dtype
        if rows * self.config.d_model * dtype.itemsize > UNCHECKED_READ_BYTES:
            sh.check_backed(seg)
        buf = np.empty((rows, self.config.d_model), dtype=dtype)
        if not sh.read_mapped(seg, local, lp, buf):  # warm and local: one copy from the page cache
            sh.read_padded(seg, local, lp, buf)
        out = buf[:n]
        if self.config.dtype == "bfloat16":
            return bf16_bits_to_f32(out)
        return out

    def sample(self, ex: int) -> dict[str, Any]:
        """Per-sample metadata of example `ex`: sample_key, lengths, fields and texts."""
        from actstore.layout.arrays import decode_keys

        pos, local = self.index.locate(ex)
        sh = self._shard(pos)
        out: dict[str, Any] = {"example": ex if ex >= 0 else ex + len(self)}
        out["sample_key"] = decode_keys(
            sh.per_sample(spec.SAMPLE_KEY)[local : local + 1], sh.storage.where(keys.field_array(spec.SAMPLE_KEY))
        )[0]
        out["lengths"] = {s.name: int(sh.lengths(s)[local]) for s in self.config.segments}
        for name in self.config.fields:
            out[name] = sh.per_sample(name)[local].item()
        for name in self.config.texts:
            out[name] = sh.text(name, local)
        return out

    def field(self, name: str) -> np.ndarray:
        """A per-sample field (or `sample_key`, or `<segment>_len`) over all examples."""
        if name == spec.SAMPLE_KEY:
            from actstore.layout.arrays import decode_keys

            return np.array(
                [
                    k
                    for pos in range(len(self.manifest.shards))
                    for k in decode_keys(
                        self._shard(pos).per_sample(name), self._shard(pos).storage.where(keys.field_array(name))
                    )
                ]
            )
        if name not in self.field_names():
            raise FieldNotFoundError(
                f"no per-sample field {name!r} in {self.path}; it has {list(self.field_names())} (store.field(name))"
            )
        return self._global_per_sample(name)

    def field_names(self) -> tuple[str, ...]:
        """`sample_key`, the per-sample fields, then per segment `<segment>_len` (and
        `<segment>_token_labels`, `<segment>_token_ids` where kept)."""
        names = [spec.SAMPLE_KEY, *self.config.fields, *(s + spec.LEN_SUFFIX for s in self._segs)]
        if self.config.token_labels:
            names += [s + spec.TOKEN_LABELS_SUFFIX for s in self._segs]
        if self.config.token_ids:
            names += [s + spec.TOKEN_IDS_SUFFIX for s in self._segs]
        return tuple(names)

    def texts(self, name: str) -> Iterator[Any]:
        """Every value of text field `name`, in global example order (an unknown name is
        refused at the call, before anything is read)."""
        if name not in self.config.texts:
            raise FieldNotFoundError(
                f"no text field {name!r} in {self.path}; it has {list(self.config.texts)} (store.texts(name))"
            )
        return (value for pos in range(len(self.manifest.shards)) for value in self._shard(pos).texts(name))

    def to_xarray(self, ex: int | None = None, segment: str | None = None, *, chunks: Any = None):
        """The whole store as a lazy xarray.Dataset; nothing is read until it is indexed.

        Variable `activations` (example, layer, token, d_model), coordinates `layer` (model
        layer numbers) and `layer_name`, per-example lengths, sample keys and fields; see
        actstore.read.xarray. `chunks`: dask chunks (needs dask).

        With `ex`: example `ex` alone, in memory, as a DataArray (layer, token, d_model)
        with padding removed and a `segment` coordinate per token (`segment`: that one only).
        """
        from actstore.read.xarray import example_dataarray, to_dataset

        if ex is None:
            if segment is not None:
                raise TypeError(
                    "segment= goes with an example (to_xarray(ex, segment)); the whole-store Dataset "
                    "holds every segment: select one with ds.where(ds.segment == name, drop=True)"
                )
            return to_dataset(self, chunks=chunks)
        return example_dataarray(self, ex, segment)

    def stats(self):
        """Running statistics merged over all shards (RunningStats), or None if not kept."""
        if self.manifest.stats is None:
            return None
        from actstore.stats import read_stats

        return read_stats(self.storage, self.manifest.stats, then="rerun `actstore finalize` to rewrite it")

    def _global_per_sample(self, name: str) -> np.ndarray:
        parts = [self._shard(pos).per_sample(name) for pos in range(len(self.manifest.shards))]
        return np.concatenate(parts) if parts else np.zeros(0)

    def layer_names(self) -> dict[str, int]:
        """Every name a stored layer answers to -> its layer number: the capture's hook names
        (TransformerLens-style, `blocks.8.hook_resid_post`) and module paths (`model.layers.8`)."""
        attrs = self.config.attrs
        names: dict[str, int] = {}
        for k in ("hooks", "hook_names"):
            table = attrs.get(k)
            if isinstance(table, dict):
                for n, name in table.items():
                    if isinstance(name, str) and str(n).lstrip("-").isdigit() and int(n) in self.config.layers:
                        names[name] = int(n)
        return names

    def _numbered(self, key: Any) -> Any:
        """A key with each layer (a name, a negative number) replaced by its layer number."""
        if isinstance(key, tuple) and len(key) == 2:
            layer = key[1]
            if isinstance(layer, list):
                return key[0], [self.layer_number(x) for x in layer]
            if not isinstance(layer, (slice, np.ndarray)):
                return key[0], self.layer_number(layer)
        return key

    def _where(self, ex: int, layer: Any) -> tuple[ShardReader, int, int]:
        """(shard reader, local example, layer position) of (ex, layer); clear errors for either."""
        layer = self.layer_number(layer)
        pos, local = self.index.locate(ex)
        lp = layer_position(self.config.layers, layer)
        if self.removed is not None:
            self.removed.check(ex, self.manifest.shards[pos].shard, local)
        return self._shard(pos), local, lp

    def _shard(self, pos: int) -> ShardReader:
        sh = self._shards.get(pos)
        if sh is None:
            sh = ShardReader(self.storage, self.manifest.shards[pos], self.config, check_reads=self._verify == "reads")
            self._shards[pos] = sh
        return sh


def _split_key(key: Any) -> tuple[int, int]:
    if not isinstance(key, tuple) or len(key) != 2:
        raise TypeError(f"index the store as store[example, layer] with two ints, got {key!r}")
    ex, layer = key
    if not isinstance(ex, (int, np.integer)) or isinstance(ex, bool):
        raise TypeError(f"example index must be an int, got {ex!r}")
    return int(ex), layer


def _cached(storage: Storage, cache_dir: str, cache_bytes: int) -> Storage:
    """The store's storage behind a local read cache, namespaced by its URL and manifest."""
    import hashlib

    from actstore.layout import keys
    from actstore.storage.cache import CachedStorage

    manifest = storage.get(keys.MANIFEST)  # read again: the namespace is its exact bytes
    namespace = hashlib.sha256(storage.url.encode() + b"\0" + manifest).hexdigest()
    return CachedStorage(
        storage, cache_dir, max_bytes=cache_bytes, namespace=namespace, cacheable=keys.is_published_data
    )


def _refuse_saev_dir(path: Path) -> None:
    """ActStore reads actstore stores only; a saev directory is pointed to actstore.open."""
    if os.path.lexists(path / spec.MANIFEST_FILE):
        return
    from actstore.layout import saevspec as saev_protocol  # constants only

    if (path / saev_protocol.METADATA_FILE).is_file() and (path / saev_protocol.SHARDS_FILE).is_file():
        raise StoreNotFoundError(
            f"{path} is a saev shard directory, not an actstore store; open it with actstore.open({str(path)!r}), "
            "which returns a SaevStore with the same reading API"
        )
