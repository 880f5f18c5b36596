"""ShardWriter: batches from a user's inference loop -> one writer shard of a store.

The commit protocol (docs/format.md, "Commits"); the layout that writes activation bytes
(chunk files, Zarr shard files, zarr-python) is chosen once and driven through
actstore.write.layouts. Every commit: the layout flushes (its write pipeline drained:
every object of the block is written or uploaded), per-sample arrays and texts of the
block are written, the block record and per-row checksums are appended, and the commit
record is replaced atomically: the single commit point.
Anything past its `n_committed` is invisible and rolled back by a resumed writer.
"""

from __future__ import annotations

import errno
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import numpy as np

from actstore import catalog
from actstore._version import __version__
from actstore.errors import AppendError, DiskFullError, StoreNotFoundError
from actstore.layout import keys, records, spec
from actstore.layout.arrays import shard_arrays
from actstore.layout.checksum import per_sample_crc32c
from actstore.layout.config import StoreConfig
from actstore.stats import RunningStats, stats_key, update_masked
from actstore.storage import open_storage
from actstore.write import batch as batches
from actstore.write import zarr_arrays as arrays
from actstore.write.appendfiles import AppendFiles
from actstore.write.identity import claim_store
from actstore.write.lease import ShardLease
from actstore.write.options import WriterKeywords, WriterOptions, from_keywords
from actstore.write.pipeline import IOStats
from actstore.write.setup import ShardSetup, set_rows
from actstore.write.spool import spool_gate

_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ShardWriter:
    """Writes one shard of an actstore store from a user's inference loop.

    Several processes may write different shards of one store at once, without locks.
    Use as a context manager; leaving the block normally closes (completes) the shard,
    leaving it with an exception commits what was appended so a resumed writer continues.

    The store's configuration and the writer's options are values: pass `config=` (a
    StoreConfig, from actstore.layout.config.make_config) and `options=` (a WriterOptions,
    actstore.write.options) whole, or the keywords below that build them (not both):
    `WriterKeywords`, split by one function (actstore.write.options.from_keywords).
    Opening takes the shard's lease (one look at it), then claims and creates the shard or
    recovers it for a resume through its `ShardSetup` (actstore.write.setup).

    Args:
        path: the store's root: a folder (created if needed) or an object-store URL.
        shard: this writer's shard number (0..99999), unique per writer.
        config: the store's configuration, instead of layers ... attrs.
        options: the writer's options, instead of resume ... io_bytes.
        lease: the lease on this shard that this process took already (a capture takes it
            before its model loads: actstore.capture.target); adopted, not looked up again.
        layers: the model layer numbers recorded, in the order of the batch's L axis.
        d_model: activation width D.
        tokens: T for a store with one fixed-length segment (ViT: patches + CLS).
        segments: {name: T_max} for zero-padded variable-length segments, e.g.
            {"prompt": 256, "response": 64}; lengths are passed with each batch.
        dtype: "float16" (default), "bfloat16" or "float32".
        t_chunk: token chunk length (int, or {segment: int}); default keeps chunks <= 4 MiB.
        zarr_format: 3 (default) or 2 (the chunk-file layout: one file or object per
            (example, layer, token chunk)).
        shard_examples: with zarr_format=3, examples per Zarr shard file (sharding codec);
            "auto" (default): those that fill about 256 MiB (spec.DEFAULT_SHARD_BYTES);
            None: no sharding (one object per chunk). Batches are staged per shard file
            (up to 3 buffers of one shard file each, per segment) and a background thread
            writes each full one.
        fields: per-sample numeric fields {name: dtype}, e.g. {"label": "int64", "split": "int8"}.
        texts: names of per-sample JSON text fields, written to text/<name>.jsonl.
        token_labels: store a uint8 label per token (saev labels.bin): classes, data that
            no reader masks by, unless token_label_names says they are token kinds.
        token_label_names: {label: name} when the labels are token kinds, e.g.
            spec.TOKEN_KIND_NAMES {0: "content", 1: "special", 2: "template"}: the
            readers' default mask then keeps label 0 only (actstore.read.masks).
        token_ids: store the vocabulary id of every token (int32; LLM stores).
        model_id, attrs: global metadata (free-form attrs, JSON-serialisable).
        resume: continue an existing shard after its last committed example.
        overwrite: delete an existing shard of this number first.
        commit_bytes: commit a block after this many activation bytes.
        on_nonfinite: "count" (store and count NaN/inf) or "raise".
        on_overflow: "raise" (default) or "clip" finite values beyond the stored dtype's range.
        compressor: a compressor for the activations: numcodecs.Zstd() (zarr_format=2) or
            zarr.codecs.ZstdCodec() (zarr_format=3); disables the raw fast path.
        engine: "auto", "direct" (write chunk files) or "zarr" (write through zarr-python).
        stats: keep running statistics per (layer, segment) of the stored vectors that
            the readers' default mask keeps (actstore.read.masks): every real token, and
            only the content tokens (label 0) of a store whose labels are token kinds
            (so BOS, special and chat-template tokens never shift `normalize=`).
        fsync: durable against power loss, not only crashes: each Zarr shard file is
            synced on its I/O thread as it is written (beside the next writes), and every
            other file the block wrote (chunk files, per-sample arrays, records) together
            before each commit record: a group commit of this writer's files, which waits
            for no other writer's writes (a syncfs would).
        io_threads: threads that write (or upload) chunk and shard files while the
            appending thread converts and checksums; default 2-4 for a local disk, 8 for an
            object store (actstore.write.pipeline).
        io_bytes: bytes handed to those threads and not yet written before an append waits
            (default 512 MiB; the staging buffers of a sharded layout count).
        spool: make the store a spool with this byte budget ("50GB", "512MiB", bytes), or
            write into the spool it is (a writer opened without it on a spool gets its
            budget): before a batch is written the writer waits until it fits
            (actstore.write.spool; docs/capture.md, "The spool").
    """

    def __init__(
        self,
        path: Any,
        *,
        shard: int = 0,
        config: StoreConfig | None = None,
        options: WriterOptions | None = None,
        lease: ShardLease | None = None,
        **keywords: Unpack[WriterKeywords],
    ):
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard <= spec.MAX_SHARD:
            raise ValueError(f"shard must be an int in 0..{spec.MAX_SHARD}. Got {shard!r}.")
        cfg, opts = from_keywords(config, options, keywords)
        opts.check_rank(shard)
        arrays.check_compressor(opts.compressor, cfg.zarr_format)  # before anything is written
        self.storage = open_storage(path)
        self.root = self.storage.local_root if self.storage.local_root is not None else self.storage.url
        if (
            self.storage.local_root is not None
            and self.storage.local_root.exists()
            and not self.storage.local_root.is_dir()
        ):
            raise StoreNotFoundError(
                f"{self.root} is a file, not a store folder: choose another path (nothing was written)"
            )
        self.shard = shard
        spooled = claim_store(self.storage, cfg)
        self.spool = spool_gate(
            self.storage, cfg, shard, opts.spool, int(opts.commit_bytes), lambda: self._lease.check(), spooled
        )
        self.cfg = cfg  # equal to the store's identity except free-form attrs, kept per shard
        self._created = records.now()
        self.options = opts
        self.compressor = opts.compressor
        self.commit_bytes = int(opts.commit_bytes)
        self.on_nonfinite = opts.on_nonfinite
        self.on_overflow = opts.on_overflow
        self.fsync = opts.fsync
        self.sh = catalog.shard_storage(self.storage, shard)
        if opts.fsync:
            self.sh.track_writes()
            self.storage.track_writes()
            self.storage.mark_written(keys.IDENTITY)  # synced with the first commit
        self._records = AppendFiles(self.sh)
        self._files = ShardSetup(self.storage, self.sh, shard, self.root, cfg, opts, self._records)
        self.engine = self._files.engine
        self.world_size = opts.world_size
        self._closed = False
        names = [s.name for s in cfg.segments]
        self.n_committed = self.n_written = self.n_blocks = 0
        self.truncated, self.nonfinite, self.overflow = (dict.fromkeys(names, 0) for _ in range(3))
        self.text_bytes = dict.fromkeys(cfg.texts, 0)
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_text: dict[str, list[bytes]] = {n: [] for n in cfg.texts}
        self._block_bytes = 0
        self._stats_file: str | None = None
        self.stats = (
            RunningStats([stats_key(la, s.name) for la in cfg.layers for s in cfg.segments], cfg.d_model)
            if opts.stats
            else None
        )
        # One writer per shard: a second writer or resumer is refused while this one lives.
        # The one look at the shard's lease on opening it: taking it (or adopting the one
        # this process took already, before a model loaded: actstore.capture.target).
        if lease is not None and (lease.storage.url != self.storage.url or lease.lease.shard != shard):
            raise ValueError(
                f"lease= holds shard {lease.lease.shard} of {lease.storage.url}, not shard {shard} of {self.root}"
            )
        self._lease = lease or ShardLease.acquire(self.storage, shard, f"shard {shard} of {self.root}")
        weakref.finalize(self, self._lease.release)  # a writer dropped unclosed gives it back
        try:
            found = self._files.open(records.dump_commit(self._commit_record(False)), self._shard_attrs(), self.stats)
        except BaseException:
            self._lease.release()
            raise
        if found is not None:
            self.n_committed = self.n_written = found.n_committed
            self.n_blocks = found.n_blocks
            self.truncated, self.nonfinite, self.overflow = found.truncated, found.nonfinite, found.overflow
            self.text_bytes, self.world_size, self._stats_file = found.text_bytes, found.world_size, found.stats_file
        self._meta, self._group, self._ps_rows = self._files.meta, self._files.group, self._files.ps_rows
        self._layout = self._files.layout

    # ---- setup --------------------------------------------------------------------
    @property
    def dir(self) -> Any:
        """The shard's folder (a path on a local disk, else its URL)."""
        return self.sh.local_root if self.sh.local_root is not None else self.sh.url

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
        token_ids: Any = None,
        batch_stats: RunningStats | None = None,
        overflow: Mapping[str, int] | None = None,
        release: Callable[[], None] | None = None,
        **segment_acts: Any,
    ) -> range:
        """Append a batch of examples; returns their local indices in this shard.

        Args:
            acts: (b, L, T, D) activations for a one-segment store (numpy or torch,
                float16/bfloat16/float32/float64; T <= T_max, or a padded segment's whole
                chunk grid with zeros past T_max; a strided view is copied once, as it is).
                For several segments pass them by name: append(prompt=..., response=..., lengths={...}).
            lengths: true token counts (b,) per segment (a dict for several segments),
                each <= T_max; omitted means the batch's T. Fixed segments take none.
            source_lengths: uncapped lengths, used only to count truncated examples.
            sample_keys: b strings of at most 64 UTF-8 bytes identifying the examples.
            fields: {field: (b,) values} for the fields declared at construction.
            texts: {text name: b JSON-serialisable values}.
            token_labels: (b, T_max) uint8 per segment (a dict for several segments).
            token_ids: (b, <= T_max) vocabulary ids per segment, for a store made with
                token_ids=True (a dict for several segments).
            batch_stats: statistics already computed for this batch (merged as is).
            overflow: {segment: values of this batch clipped to the stored dtype's range
                before they were given here} (counted as the writer counts its own clips).
            release: lend the activations instead of having them copied: the writer may
                write them from where they are, later, and calls release() (once, from any
                thread) when it no longer needs them; until then the caller must not change
                them. Not called when append raises.
        """
        self._check_open()
        cfg = self.cfg
        seg_names = [s.name for s in cfg.segments]
        if acts is not None:
            if len(seg_names) != 1:
                raise AppendError(
                    f"this store has segments {seg_names}: pass each by name, e.g. append(prompt=..., response=...)"
                )
            segment_acts = {seg_names[0]: acts, **segment_acts}
        batch = batches.prepare(
            cfg,
            segment_acts,
            lengths=lengths,
            source_lengths=source_lengths,
            token_labels=token_labels,
            token_ids=token_ids,
            sample_keys=sample_keys,
            fields=fields,
            texts=texts,
            first_index=self.n_written,
            shard=self.shard,
            on_nonfinite=self.on_nonfinite,
            on_overflow=self.on_overflow,
        )
        batch.stats = batch_stats
        for name, n in (overflow or {}).items():
            batch.overflow[name] = batch.overflow.get(name, 0) + int(n)
        batch.release = release
        return self.append_batch(batch)

    def append_batch(self, batch: batches.Batch) -> range:
        """The writer's internal door: append a batch that is already checked and in its
        stored form (from `append`, or built by a capture that made every array itself:
        actstore.capture.writeside); nothing of it is checked or screened again.

        The batch must be made for this writer's next example (`len(self)`: its default
        sample keys and text lines count from there). Its `release`, if any, is called once
        the rows are no longer needed (not when this raises); its `stats`, if any, are
        merged as they are instead of computing the batch's statistics here.

        Returns the batch's local indices in this shard.
        """
        self._check_open()
        cfg = self.cfg
        # From here on the batch is written.
        n0, b = self.n_written, batch.b
        self._check_background()
        release, batch_stats = batch.release, batch.stats
        batch.release = release if self._layout.borrows else None  # rows written from where they are
        try:
            if self.spool is not None:  # back-pressure: wait until the batch fits the spool's budget
                self.spool.reserve(self._block_bytes, sum(a.nbytes for a in batch.acts.values()), self.commit)
            self._layout.append(batch, n0)
        except OSError as e:
            if e.errno in _DISK_FULL_ERRNOS:
                raise DiskFullError.of(
                    e,
                    f"writing chunk files of shard {self.shard} of {self.root}",
                    f"this batch of {b} examples was not added; the shard keeps its last commit ({self.n_committed} examples). "
                    f"Free space, then append again, or reopen with ShardWriter(..., shard={self.shard}, resume=True)",
                ) from e
            raise
        for seg in cfg.segments:
            self.nonfinite[seg.name] += batch.nonfinite[seg.name]
            self.overflow[seg.name] += batch.overflow[seg.name]
            self.truncated[seg.name] += batch.truncated[seg.name]
            if self.stats is not None and batch_stats is None:
                labels = batch.per_sample.get(keys.labels_array(seg.name)) if cfg.default_keeps is not None else None
                update_masked(self.stats, self.cfg, seg, batch.acts[seg.name], batch.lengths[seg.name], labels)
        if batch_stats is not None and self.stats is not None:
            self.stats.merge(batch_stats)
        for name, values in batch.per_sample.items():
            self._pending.setdefault(name, []).append(values)
        for name, lines in batch.text_lines.items():
            self._pending_text[name].extend(lines)
        self.n_written = n0 + b
        if release is not None and batch.release is None:
            release()  # (this layout copied the rows, or wrote them already)
        self._block_bytes += sum(a.nbytes for a in batch.acts.values())
        if self._block_bytes >= self.commit_bytes and (
            # With Zarr sharding, prefer a commit where a shard file just filled: a commit
            # elsewhere writes the partial shard file, rewritten once it fills.
            self._layout.at_boundary or self._block_bytes >= 2 * self.commit_bytes
        ):
            self.commit()
        return range(n0, n0 + b)

    def _check_background(self) -> None:
        """Raise a failed background write as the writer's error; it closes the writer."""
        try:
            self._layout.check()
        except OSError as e:
            self._close_files()  # a file is missing past the last commit: only a resume continues
            self._fail_since_commit(e, f"writing {self._layout.files} of shard {self.shard} of {self.root}")

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
        raise DiskFullError.of(
            e,
            doing,
            f"the shard keeps its last commit ({self.n_committed} examples); the {lost} examples appended since "
            f"were not committed. Free space, then continue with ShardWriter(..., shard={self.shard}, resume=True)",
        ) from e

    def _commit_block(self, complete: bool) -> None:
        cfg, sh = self.cfg, self.sh
        n0 = self.n_committed
        try:
            n1 = self._layout.flush(complete)
        except OSError as e:
            if not self._layout.background:
                raise  # to _commit, as any failure before the commit point
            self._close_files()  # the background writer stopped: only a resume continues
            self._fail_since_commit(e, f"writing {self._layout.files} of shard {self.shard} of {self.root}")
        if n1 == n0 and not complete:
            return
        if n1 > n0:
            ps_crc = {}
            dtypes = {a.key: a.dtype for a in shard_arrays(cfg)}  # as deep verify checks them
            for name in self._files.per_sample_names():
                vals = self._take_pending(name, n1 - n0)
                arr = arrays.every_chunk(self._group, name)
                set_rows(arr, n1)
                self._ps_rows.write(arr, name, n0, vals)  # from its chunk's first row: nothing read back
                ps_crc[keys.basename(name)] = per_sample_crc32c(vals, dtypes[name])
            for seg in cfg.segments:
                set_rows(self._group[keys.acts_array(seg.name)], n1)
            for name, lines in self._pending_text.items():
                self.text_bytes[name] = self._records.append(keys.text_file(name), b"".join(lines[: n1 - n0]))
                del lines[: n1 - n0]
            block_crc, el_esl = self._layout.take_checksums(n1 - n0)
            block = records.Block(
                start=n0, stop=n1, crc32c=block_crc, nbytes=(n1 - n0) * cfg.example_bytes(), per_sample_crc32c=ps_crc
            )
            if self._files.el_crc_file:
                self._records.append(keys.EL_CRC, records.dump_el_crcs(el_esl))
            self._records.append(keys.BLOCKS, records.dump_block(block))
            self.n_blocks += 1
        old_stats = self._stats_file
        if self.stats is not None:
            self._stats_file = keys.shard_stats_file(n1)
            sh.put(self._stats_file, self.stats.to_bytes())
        if complete:
            self._group.attrs.update(self._shard_attrs(n1))
            arrays.write_consolidated(self._meta)
        self._meta.flush()  # the arrays' new shapes and attributes, each document once
        self._records.write_created()
        if complete and n0:
            # committed in several commits: none of its objects was lost (but a spool's removed ones)
            self._files.check_committed(n1, self.spool.removed_here() if self.spool else ())
        if self.fsync:
            sh.sync_written()  # a group commit: every file of the block synced at once, not the disk
            self.storage.sync_written()
        self._lease.check()  # a writer whose shard was taken over commits nothing more
        sh.put(keys.COMMIT, records.dump_commit(self._commit_record(complete, n1)), durable=self.fsync)
        if old_stats and old_stats != self._stats_file:
            sh.delete(old_stats)
        self.n_committed = n1
        self._block_bytes = 0
        if self.spool is not None and n1 > n0:
            self.spool.committed()

    def _take_pending(self, name: str, n: int) -> np.ndarray:
        parts = self._pending.pop(name, [])
        vals = np.concatenate(parts) if parts else None
        assert vals is not None and len(vals) >= n
        if len(vals) > n:
            self._pending[name] = [vals[n:]]
        return vals[:n]

    def _shard_attrs(self, n: int | None = None) -> dict[str, Any]:
        return records.shard_attrs(
            self.cfg,
            shard=self.shard,
            n=self.n_committed if n is None else n,
            truncated=self.truncated,
            created=self._created,
            version=__version__,
        )

    def _commit_record(self, complete: bool, n: int | None = None) -> records.Commit:
        return records.Commit(
            shard=self.shard,
            n_committed=self.n_committed if n is None else n,
            complete=complete,
            n_blocks=self.n_blocks,
            text_bytes=dict(self.text_bytes),
            truncated=dict(self.truncated),
            nonfinite=dict(self.nonfinite),
            overflow=dict(self.overflow),
            stats_file=self._stats_file,
            updated=records.now(),
            world_size=self.world_size,
        )

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
        try:
            if hasattr(self, "_layout"):
                self._layout.close()
        finally:
            self._closed = True
            self._lease.release()

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

    def io_stats(self) -> IOStats | None:
        """What the write pipeline holds and has written (None for the zarr engine)."""
        return self._layout.io_stats() if hasattr(self, "_layout") else None

    def __len__(self) -> int:
        return self.n_written
