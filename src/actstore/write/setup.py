"""A writer shard's files: claim and create them, or recover them for a resume; open its layout.

`ShardSetup`, a collaborator that ShardWriter (actstore.write.writer) owns, runs before the
first append: a new shard is claimed by a create-only put of its commit record and then
its arrays are created; a resumed one is rolled back to its commit record (later chunk
objects dropped, arrays shrunk, texts, block records and checksums cut back) and what the
record says comes back as a `Recovered` value. It then holds the open shard's handles
(Zarr group and metadata buffer, per-sample rows, the activations' layout) that the
writer's commits use.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

from actstore import catalog
from actstore.chunkio import ChunkIO, drop_chunks
from actstore.errors import CorruptStoreError, ShardCompleteError, ShardExistsError, StoreMismatchError
from actstore.layout import jsonio, keys, records, spec
from actstore.layout.chunks import array_meta_key, geometry_from_metadata, key_scheme, row_chunk_key
from actstore.layout.config import StoreConfig
from actstore.layout.spool import Ranges
from actstore.stats import RunningStats, read_stats
from actstore.storage import Storage
from actstore.write import zarr_arrays as arrays
from actstore.write.appendfiles import AppendFiles
from actstore.write.committed import PerSampleRows, committed_keys, missing_objects, refuse_missing
from actstore.write.layouts import ChunkFiles, Layout, ZarrArrays
from actstore.write.metabuffer import MetaBufferStore
from actstore.write.options import WriterOptions
from actstore.write.pipeline import MAX_BYTES, WritePipeline
from actstore.write.shardfiles import ShardFiles


@dataclass
class Recovered:
    """What a resumed shard's commit record says (and its statistics file, where kept)."""

    n_committed: int
    n_blocks: int
    truncated: dict[str, int]
    nonfinite: dict[str, int]
    overflow: dict[str, int]
    text_bytes: dict[str, int]
    world_size: int | None
    stats_file: str | None


class ShardSetup:
    """The files of one writer shard, from its claim (or recovery) to its open layout.

    Args:
        storage: the store's root storage; `sh`: the shard's own.
        shard, root: the shard's number and the store's root (for messages).
        cfg, opts: the store's configuration and the writer's options.
        records: the shard's append-only record files (actstore.write.appendfiles).
    """

    def __init__(
        self,
        storage: Storage,
        sh: Storage,
        shard: int,
        root: Any,
        cfg: StoreConfig,
        opts: WriterOptions,
        records: AppendFiles,
    ):
        self.storage, self.sh, self.shard, self.root = storage, sh, shard, root
        self.cfg, self.opts, self.records = cfg, opts, records
        self.engine = "direct" if opts.compressor is None and opts.engine in ("auto", "direct") else "zarr"
        self.el_crc_file = True  # False for a resumed shard written without the crc file
        self.meta: MetaBufferStore
        self.group: Any = None
        self.ps_rows: PerSampleRows
        self.layout: Layout

    def open(self, first_commit: bytes, first_attrs: dict[str, Any], stats: RunningStats | None) -> Recovered | None:
        """Claim and create the shard (`first_commit`, `first_attrs`: its commit record and
        group attributes of 0 examples), or recover it (opts.resume; its statistics merged
        into `stats`) or replace it (opts.overwrite); then open its layout. Returns what a
        recovery found, else None."""
        self._first_attrs = first_attrs
        recovered = None
        if catalog.shard_exists(self.storage, self.shard) and self._claimed():
            if self.opts.overwrite:
                self._refuse_if_published("overwrite")
                self.sh.delete_prefix("")
                self._create(first_commit)
            elif self.opts.resume:
                recovered = self._recover(stats)
            else:
                try:
                    n: Any = catalog.read_commit(self.sh).n_committed
                except CorruptStoreError:
                    n = "?"
                raise ShardExistsError(
                    f"shard {self.shard} of {self.root} already exists ({n} committed examples); "
                    "pass resume=True to continue it or overwrite=True to replace it"
                )
        else:
            self._create(first_commit)
        self._open_layout(recovered.n_committed if recovered else 0)
        return recovered

    def _layout_class(self) -> type[Layout]:
        if self.engine == "zarr":
            return ZarrArrays
        return ShardFiles if self.cfg.shard_examples is not None else ChunkFiles

    def _refuse_if_published(self, what: str) -> None:
        try:
            m = records.parse_manifest(self.storage.get(keys.MANIFEST), self.storage.where(keys.MANIFEST))
        except (FileNotFoundError, CorruptStoreError, ValueError):
            return  # no manifest, or a damaged one: it protects nothing
        if keys.shard_name(self.shard) in [s.name for s in m.shards]:
            raise ShardExistsError(
                f"cannot {what} shard {self.shard}: it is part of the finalized manifest of {self.root}; "
                f"readers depend on it. Write a new shard number instead."
            )

    def _claimed(self) -> bool:
        """Whether the shard is taken: anything but the temporary file of a claim under way,
        which the claim itself decides (catalog.claim_pending)."""
        return not catalog.claim_pending(self.sh)

    def _create(self, first_commit: bytes) -> None:
        """Claim the shard (a create-only put of its commit record), then create its arrays."""
        if not self.sh.put_if_absent(keys.COMMIT, first_commit):
            raise ShardExistsError(
                f"shard {self.shard} of {self.root} was created by another writer at the same time; "
                "give each writer its own shard number"
            )
        # Claimed under this writer's lease: a temporary file left here is a dead writer's
        # (one killed inside its own claim leaves its commit record's): drop it. Only local
        # writes go through temporary files (an object-store put is atomic).
        if self.storage.local_root is not None:
            self._drop_temporary()
        self._create_arrays()

    def _create_arrays(self) -> None:
        import zarr

        # The shard was just claimed (or emptied): it holds no Zarr metadata to read.
        self.meta = MetaBufferStore(self.sh.zarr_store("", read_only=False), self.sh, empty=True)
        group = zarr.open_group(store=self.meta, mode="a", zarr_format=self.cfg.zarr_format)
        arrays.create_shard_arrays(group, self.cfg, self.opts.compressor)
        group.attrs.update(self._first_attrs)
        self.group = group
        # Written by the first commit, each document once (zarr-python alone re-puts the
        # groups' documents per array); until then the shard is claimed, with 0 examples.
        for name in self.cfg.texts:
            self.records.create(keys.text_file(name))
        self.records.create(keys.BLOCKS)
        self.records.create(keys.EL_CRC)

    def _arrays_complete(self) -> bool:
        names = [keys.acts_array(s.name) for s in self.cfg.segments] + self.per_sample_names()
        return all(self.sh.exists(array_meta_key(a, self.cfg.zarr_format)) for a in names) and self.sh.exists(
            keys.BLOCKS
        )

    def _recover(self, stats: RunningStats | None) -> Recovered:
        rec = catalog.read_commit(self.sh)
        world_size = self.opts.world_size
        if world_size is None:
            world_size = rec.world_size  # a resume keeps the run's world
        elif rec.world_size not in (None, world_size):
            raise StoreMismatchError(
                f"shard {self.shard} of {self.root} was written as rank {self.shard} of {rec.world_size} ranks; "
                f"resume it with world size {rec.world_size}, not {world_size} (the split of the data depends on it)"
            )
        if rec.complete:
            raise ShardCompleteError(
                f"shard {self.shard} of {self.root} is complete with {rec.n_committed} examples; "
                "nothing to resume (use overwrite=True to rewrite it, or another shard number)"
            )
        names = [s.name for s in self.cfg.segments]
        found = Recovered(
            n_committed=rec.n_committed,
            n_blocks=rec.n_blocks,
            truncated={**dict.fromkeys(names, 0), **rec.truncated},
            nonfinite={**dict.fromkeys(names, 0), **rec.nonfinite},
            overflow={**dict.fromkeys(names, 0), **rec.overflow},
            text_bytes=dict.fromkeys(self.cfg.texts, 0),
            world_size=world_size,
            stats_file=None,
        )
        if rec.n_committed == 0 and not self._arrays_complete():
            # Claimed, then killed before its arrays were all created: create them again.
            for e in list(self.sh.list()):
                if e.key != keys.COMMIT and e.kind in ("file", "link"):
                    self.sh.delete(e.key)
            self._create_arrays()
            self._drop_temporary()
            return found
        group_key = records.group_attrs_key(self.cfg.zarr_format)
        old = records.shard_attrs_config(self.sh.get(group_key), self.cfg.zarr_format, self.sh.where(group_key))
        old.check_same_store(self.cfg, f"shard {self.shard} of {self.root}")
        n = rec.n_committed
        first = self._layout_class().first_stale(self.cfg, n)
        for seg in self.cfg.segments:
            drop_chunks(self.sh, keys.acts_array(seg.name), first)
        self.group = self._open_group()
        self._resize_all(n)
        self.meta.flush()
        self._truncate_records(rec, found.text_bytes)
        if stats is not None:
            if rec.stats_file:
                stats.merge(read_stats(self.sh, rec.stats_file, then="resume with stats=False, or overwrite the shard"))
                found.stats_file = rec.stats_file
            elif n:
                warnings.warn(
                    f"shard {self.shard}: resumed with stats=True but the committed part kept no statistics",
                    stacklevel=3,
                )
        self._drop_temporary()
        return found

    def _truncate_records(self, rec: records.Commit, text_bytes: dict[str, int]) -> None:
        """Texts, block records and per-row checksums cut back to the commit record's sizes."""
        for name, size in rec.text_bytes.items():
            if name not in self.cfg.texts:  # the name becomes a key: only declared texts
                raise CorruptStoreError(
                    f"{self.sh.where(keys.COMMIT)} names text {name!r}; the store declares texts {list(self.cfg.texts)}"
                )
            self.sh.truncate(keys.text_file(name), size)
            text_bytes[name] = size
        data = self.sh.get(keys.BLOCKS)
        pos = records.committed_length(data, rec.n_blocks, self.sh.where(keys.BLOCKS))
        if pos != len(data):
            self.sh.truncate(keys.BLOCKS, pos)
        el_size = records.el_crc_nbytes(rec.n_committed, self.cfg)
        have = self.sh.size(keys.EL_CRC)
        if have is not None and have >= el_size:
            if have != el_size:
                self.sh.truncate(keys.EL_CRC, el_size)
        else:  # written by an older writer (or damaged): verify falls back to block checksums
            self.sh.delete(keys.EL_CRC)
            self.el_crc_file = False

    def _drop_temporary(self) -> None:
        for e in list(self.sh.list()):
            if ".tmp-" in e.key.rsplit("/", 1)[-1] and keys.is_temporary(e.key.rsplit("/", 1)[-1]):
                self.sh.delete(e.key)

    def _open_group(self) -> Any:
        import zarr

        self.meta = MetaBufferStore(self.sh.zarr_store("", read_only=False), self.sh, empty=False)
        return zarr.open_group(store=self.meta, mode="r+")

    def _open_layout(self, n_written: int) -> None:
        if self.group is None:
            self.group = self._open_group()
        self.ps_rows = PerSampleRows(self.sh, self.meta.read)  # per-sample commits read nothing back
        cfg = self.cfg
        cls = self._layout_class()
        if cls is ZarrArrays:
            self.layout = ZarrArrays(
                cfg, {s.name: self.group[keys.acts_array(s.name)] for s in cfg.segments}, n_written
            )
            return
        io = {}
        for s in cfg.segments:
            rel = keys.acts_array(s.name)
            meta = jsonio.loads(
                self.meta.read(array_meta_key(rel, cfg.zarr_format)), self.sh.where(rel), what="array metadata"
            )
            geo = geometry_from_metadata(rel, meta, cfg.n_layers, cfg.d_model)
            assert geo is not None
            io[s.name] = ChunkIO(self.sh, geo)
        opts = self.opts
        pipeline = WritePipeline(self.sh, threads=opts.io_threads, max_bytes=opts.io_bytes or MAX_BYTES)
        if cls is ShardFiles:
            writeback = None if opts.fsync else self.sh.writeback()  # a durable write syncs each file itself
            self.layout = ShardFiles(cfg, io, n_written, pipeline, writeback, durable=opts.fsync)
        else:
            # Small chunk files: one syncfs at the commit is cheaper than an fsync each
            # (measured: 0.25x against 0.4-0.6x of a raw write for 395 KB files).
            self.layout = ChunkFiles(cfg, io, n_written, pipeline)

    def per_sample_names(self) -> list[str]:
        """The shard's per-sample arrays (lengths, labels, token ids, sample keys, fields)."""
        names = [keys.len_array(s.name) for s in self.cfg.segments]
        if self.cfg.token_labels:
            names += [keys.labels_array(s.name) for s in self.cfg.segments]
        if self.cfg.token_ids:
            names += [keys.token_ids_array(s.name) for s in self.cfg.segments]
        names.append(keys.field_array(spec.SAMPLE_KEY))
        names += [keys.field_array(f) for f in self.cfg.fields]
        return names

    def check_committed(self, n: int, removed: Ranges = ()) -> None:
        """Before the commit record that completes a shard committed in several commits: every
        object of its n examples is still there (actstore.write.committed), else raise; the
        activation files of `removed` examples (a spool's consumed blocks) are not looked for."""
        per_sample = []
        for name in self.per_sample_names():
            arr = self.group[name]
            fmt, sep = key_scheme(jsonio.loads(self.meta.read(array_meta_key(name, arr.metadata.zarr_format)), name))
            per_sample.append((int(arr.chunks[0]), partial(row_chunk_key, name, fmt, sep, len(arr.shape))))
        io = getattr(self.layout, "io", None) or {}
        want = committed_keys(n, per_sample=per_sample, activations=[c.geo for c in io.values()], removed=removed)
        want += [k for k, v in self.meta.written.items() if v is not None]
        want += [keys.BLOCKS, *(keys.text_file(t) for t in self.cfg.texts)]
        want += [keys.EL_CRC] if self.el_crc_file else []
        refuse_missing(self.sh, missing_objects(self.sh, want), self.shard, n)

    def _resize_all(self, n: int) -> None:
        for name in self.per_sample_names() + [keys.acts_array(s.name) for s in self.cfg.segments]:
            set_rows(self.group[name], n)


def set_rows(arr: Any, n: int) -> None:
    """Resize a zarr array's first axis to n (a metadata write: only when it changes)."""
    if arr.shape[0] != n:
        arr.resize((n, *arr.shape[1:]))
