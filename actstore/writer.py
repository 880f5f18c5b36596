"""ShardWriter: batches from a user's inference loop -> one writer shard of a store.

Commit protocol (docs/format.md, "Commits"): activation chunk files are written as batches
arrive; every `commit_bytes` the writer writes the per-sample arrays, grows the array
shapes, appends a block record (with crc32c) to meta/blocks.jsonl and then atomically
replaces meta/commit.json. commit.json is the single commit point: anything past its
`n_committed` is invisible and is rolled back by a resumed writer.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actstore import __version__, spec
from actstore.bgwrite import BackgroundShardFiles
from actstore.chunkio import ChunkLayout, crc32c, layout_from_metadata, load_array_meta
from actstore.layout.config import StoreConfig, check_format_header, make_config
from actstore.dtypes import clip_to, convert, to_numpy
from actstore.errors import (
    AppendError,
    CorruptStoreError,
    DiskFullError,
    Float16OverflowError,
    NonFiniteError,
    ShardCompleteError,
    ShardExistsError,
    StoreMismatchError,
)
from actstore.fsutil import atomic_write_json, create_exclusive_json, safe_child, syncfs
from actstore.stats import RunningStats, stats_key
from actstore import zarrio

# Per (example, segment, layer) crc32c of the chunk bytes (token-chunk order, padding
# included), little-endian uint32, appended at each commit; lets `actstore verify --deep`
# name the damaged (example, layer). Shards without it are checked per block.
EL_CRC_FILE = spec.EL_CRC_FILE
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def shard_dir(root: str | os.PathLike, shard: int) -> Path:
    return Path(root) / spec.SHARDS_DIR / spec.SHARD_NAME_FORMAT.format(shard)


def claim_store(root: Path, cfg: StoreConfig) -> StoreConfig:
    """Create the store's identity file, or check that the existing store has `cfg`."""
    ident_path = root / spec.IDENTITY_FILE
    if not ident_path.exists():
        if root.exists():
            foreign = [p.name for p in root.iterdir() if p.name not in (spec.SHARDS_DIR, spec.MANIFEST_FILE) and not p.name.startswith(".")]
            if foreign:
                raise StoreMismatchError(
                    f"{root} already holds files that are not an actstore store ({', '.join(sorted(foreign)[:5])}); "
                    "write the store to a new or empty folder"
                )
        root.mkdir(parents=True, exist_ok=True)
        ident = {"format": spec.FORMAT_NAME, "format_version": spec.FORMAT_VERSION, "config": cfg.to_json()}
        if create_exclusive_json(ident_path, ident):
            return cfg
    existing = read_identity(root)
    existing.check_same_store(cfg, str(root))
    return existing


def read_identity(root: Path) -> StoreConfig:
    path = root / spec.IDENTITY_FILE
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptStoreError(f"{path} is not valid JSON ({e}); the store's identity file is damaged") from None
    check_format_header(d, str(path))
    try:
        return StoreConfig.from_json(d.get("config"))
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # untrusted JSON: any shape
        raise CorruptStoreError(f"{path}: bad config ({e}); the store's identity file is damaged") from None


class ShardWriter:
    """Writes one shard of an actstore store from a user's inference loop.

    Several processes may write different shards of one store at once, without locks.
    Use as a context manager; leaving the block normally closes (completes) the shard,
    leaving it with an exception commits what was appended so a resumed writer continues.

    Args:
        path: the store's root folder (created if needed).
        shard: this writer's shard number (0..99999), unique per writer.
        layers: the model layer numbers recorded, in the order of the batch's L axis.
        d_model: activation width D.
        tokens: T for a store with one fixed-length segment (ViT: patches + CLS).
        segments: {name: T_max} for zero-padded variable-length segments, e.g.
            {"prompt": 256, "response": 64}; lengths are passed with each batch.
        dtype: "float16" (default), "bfloat16" or "float32".
        t_chunk: token chunk length (int, or {segment: int}); default keeps chunks <= 4 MiB.
        zarr_format: 2 (default) or 3.
        shard_examples: with zarr_format=3, examples per Zarr shard file (sharding codec);
            batches are staged per shard file (up to 3 buffers of one shard file each,
            per segment) and a background thread writes each full one.
        fields: per-sample numeric fields {name: dtype}, e.g. {"label": "int64", "split": "int8"}.
        texts: names of per-sample JSON text fields, written to text/<name>.jsonl.
        token_labels: store a uint8 label per token (saev labels.bin).
        model_id, attrs: global metadata (free-form attrs, JSON-serialisable).
        resume: continue an existing shard after its last committed example.
        overwrite: delete an existing shard of this number first.
        commit_bytes: commit a block after this many activation bytes.
        on_nonfinite: "count" (store and count NaN/inf) or "raise".
        on_overflow: "raise" (default) or "clip" finite values beyond the stored dtype's range.
        compressor: a zarr compressor (e.g. zarr.codecs.ZstdCodec()); disables the raw fast path.
        engine: "auto", "direct" (write chunk files) or "zarr" (write through zarr-python).
        stats: keep running statistics per (layer, segment) of the stored vectors.
        fsync: flush the filesystem (syncfs) before each commit, for power-loss durability.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        shard: int = 0,
        layers: Sequence[int],
        d_model: int,
        tokens: int | None = None,
        segments: Mapping[str, int] | None = None,
        dtype: Any = spec.DEFAULT_DTYPE,
        t_chunk: int | Mapping[str, int] | None = None,
        zarr_format: int = spec.DEFAULT_ZARR_FORMAT,
        shard_examples: int | None = None,
        fields: Mapping[str, Any] | None = None,
        texts: Sequence[str] = (),
        token_labels: bool = False,
        model_id: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        resume: bool = False,
        overwrite: bool = False,
        commit_bytes: int = spec.DEFAULT_COMMIT_BYTES,
        on_nonfinite: str = "count",
        on_overflow: str = "raise",
        compressor: Any = None,
        engine: str = "auto",
        stats: bool = False,
        fsync: bool = False,
    ):
        if not isinstance(shard, int) or not 0 <= shard <= spec.MAX_SHARD:
            raise ValueError(f"shard must be an int in 0..{spec.MAX_SHARD}. Got {shard!r}.")
        if on_nonfinite not in ("count", "raise"):
            raise ValueError(f"on_nonfinite must be one of ['count', 'raise']. Got {on_nonfinite!r}.")
        if on_overflow not in ("raise", "clip"):
            raise ValueError(f"on_overflow must be one of ['raise', 'clip']. Got {on_overflow!r}.")
        if engine not in ("auto", "direct", "zarr"):
            raise ValueError(f"engine must be one of ['auto', 'direct', 'zarr']. Got {engine!r}.")
        cfg = make_config(
            layers=layers, d_model=d_model, dtype=dtype, tokens=tokens, segments=segments, t_chunk=t_chunk,
            zarr_format=zarr_format, shard_examples=shard_examples, fields=fields, texts=texts,
            token_labels=token_labels, model_id=model_id, attrs=attrs,
        )
        self.root = Path(path)
        self.shard = shard
        claim_store(self.root, cfg)
        self.cfg = cfg  # equal to the store's identity except free-form attrs, kept per shard
        self._created = _now()
        direct_ok = compressor is None
        if engine == "direct" and not direct_ok:
            raise ValueError("engine='direct' writes raw chunk files: it needs no compressor")
        self.engine = "direct" if (engine == "auto" and direct_ok) or engine == "direct" else "zarr"
        # Batches are buffered until a commit when zarr-python writes them; with Zarr
        # sharding they are staged per shard file (written by a background thread); else
        # chunk files go out at append.
        self._buffered = self.engine == "zarr" or cfg.shard_examples is not None
        self.compressor = compressor
        self.commit_bytes = int(commit_bytes)
        self.on_nonfinite = on_nonfinite
        self.on_overflow = on_overflow
        self.fsync = fsync
        self.dir = shard_dir(self.root, shard)
        self._closed = False
        self._init_counters()
        self.stats = RunningStats([stats_key(l, s.name) for l in cfg.layers for s in cfg.segments], cfg.d_model) if stats else None
        if self.dir.exists():
            if overwrite:
                self._refuse_if_published("overwrite")
                shutil.rmtree(self.dir)
                self._create()
            elif resume:
                self._recover()
            else:
                n = _read_commit(self.dir).get("n_committed", "?")
                raise ShardExistsError(
                    f"shard {shard} of {self.root} already exists ({n} committed examples); "
                    "pass resume=True to continue it or overwrite=True to replace it"
                )
        else:
            self._create()
        self._open_arrays()

    # ---- setup --------------------------------------------------------------------
    def _init_counters(self) -> None:
        names = [s.name for s in self.cfg.segments]
        self.n_committed = 0
        self.n_written = 0
        self.n_blocks = 0
        self.truncated = dict.fromkeys(names, 0)
        self.nonfinite = dict.fromkeys(names, 0)
        self.overflow = dict.fromkeys(names, 0)
        self.text_bytes = dict.fromkeys(self.cfg.texts, 0)
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_text: dict[str, list[bytes]] = {n: [] for n in self.cfg.texts}
        self._pending_acts: dict[str, list[np.ndarray]] = {s.name: [] for s in self.cfg.segments}
        self._block_crc = dict.fromkeys(names, 0)
        self._el_crc: dict[str, list[int]] = {n: [] for n in names}
        self._el_crc_file = True  # False for a resumed shard written without EL_CRC_FILE
        self._block_bytes = 0
        self._stats_file: str | None = None

    def _refuse_if_published(self, what: str) -> None:
        mpath = self.root / spec.MANIFEST_FILE
        if mpath.exists():
            try:
                names = [s["name"] for s in json.loads(mpath.read_text())["shards"]]
            except Exception:  # noqa: BLE001 - a damaged manifest does not protect anything
                names = []
            if self.dir.name in names:
                raise ShardExistsError(
                    f"cannot {what} shard {self.shard}: it is part of the finalized manifest of {self.root}; "
                    f"readers depend on it. Write a new shard number instead."
                )

    def _create(self) -> None:
        (self.root / spec.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        tmp = self.dir.with_name(f".{self.dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            group = zarrio.open_group(tmp, mode="w", zarr_format=self.cfg.zarr_format)
            zarrio.create_shard_arrays(group, self.cfg, self.compressor)
            group.attrs.update(self._shard_attrs())
            for d in (spec.META_DIR, spec.TEXT_DIR):
                (tmp / d).mkdir(exist_ok=True)
            for name in self.cfg.texts:
                (tmp / spec.TEXT_DIR / f"{name}.jsonl").touch()
            (tmp / spec.BLOCKS_FILE).touch()
            (tmp / EL_CRC_FILE).touch()
            atomic_write_json(tmp / spec.COMMIT_FILE, self._commit_record(False))
            try:
                os.rename(tmp, self.dir)
            except OSError:
                raise ShardExistsError(
                    f"shard {self.shard} of {self.root} was created by another writer at the same time; "
                    "give each writer its own shard number"
                ) from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _recover(self) -> None:
        rec = _read_commit(self.dir)
        if rec.get("complete"):
            raise ShardCompleteError(
                f"shard {self.shard} of {self.root} is complete with {rec['n_committed']} examples; "
                "nothing to resume (use overwrite=True to rewrite it, or another shard number)"
            )
        attrs = json.loads(((self.dir / ".zattrs") if self.cfg.zarr_format == 2 else (self.dir / "zarr.json")).read_text())
        attrs = attrs.get("attributes", attrs)
        old = StoreConfig.from_json(attrs.get("actstore", {}).get("config"))
        old.check_same_store(self.cfg, f"shard {self.shard} of {self.root}")
        n = int(rec["n_committed"])
        self.n_committed = self.n_written = n
        self.n_blocks = int(rec["n_blocks"])
        for k in ("truncated", "nonfinite", "overflow"):
            getattr(self, k).update({s: int(v) for s, v in rec[k].items()})
        group = zarrio.open_group(self.dir, mode="r+")
        for seg in self.cfg.segments:
            _drop_chunks_from(self.dir / zarrio.acts_name(seg.name), n, self.cfg)
        self._group = group
        self._resize_all(n)
        for name, size in rec["text_bytes"].items():
            if name not in self.cfg.texts:  # the name becomes a path: only declared texts
                raise CorruptStoreError(f"{self.dir / spec.COMMIT_FILE} names text {name!r}; the store declares texts {list(self.cfg.texts)}")
            with open(self.dir / spec.TEXT_DIR / f"{name}.jsonl", "r+b") as f:
                f.truncate(int(size))
            self.text_bytes[name] = int(size)
        _truncate_lines(self.dir / spec.BLOCKS_FILE, self.n_blocks)
        el_path = self.dir / EL_CRC_FILE
        el_size = n * len(self.cfg.segments) * self.cfg.n_layers * 4
        if el_path.exists() and el_path.stat().st_size >= el_size:
            with open(el_path, "r+b") as f:
                f.truncate(el_size)
        else:  # written by an older writer (or damaged): verify falls back to block checksums
            el_path.unlink(missing_ok=True)
            self._el_crc_file = False
        if self.stats is not None:
            if rec.get("stats_file"):
                self.stats.merge(RunningStats.load(safe_child(self.dir, rec["stats_file"])))
                self._stats_file = rec["stats_file"]
            elif n:
                warnings.warn(f"shard {self.shard}: resumed with stats=True but the committed part kept no statistics", stacklevel=3)
        for p in list(self.dir.rglob(".*.tmp-*")):
            p.unlink(missing_ok=True)

    def _open_arrays(self) -> None:
        if not hasattr(self, "_group"):
            self._group = zarrio.open_group(self.dir, mode="r+")
        self._acts = {s.name: self._group[zarrio.acts_name(s.name)] for s in self.cfg.segments}
        self._layouts: dict[str, ChunkLayout] = {}
        if self.engine == "direct":
            for s in self.cfg.segments:
                d = self.dir / zarrio.acts_name(s.name)
                lay = layout_from_metadata(d, load_array_meta(d), self.cfg.n_layers, self.cfg.d_model)
                assert lay is not None
                self._layouts[s.name] = lay
        self._text_files = {n: open(self.dir / spec.TEXT_DIR / f"{n}.jsonl", "ab") for n in self.cfg.texts}
        # Direct writes of Zarr shard files: a background thread writes each full shard
        # file while batches go on into the next staging buffer.
        self._bg: BackgroundShardFiles | None = None
        if self.engine == "direct" and self.cfg.shard_examples is not None:
            shapes = {s.name: (self.cfg.n_layers, s.n_chunks * s.t_chunk, self.cfg.d_model) for s in self.cfg.segments}
            self._bg = BackgroundShardFiles(self._layouts, shapes, np.dtype(self.cfg.zarr_dtype))
            self._stage = self._bg.take_buffer()
            S = self.cfg.shard_examples
            self._stage_first = self.n_written // S * S
            self._stage_n = self._stage_written = self.n_written - self._stage_first
            if self._stage_n:  # resumed after a commit that wrote a partial shard: reload it
                for s in self.cfg.segments:
                    for i in range(self._stage_n):
                        for lp in range(self.cfg.n_layers):
                            self._layouts[s.name].read_into(self._stage_first + i, lp, self._stage[s.name][i, lp])

    def _per_sample_names(self) -> list[str]:
        names = [zarrio.len_name(s.name) for s in self.cfg.segments]
        if self.cfg.token_labels:
            names += [zarrio.labels_name(s.name) for s in self.cfg.segments]
        names.append(zarrio.field_name(spec.SAMPLE_KEY))
        names += [zarrio.field_name(f) for f in self.cfg.fields]
        return names

    def _resize_all(self, n: int) -> None:
        for name in self._per_sample_names() + [zarrio.acts_name(s.name) for s in self.cfg.segments]:
            _set_rows(self._group[name], n)

    # ---- append -------------------------------------------------------------------
    def append(
        self,
        acts: Any = None,
        *,
        lengths: Any = None,
        source_lengths: Any = None,
        sample_keys: Sequence[str] | None = None,
        fields: Mapping[str, Any] | None = None,
        texts: Mapping[str, Sequence[Any]] | None = None,
        token_labels: Any = None,
        batch_stats: RunningStats | None = None,
        **segment_acts: Any,
    ) -> range:
        """Append a batch of examples; returns their local indices in this shard.

        Args:
            acts: (b, L, T, D) activations for a one-segment store (numpy or torch,
                float16/bfloat16/float32/float64). For several segments pass them by name
                instead: append(prompt=..., response=..., lengths={...}).
            lengths: true token counts (b,) per segment (a dict for several segments),
                each <= T_max; omitted means the batch's T. Fixed segments take none.
            source_lengths: uncapped lengths, used only to count truncated examples.
            sample_keys: b strings of at most 64 UTF-8 bytes identifying the examples.
            fields: {field: (b,) values} for the fields declared at construction.
            texts: {text name: b JSON-serialisable values}.
            token_labels: (b, T_max) uint8 per segment (a dict for several segments).
            batch_stats: statistics already computed for this batch (merged as is).
        """
        self._check_open()
        cfg = self.cfg
        undo = self._undo_point()
        seg_names = [s.name for s in cfg.segments]
        if acts is not None:
            if len(seg_names) != 1:
                raise AppendError(f"this store has segments {seg_names}: pass each by name, e.g. append(prompt=..., response=...)")
            segment_acts = {seg_names[0]: acts, **segment_acts}
        unknown = sorted(set(segment_acts) - set(seg_names))
        missing = [s for s in seg_names if s not in segment_acts]
        if unknown or missing:
            raise AppendError(f"append needs activations for segments {seg_names}; got {sorted(segment_acts)}")
        lengths_d = _per_segment(lengths, seg_names, "lengths")
        src_d = _per_segment(source_lengths, seg_names, "source_lengths")
        labels_d = _per_segment(token_labels, seg_names, "token_labels")
        # Counters change while segments are validated: a refused batch restores them.
        try:
            prepared: dict[str, np.ndarray] = {}
            aliased: dict[str, bool] = {}
            lens_out: dict[str, np.ndarray] = {}
            b = None
            for seg in cfg.segments:
                x, src = to_numpy(segment_acts[seg.name], f"activations of segment {seg.name!r}")
                if x.ndim != 4:
                    raise AppendError(f"segment {seg.name!r}: expected a batch of shape (b, L={cfg.n_layers}, T, D={cfg.d_model}), got shape {tuple(x.shape)}")
                if b is None:
                    b = x.shape[0]
                elif x.shape[0] != b:
                    raise AppendError(f"segment {seg.name!r} has {x.shape[0]} examples but another segment has {b}")
                if x.shape[1] != cfg.n_layers:
                    raise AppendError(f"segment {seg.name!r}: batch has {x.shape[1]} layers, the store records {cfg.n_layers} (layers {list(cfg.layers)})")
                if x.shape[3] != cfg.d_model:
                    raise AppendError(f"segment {seg.name!r}: batch has d_model {x.shape[3]}, the store has d_model {cfg.d_model}")
                t = x.shape[2]
                if seg.fixed and t != seg.t_max:
                    raise AppendError(f"segment {seg.name!r} holds exactly {seg.t_max} tokens per example; the batch has {t}")
                if t > seg.t_max:
                    raise AppendError(f"segment {seg.name!r}: batch has {t} tokens but the store holds at most {seg.t_max}; truncate it to {seg.t_max} (and pass source_lengths to record truncation)")
                lens = self._lengths(seg, lengths_d.get(seg.name), b, t)
                try:
                    stored, nonfinite, over = convert(x, src, cfg.dtype)
                except TypeError as e:
                    raise AppendError(f"segment {seg.name!r}: {e}") from None
                if nonfinite and self.on_nonfinite == "raise":
                    raise NonFiniteError(f"segment {seg.name!r}: the batch holds {nonfinite} NaN or infinite values; nothing of this batch was written (pass on_nonfinite='count' to store and count them)")
                if over:
                    if self.on_overflow == "raise":
                        raise Float16OverflowError(
                            f"segment {seg.name!r}: {over} finite {src} values lie beyond the range of {cfg.dtype} "
                            f"(|x| > {65504 if cfg.dtype == 'float16' else 'float32 max'}) and would be stored as inf; "
                            "nothing of this batch was written. Store with dtype='float32' or 'bfloat16', or pass "
                            "on_overflow='clip' to saturate them (counted in the store's metadata)"
                        )
                    stored, _, _ = convert(clip_to(x, src, cfg.dtype), "float32" if src == "bfloat16" else src, cfg.dtype)
                prepared[seg.name] = _pad_tokens(stored, seg.n_chunks * seg.t_chunk)
                # Buffered batches outlive append: never keep a view of the caller's memory.
                aliased[seg.name] = np.may_share_memory(prepared[seg.name], x)
                lens_out[seg.name] = lens
                self.nonfinite[seg.name] += nonfinite
                self.overflow[seg.name] += over
                if seg.name in src_d:
                    s = np.asarray(src_d[seg.name]).reshape(-1)
                    if s.shape != (b,):
                        raise AppendError(f"source_lengths for {seg.name!r} must have shape ({b},), got {s.shape}")
                    self.truncated[seg.name] += int(np.count_nonzero(s > seg.t_max))
            assert b is not None
            per_sample = self._prepare_per_sample(b, lens_out, labels_d, sample_keys, fields, texts)
        except AppendError:
            self._undo(undo)
            raise
        # Everything is validated: from here on the batch is written.
        n0 = self.n_written
        if self._bg is not None:  # staged (and checksummed) for the background shard-file writer
            self._check_background()
            self._stage_batch(prepared, b)
        elif self._buffered:  # kept until the commit, through zarr-python
            for seg in cfg.segments:
                arr = prepared[seg.name]
                self._pending_acts[seg.name].append(arr.copy() if aliased[seg.name] else arr)
        else:
            self._write_chunks(prepared, b, n0, undo)
        for seg in cfg.segments:
            arr = prepared[seg.name]
            if self._bg is None:  # else staging computed them
                self._el_crc[seg.name].extend(crc32c(arr[i, lp]) for i in range(b) for lp in range(cfg.n_layers))
            if self.stats is not None and batch_stats is None:
                self._update_stats(seg, arr, lens_out[seg.name])
        if batch_stats is not None and self.stats is not None:
            self.stats.merge(batch_stats)
        for name, values in per_sample.items():
            self._pending.setdefault(name, []).append(values)
        self.n_written = n0 + b
        self._block_bytes += sum(a.nbytes for a in prepared.values())
        if self._block_bytes >= self.commit_bytes and (
            # With Zarr sharding, prefer a commit where a shard file just filled: a commit
            # elsewhere writes the partial shard file, rewritten once it fills.
            self._bg is None or self._stage_n == 0 or self._block_bytes >= 2 * self.commit_bytes
        ):
            self.commit()
        return range(n0, n0 + b)

    def _write_chunks(self, prepared: dict[str, np.ndarray], b: int, n0: int, undo: tuple) -> None:
        """Write the batch's chunk files now (unsharded direct layout)."""
        try:
            for seg in self.cfg.segments:
                arr, lay, crc = prepared[seg.name], self._layouts[seg.name], self._block_crc[seg.name]
                for i in range(b):
                    crc = lay.write_example(n0 + i, arr[i], crc)
                self._block_crc[seg.name] = crc
        except OSError as e:
            self._undo(undo)
            if e.errno in _DISK_FULL_ERRNOS:
                raise self._disk_full(
                    e, f"writing chunk files of shard {self.shard} of {self.root}",
                    f"this batch of {b} examples was not added; the shard keeps its last commit ({self.n_committed} examples). "
                    f"Free space, then append again, or reopen with ShardWriter(..., shard={self.shard}, resume=True)",
                ) from e
            raise

    def _stage_batch(self, prepared: dict[str, np.ndarray], b: int) -> None:
        """Copy a batch into the staging buffer; hand each full buffer to the background thread."""
        S = self.cfg.shard_examples
        i = 0
        while i < b:
            k = min(b - i, S - self._stage_n)
            for name, arr in prepared.items():
                part = self._stage[name][self._stage_n : self._stage_n + k]
                part[...] = arr[i : i + k]
                # Checksums here, on rows just copied (in cache), while the background
                # thread writes: per (example, layer), and the block's chained crc32c.
                el, crc = self._el_crc[name], self._block_crc[name]
                for row in part:
                    for lrow in row:
                        el.append(crc32c(lrow))
                        crc = crc32c(lrow, crc)
                self._block_crc[name] = crc
            self._stage_n += k
            i += k
            if self._stage_n == S:
                self._submit_stage()

    def _submit_stage(self) -> None:
        assert self._bg is not None
        self._bg.submit(self._stage, self._stage_first, self._stage_n)
        self._stage_first += self._stage_n
        self._stage_n = self._stage_written = 0
        self._stage = self._bg.take_buffer()

    def _check_background(self, drain: bool = False) -> None:
        """Raise a failed background shard-file write as the writer's error; it closes the writer."""
        assert self._bg is not None
        try:
            self._bg.drain() if drain else self._bg.check()
        except OSError as e:
            self._close_files()  # a shard file is missing past the last commit: only a resume continues
            self._fail_since_commit(e, f"writing shard files of shard {self.shard} of {self.root}")

    def _lengths(self, seg: Any, given: Any, b: int, t: int) -> np.ndarray:
        if given is None:
            return np.full(b, t, np.int32)
        if seg.fixed:
            raise AppendError(f"segment {seg.name!r} has a fixed length ({seg.t_max} tokens); do not pass lengths for it")
        lens, _ = to_numpy(given, "lengths")
        lens = np.asarray(lens).reshape(-1)
        if lens.shape != (b,) or lens.dtype.kind not in "iu":
            raise AppendError(f"lengths of segment {seg.name!r} must be {b} ints, got {lens.dtype} of shape {lens.shape}")
        if (lens < 0).any() or (lens > t).any():
            bad = int(lens[(lens < 0) | (lens > t)][0])
            raise AppendError(
                f"segment {seg.name!r}: length {bad} is beyond the batch's {t} tokens (T_max {seg.t_max}); "
                "lengths must be the true token counts capped to T_max"
            )
        return lens.astype(np.int32)

    def _prepare_per_sample(self, b, lens_out, labels_d, sample_keys, fields, texts) -> dict[str, np.ndarray]:
        cfg = self.cfg
        out: dict[str, np.ndarray] = {}
        for seg in cfg.segments:
            out[zarrio.len_name(seg.name)] = lens_out[seg.name]
            if cfg.token_labels:
                lab = labels_d.get(seg.name)
                if lab is None:
                    raise AppendError(f"this store records token_labels: pass token_labels for segment {seg.name!r} ((b, {seg.t_max}) uint8)")
                lab, _ = to_numpy(lab, "token_labels")
                lab = np.asarray(lab)
                if lab.ndim != 2 or lab.shape[0] != b or lab.shape[1] > seg.t_max:
                    raise AppendError(f"token_labels of segment {seg.name!r} must have shape ({b}, <= {seg.t_max}), got {lab.shape}")
                if lab.size and (lab.min() < 0 or lab.max() > 255):
                    raise AppendError(f"token_labels of segment {seg.name!r} must be in 0..255 (uint8)")
                out[zarrio.labels_name(seg.name)] = _pad_tokens(lab.astype(np.uint8)[:, None, :, None], seg.t_max)[:, 0, :, 0]
            elif labels_d:
                raise AppendError("this store was created without token_labels=True; token labels cannot be stored")
        if sample_keys is None:
            keys = [f"{self.shard}-{self.n_written + i}" for i in range(b)]
        else:
            keys = [str(k) for k in sample_keys]
            if len(keys) != b:
                raise AppendError(f"got {len(keys)} sample_keys for a batch of {b}")
        try:
            out[zarrio.field_name(spec.SAMPLE_KEY)] = zarrio.encode_keys(keys, cfg.zarr_format)
        except ValueError as e:
            raise AppendError(str(e)) from None
        fields = dict(fields or {})
        if set(fields) != set(cfg.fields):
            raise AppendError(f"this store declares fields {sorted(cfg.fields)}; the batch gives {sorted(fields)}")
        for name, dt in cfg.fields.items():
            v, _ = to_numpy(fields[name], f"field {name}")
            v = np.asarray(v).reshape(-1)
            if v.shape != (b,):
                raise AppendError(f"field {name!r} must have {b} values, got shape {v.shape}")
            try:
                out[zarrio.field_name(name)] = v.astype(dt, casting="same_kind")
            except TypeError:
                raise AppendError(f"field {name!r} holds {v.dtype} values that do not fit its dtype {np.dtype(dt)}") from None
        texts = dict(texts or {})
        if set(texts) != set(cfg.texts):
            raise AppendError(f"this store declares texts {list(cfg.texts)}; the batch gives {sorted(texts)}")
        lines_by_name = {}
        for name in cfg.texts:
            vals = list(texts[name])
            if len(vals) != b:
                raise AppendError(f"text {name!r} has {len(vals)} values for a batch of {b}")
            try:
                lines_by_name[name] = [
                    (json.dumps({"i": self.n_written + i, "sample_key": keys[i], name: v}, ensure_ascii=False) + "\n").encode("utf-8")
                    for i, v in enumerate(vals)
                ]
            except (TypeError, ValueError) as e:
                raise AppendError(f"text {name!r} holds a value that is not JSON-serialisable: {e}") from None
        for name, lines in lines_by_name.items():
            self._pending_text[name].extend(lines)
        return out

    def _update_stats(self, seg: Any, arr: np.ndarray, lens: np.ndarray) -> None:
        x = arr[:, :, : seg.t_max]
        if self.cfg.dtype == "bfloat16":
            from actstore.dtypes import bf16_bits_to_f32

            x = bf16_bits_to_f32(x)
        for lp, layer in enumerate(self.cfg.layers):
            xl = x[:, lp]
            if (lens == seg.t_max).all():
                v = xl.reshape(-1, self.cfg.d_model)
            else:
                mask = np.arange(seg.t_max)[None, :] < lens[:, None]
                v = xl[mask]
            self.stats.update(stats_key(layer, seg.name), v)

    def _undo_point(self) -> tuple:
        """What append changes before a batch is accounted: restored when writing it fails."""
        return (
            dict(self._block_crc), dict(self.truncated), dict(self.nonfinite), dict(self.overflow),
            {k: len(v) for k, v in self._pending_text.items()}, {k: len(v) for k, v in self._pending_acts.items()},
        )

    def _undo(self, point: tuple) -> None:
        crc, trunc, nonfinite, overflow, n_text, n_acts = point
        self._block_crc, self.truncated, self.nonfinite, self.overflow = crc, trunc, nonfinite, overflow
        for k, n in n_text.items():
            del self._pending_text[k][n:]
        for k, n in n_acts.items():
            del self._pending_acts[k][n:]

    def _disk_full(self, e: OSError, doing: str, then: str) -> DiskFullError:
        where = f": {e.filename}" if e.filename else ""
        err = DiskFullError(f"out of disk space while {doing} ({os.strerror(e.errno)}{where}); {then}")
        err.errno = e.errno
        return err

    # ---- commit -------------------------------------------------------------------
    def commit(self) -> None:
        """Make every appended example durable and visible to finalize (one block)."""
        self._check_open()
        self._commit(complete=False)

    def _commit(self, complete: bool) -> None:
        try:
            self._commit_block(complete)
        except DiskFullError:
            raise  # a failed background write, already explained
        except OSError as e:
            self._fail_since_commit(e, f"committing shard {self.shard} of {self.root}")

    def _fail_since_commit(self, e: OSError, doing: str) -> None:
        """Raise `e`; when the disk is full, close the writer (its in-memory state is past
        the last commit: only a resume continues) and say so."""
        if e.errno not in _DISK_FULL_ERRNOS:
            raise e
        lost = self.n_written - self.n_committed
        self._close_files()
        raise self._disk_full(
            e, doing,
            f"the shard keeps its last commit ({self.n_committed} examples); the {lost} examples appended since "
            f"were not committed. Free space, then continue with ShardWriter(..., shard={self.shard}, resume=True)",
        ) from e

    def _commit_block(self, complete: bool) -> None:
        cfg = self.cfg
        n0 = self.n_committed
        n1 = self._flush_buffered(complete) if self._buffered else self.n_written
        if n1 == n0 and not complete:
            return
        if n1 > n0:
            for name in self._per_sample_names():
                vals = self._take_pending(name, n1 - n0)
                arr = self._group[name]
                _set_rows(arr, n1)
                arr[n0:n1] = vals
            for seg in cfg.segments:
                _set_rows(self._acts[seg.name], n1)
            for name, f in self._text_files.items():
                lines = self._pending_text[name]
                f.write(b"".join(lines[: n1 - n0]))
                del lines[: n1 - n0]
                f.flush()
                self.text_bytes[name] = f.tell()
            block = {
                "start": n0,
                "stop": n1,
                "crc32c": dict(self._block_crc),
                "nbytes": (n1 - n0) * cfg.example_bytes(),
            }
            k = (n1 - n0) * cfg.n_layers
            el_esl = np.stack([np.array(self._el_crc[s.name][:k], "<u4").reshape(n1 - n0, cfg.n_layers) for s in cfg.segments], axis=1)
            for s in cfg.segments:
                del self._el_crc[s.name][:k]
            if self._el_crc_file:
                with open(self.dir / EL_CRC_FILE, "ab") as f:
                    f.write(el_esl.tobytes())
            with open(self.dir / spec.BLOCKS_FILE, "ab") as f:
                f.write((json.dumps(block) + "\n").encode())
            self.n_blocks += 1
        old_stats = self._stats_file
        if self.stats is not None:
            self._stats_file = spec.STATS_FILE_FORMAT.format(n1)
            self.stats.save(self.dir / self._stats_file)
        if complete:
            self._group.attrs.update(self._shard_attrs(n1))
            _write_consolidated(self.dir, cfg.zarr_format)
        if self.fsync:
            syncfs(self.dir)
        atomic_write_json(self.dir / spec.COMMIT_FILE, self._commit_record(complete, n1), fsync=self.fsync)
        if old_stats and old_stats != self._stats_file:
            (self.dir / old_stats).unlink(missing_ok=True)
        self.n_committed = n1
        self._block_crc = dict.fromkeys(self._block_crc, 0)
        self._block_bytes = 0

    def _take_pending(self, name: str, n: int) -> np.ndarray:
        parts = self._pending.pop(name, [])
        vals = np.concatenate(parts) if parts else None
        assert vals is not None and len(vals) >= n
        if len(vals) > n:
            self._pending[name] = [vals[n:]]
        return vals[:n]

    def _flush_buffered(self, complete: bool) -> int:
        """Write every appended example: shard files directly, or batches through zarr-python.

        Returns the new committed example count (every appended example).
        """
        n0 = self.n_committed
        if self._bg is not None:
            # A commit covers every appended example: a partly filled shard is written as
            # a whole shard file now and replaced whole once it fills.
            if self._stage_n > self._stage_written:
                self._bg.submit(self._stage, self._stage_first, self._stage_n, release=False)
                self._stage_written = self._stage_n
            self._check_background(drain=True)
            return self._stage_first + self._stage_n
        n_buf = self.n_written - n0
        if not n_buf:
            return n0
        for seg in self.cfg.segments:
            parts = self._pending_acts[seg.name]
            chunk = np.concatenate(parts) if len(parts) > 1 else parts[0]
            arr = self._acts[seg.name]
            _set_rows(arr, n0 + n_buf)
            arr[n0 : n0 + n_buf] = chunk[:, :, : seg.t_max]
            self._block_crc[seg.name] = crc32c(np.ascontiguousarray(chunk).view(np.uint8), 0)
            self._pending_acts[seg.name] = []
        return n0 + n_buf

    def _shard_attrs(self, n: int | None = None) -> dict[str, Any]:
        cfg = self.cfg
        n = self.n_committed if n is None else n
        seg_attrs = {
            s.name: {
                "t_max": s.t_max,
                "t_chunk": s.t_chunk,
                "truncated_count": self.truncated[s.name],
                "truncated_fraction": (self.truncated[s.name] / n) if n else 0.0,
            }
            for s in cfg.segments
        }
        return {
            "actstore": {
                "format": spec.FORMAT_NAME,
                "format_version": spec.FORMAT_VERSION,
                "actstore_version": __version__,
                "shard": self.shard,
                "config": cfg.to_json(),
            },
            "schema_version": spec.FORMAT_VERSION,
            "model_id": cfg.model_id,
            "layers": list(cfg.layers),
            "num_layers": cfg.n_layers,
            "hidden_size": cfg.d_model,
            "d_model": cfg.d_model,
            "dtype": cfg.dtype,
            "segments": seg_attrs,
            "chunks": {s.name: [1, 1, s.t_chunk, cfg.d_model] for s in cfg.segments},
            "n_examples": n,
            "created": self._created,
            **{k: v for k, v in cfg.attrs.items() if k != "actstore"},
        }

    def _commit_record(self, complete: bool, n: int | None = None) -> dict[str, Any]:
        return {
            "format_version": spec.FORMAT_VERSION,
            "shard": self.shard,
            "n_committed": self.n_committed if n is None else n,
            "complete": complete,
            "n_blocks": self.n_blocks,
            "text_bytes": dict(self.text_bytes),
            "truncated": dict(self.truncated),
            "nonfinite": dict(self.nonfinite),
            "overflow": dict(self.overflow),
            "stats_file": self._stats_file,
            "updated": _now(),
        }

    # ---- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Commit the rest and mark the shard complete (finalize merges complete shards)."""
        if self._closed:
            return
        try:
            self._commit(complete=True)
        finally:
            self._close_files()

    def _close_files(self) -> None:
        for f in self._text_files.values():
            f.close()
        if self._bg is not None:
            self._bg.stop()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"shard writer {self.shard} of {self.root} is closed")

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            if not self._closed:
                self._commit(complete=False)
        finally:
            self._close_files()

    def __len__(self) -> int:
        return self.n_written


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _per_segment(value: Any, names: list[str], what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise AppendError(f"{what} names segments {unknown} that the store does not have ({names})")
        return dict(value)
    if len(names) != 1:
        raise AppendError(f"this store has segments {names}: pass {what} as a dict {{segment: values}}")
    return {names[0]: value}


def _set_rows(arr: Any, n: int) -> None:
    """Resize a zarr array's first axis to n (a metadata write: only when it changes)."""
    if arr.shape[0] != n:
        arr.resize((n, *arr.shape[1:]))


def _pad_tokens(x: np.ndarray, t_pad: int) -> np.ndarray:
    """Zero-pad axis 2 to `t_pad` (a copy only when padding is needed)."""
    t = x.shape[2]
    if t == t_pad:
        return np.ascontiguousarray(x)
    out = np.zeros((x.shape[0], x.shape[1], t_pad, *x.shape[3:]), dtype=x.dtype)
    out[:, :, :t] = x
    return out


def _read_commit(shard_path: Path) -> dict[str, Any]:
    path = shard_path / spec.COMMIT_FILE
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptStoreError(f"{shard_path} has no {spec.COMMIT_FILE}: it is not a writer shard (or was never initialised)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptStoreError(f"{path} is not valid JSON ({e})") from None
    missing = [k for k in spec.COMMIT_FIELDS if k not in rec] if isinstance(rec, dict) else list(spec.COMMIT_FIELDS)
    if missing:
        raise CorruptStoreError(f"{path} lacks fields {missing}")
    if rec["format_version"] != spec.FORMAT_VERSION:
        check_format_header({"format": spec.FORMAT_NAME, "format_version": rec["format_version"]}, str(path))
    n = rec["n_committed"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise CorruptStoreError(f"{path}: n_committed must be a non-negative int, got {n!r}")
    _check_commit_types(rec, path)
    return rec


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_commit_types(rec: dict[str, Any], path: Path) -> None:
    """Every field a reader or resume uses has the documented type (untrusted JSON)."""
    if not isinstance(rec["complete"], bool):
        raise CorruptStoreError(f"{path}: complete must be true or false, got {rec['complete']!r}")
    if not _is_count(rec["n_blocks"]) or rec["n_blocks"] > rec["n_committed"]:
        raise CorruptStoreError(f"{path}: n_blocks must be an int in 0..n_committed ({rec['n_committed']}), got {rec['n_blocks']!r}")
    for k in ("text_bytes", "truncated", "nonfinite", "overflow"):
        v = rec[k]
        if not isinstance(v, dict) or not all(isinstance(s, str) and _is_count(c) for s, c in v.items()):
            raise CorruptStoreError(f"{path}: {k} must map names to non-negative ints, got {v!r}")
    if rec["stats_file"] is not None and not isinstance(rec["stats_file"], str):
        raise CorruptStoreError(f"{path}: stats_file must be a path string or null, got {rec['stats_file']!r}")


def _drop_chunks_from(array_dir: Path, n: int, cfg: StoreConfig) -> None:
    """Delete chunk (or shard) files of examples >= n: the uncommitted block of a crash."""
    if cfg.zarr_format == 2:
        with os.scandir(array_dir) as it:
            for e in it:
                head = e.name.split(".", 1)[0]
                if head.isdigit() and int(head) >= n:
                    os.unlink(e.path)
        return
    cdir = array_dir / "c"
    if not cdir.exists():
        return
    S = cfg.shard_examples or 1
    # A partly filled shard file at n // S holds committed examples: it stays (whole).
    first_bad = -(-n // S) if cfg.shard_examples else n
    with os.scandir(cdir) as it:
        for e in it:
            if e.name.isdigit() and int(e.name) >= first_bad:
                shutil.rmtree(e.path) if e.is_dir() else os.unlink(e.path)


def _truncate_lines(path: Path, n_lines: int) -> None:
    data = path.read_bytes()
    pos = 0
    for _ in range(n_lines):
        nxt = data.find(b"\n", pos)
        if nxt < 0:
            raise CorruptStoreError(f"{path} has fewer block records than its commit record says ({n_lines})")
        pos = nxt + 1
    if pos != len(data):
        with open(path, "r+b") as f:
            f.truncate(pos)


def _write_consolidated(shard_path: Path, zarr_format: int) -> None:
    """Consolidated metadata of a finished shard (.zmetadata for v2; in zarr.json for v3)."""
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(zarrio.AtomicLocalStore(str(shard_path)))
