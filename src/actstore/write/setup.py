"""A writer shard's setup: claim and create it, or recover it for a resume; open its layout.

The part of ShardWriter (actstore.write.writer) that runs before the first append: a
new shard is claimed by a create-only put of its commit record and then its arrays are
created; a resumed one is rolled back to its commit record (later chunk objects dropped,
arrays shrunk, texts, block records and checksums cut back).
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

from actstore import catalog
from actstore.write import zarr_arrays as arrays
from actstore.chunkio import ChunkIO, drop_chunks
from actstore.errors import CorruptStoreError, ShardCompleteError, ShardExistsError, StoreMismatchError
from actstore.layout import jsonio, keys, records, spec
from actstore.layout.chunks import array_meta_key, geometry_from_metadata, key_scheme, row_chunk_key
from actstore.write.committed import PerSampleRows, committed_keys, missing_objects, refuse_missing
from actstore.stats import read_stats
from actstore.write.layouts import ChunkFiles, Layout, ZarrArrays
from actstore.write.metabuffer import MetaBufferStore
from actstore.write.pipeline import MAX_BYTES, WritePipeline
from actstore.write.shardfiles import ShardFiles


class ShardSetup:
    """Mixin of ShardWriter: everything between the constructor's checks and the first append."""

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

    def _create(self) -> None:
        """Claim the shard (a create-only put of its commit record), then create its arrays."""
        if not self.sh.put_if_absent(keys.COMMIT, records.dump_commit(self._commit_record(False))):
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
        self._meta = MetaBufferStore(self.sh.zarr_store("", read_only=False), self.sh, empty=True)
        group = zarr.open_group(store=self._meta, mode="a", zarr_format=self.cfg.zarr_format)
        arrays.create_shard_arrays(group, self.cfg, self.compressor)
        group.attrs.update(self._shard_attrs())
        self._group = group
        # Written by the first commit, each document once (zarr-python alone re-puts the
        # groups' documents per array); until then the shard is claimed, with 0 examples.
        for name in self.cfg.texts:
            self._records.create(keys.text_file(name))
        self._records.create(keys.BLOCKS)
        self._records.create(keys.EL_CRC)

    def _arrays_complete(self) -> bool:
        names = [keys.acts_array(s.name) for s in self.cfg.segments] + self._per_sample_names()
        return all(self.sh.exists(array_meta_key(a, self.cfg.zarr_format)) for a in names) and self.sh.exists(
            keys.BLOCKS
        )

    def _recover(self) -> None:
        rec = catalog.read_commit(self.sh)
        if self.world_size is None:
            self.world_size = rec.world_size  # a resume keeps the run's world
        elif rec.world_size not in (None, self.world_size):
            raise StoreMismatchError(
                f"shard {self.shard} of {self.root} was written as rank {self.shard} of {rec.world_size} ranks; "
                f"resume it with world size {rec.world_size}, not {self.world_size} (the split of the data depends on it)"
            )
        if rec.complete:
            raise ShardCompleteError(
                f"shard {self.shard} of {self.root} is complete with {rec.n_committed} examples; "
                "nothing to resume (use overwrite=True to rewrite it, or another shard number)"
            )
        if rec.n_committed == 0 and not self._arrays_complete():
            # Claimed, then killed before its arrays were all created: create them again.
            for e in list(self.sh.list()):
                if e.key != keys.COMMIT and e.kind in ("file", "link"):
                    self.sh.delete(e.key)
            self._create_arrays()
            self._drop_temporary()
            return
        group_key = records.group_attrs_key(self.cfg.zarr_format)
        old = records.shard_attrs_config(self.sh.get(group_key), self.cfg.zarr_format, self.sh.where(group_key))
        old.check_same_store(self.cfg, f"shard {self.shard} of {self.root}")
        n = rec.n_committed
        self.n_committed = self.n_written = n
        self.n_blocks = rec.n_blocks
        for k in ("truncated", "nonfinite", "overflow"):
            getattr(self, k).update(getattr(rec, k))
        first = self._layout_class().first_stale(self.cfg, n)
        for seg in self.cfg.segments:
            drop_chunks(self.sh, keys.acts_array(seg.name), first)
        self._group = self._open_group()
        self._resize_all(n)
        self._meta.flush()
        self._truncate_records(rec)
        if self.stats is not None:
            if rec.stats_file:
                self.stats.merge(
                    read_stats(self.sh, rec.stats_file, then="resume with stats=False, or overwrite the shard")
                )
                self._stats_file = rec.stats_file
            elif n:
                warnings.warn(
                    f"shard {self.shard}: resumed with stats=True but the committed part kept no statistics",
                    stacklevel=3,
                )
        self._drop_temporary()

    def _truncate_records(self, rec: records.Commit) -> None:
        """Texts, block records and per-row checksums cut back to the commit record's sizes."""
        for name, size in rec.text_bytes.items():
            if name not in self.cfg.texts:  # the name becomes a key: only declared texts
                raise CorruptStoreError(
                    f"{self.sh.where(keys.COMMIT)} names text {name!r}; the store declares texts {list(self.cfg.texts)}"
                )
            self.sh.truncate(keys.text_file(name), size)
            self.text_bytes[name] = size
        data = self.sh.get(keys.BLOCKS)
        pos = records.committed_length(data, self.n_blocks, self.sh.where(keys.BLOCKS))
        if pos != len(data):
            self.sh.truncate(keys.BLOCKS, pos)
        el_size = records.el_crc_nbytes(self.n_committed, self.cfg)
        have = self.sh.size(keys.EL_CRC)
        if have is not None and have >= el_size:
            if have != el_size:
                self.sh.truncate(keys.EL_CRC, el_size)
        else:  # written by an older writer (or damaged): verify falls back to block checksums
            self.sh.delete(keys.EL_CRC)
            self._el_crc_file = False

    def _drop_temporary(self) -> None:
        for e in list(self.sh.list()):
            if ".tmp-" in e.key.rsplit("/", 1)[-1] and keys.is_temporary(e.key.rsplit("/", 1)[-1]):
                self.sh.delete(e.key)

    def _open_group(self) -> Any:
        import zarr

        self._meta = MetaBufferStore(self.sh.zarr_store("", read_only=False), self.sh, empty=False)
        return zarr.open_group(store=self._meta, mode="r+")

    def _open_layout(self) -> None:
        if not hasattr(self, "_group"):
            self._group = self._open_group()
        self._ps_rows = PerSampleRows(self.sh, self._meta.read)  # per-sample commits read nothing back
        cfg = self.cfg
        cls = self._layout_class()
        if cls is ZarrArrays:
            self._layout: Layout = ZarrArrays(
                cfg, {s.name: self._group[keys.acts_array(s.name)] for s in cfg.segments}, self.n_written
            )
            return
        io = {}
        for s in cfg.segments:
            rel = keys.acts_array(s.name)
            meta = jsonio.loads(
                self._meta.read(array_meta_key(rel, cfg.zarr_format)), self.sh.where(rel), what="array metadata"
            )
            geo = geometry_from_metadata(rel, meta, cfg.n_layers, cfg.d_model)
            assert geo is not None
            io[s.name] = ChunkIO(self.sh, geo)
        pipeline = WritePipeline(self.sh, threads=self.io_threads, max_bytes=self.io_bytes or MAX_BYTES)
        if cls is ShardFiles:
            writeback = None if self.fsync else self.sh.writeback()  # a durable write syncs each file itself
            self._layout = ShardFiles(cfg, io, self.n_written, pipeline, writeback, durable=self.fsync)
        else:
            # Small chunk files: one syncfs at the commit is cheaper than an fsync each
            # (measured: 0.25x against 0.4-0.6x of a raw write for 395 KB files).
            self._layout = ChunkFiles(cfg, io, self.n_written, pipeline)

    def _per_sample_names(self) -> list[str]:
        names = [keys.len_array(s.name) for s in self.cfg.segments]
        if self.cfg.token_labels:
            names += [keys.labels_array(s.name) for s in self.cfg.segments]
        if self.cfg.token_ids:
            names += [keys.token_ids_array(s.name) for s in self.cfg.segments]
        names.append(keys.field_array(spec.SAMPLE_KEY))
        names += [keys.field_array(f) for f in self.cfg.fields]
        return names

    def _check_committed(self, n: int) -> None:
        """Before the commit record that completes a shard committed in several commits: every
        object of its n examples is still there (actstore.write.committed), else raise."""
        per_sample = []
        for name in self._per_sample_names():
            arr = self._group[name]
            fmt, sep = key_scheme(jsonio.loads(self._meta.read(array_meta_key(name, arr.metadata.zarr_format)), name))
            per_sample.append((int(arr.chunks[0]), partial(row_chunk_key, name, fmt, sep, len(arr.shape))))
        io = getattr(self._layout, "io", None) or {}
        want = committed_keys(n, per_sample=per_sample, activations=[c.geo for c in io.values()])
        want += [k for k, v in self._meta.written.items() if v is not None]
        want += [keys.BLOCKS, *(keys.text_file(t) for t in self.cfg.texts)]
        want += [keys.EL_CRC] if self._el_crc_file else []
        refuse_missing(self.sh, missing_objects(self.sh, want), self.shard, n)

    def _resize_all(self, n: int) -> None:
        for name in self._per_sample_names() + [keys.acts_array(s.name) for s in self.cfg.segments]:
            _set_rows(self._group[name], n)


def _set_rows(arr: Any, n: int) -> None:
    """Resize a zarr array's first axis to n (a metadata write: only when it changes)."""
    if arr.shape[0] != n:
        arr.resize((n, *arr.shape[1:]))
