"""The shared import driver: a source in another tool's format -> an actstore store.

A source (actstore/importers/activault.py, saelens.py, dictionary_learning.py) lists its
*parts* (a megabatch file, an Arrow file, a cache file...), each of a known number of
examples, and reads a part from any example on. Part i becomes writer shard i of the
store (ShardWriter), so that parts are written in parallel by independent writers and a
killed import resumes exactly: a complete shard of the same part (its fingerprint is in
the shard's attrs) is skipped, a partly written one is resumed after its last committed
example, and a shard imported from something else is refused. At the end the store is
finalized and verified: `verify_store`, the example and token counts of every part, and
the bytes of each part's first example read back against a checksum taken from the source.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from actstore.errors import CorruptStoreError, ImportSourceError, ImportVerifyError, StoreMismatchError
from actstore.layout import records, spec
from actstore.layout.config import StoreConfig, make_config
from actstore.storage import KeyNotFound, open_storage

SEGMENT = "tokens"
IMPORT_ATTR = "actstore_import"  # per shard: which source part it holds


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """The store an import writes: one segment SEGMENT of `tokens` tokens (fixed, or up to
    that many with `variable`, when examples have lengths)."""

    layers: list[int]
    d_model: int
    tokens: int
    dtype: str
    token_ids: bool = False
    token_labels: bool = False
    token_label_names: dict[int, str] | None = None  # the labels are token kinds (None: classes)
    variable: bool = False
    model_id: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    def config(self, zarr_format: int, attrs: Mapping[str, Any]) -> StoreConfig:
        """The StoreConfig of the store, written as Zarr `zarr_format`, with `attrs` (the
        source's own attrs and the part's) as its metadata: what the writers take whole."""
        shape: dict[str, Any] = {"segments": {SEGMENT: self.tokens}} if self.variable else {"tokens": self.tokens}
        return make_config(
            layers=self.layers,
            d_model=self.d_model,
            **shape,
            dtype=self.dtype,
            token_ids=self.token_ids,
            token_labels=self.token_labels,
            token_label_names=self.token_label_names,
            model_id=self.model_id,
            attrs=attrs,
            zarr_format=zarr_format,
        )


@dataclass(frozen=True)
class Part:
    """One source file (or another unit of the source) that becomes one writer shard."""

    key: str
    n_examples: int | None  # None: known only once read (the shard's commit record then says)
    fingerprint: str  # what identifies this part's contents (size, etag, a checksum...)


@dataclass
class Examples:
    """A batch of a part's examples: acts (b, L, T, D) in the stored dtype (numpy or torch);
    lengths (b,) when some examples are shorter than T; token ids / labels (b, T)."""

    acts: Any
    lengths: Any = None
    token_ids: Any = None
    token_labels: Any = None


class Source(Protocol):
    kind: str
    url: str
    geometry: Geometry
    parts: list[Part]

    def read(self, part: Part, start: int) -> Iterator[Examples]:
        """The examples of `part` from example `start` on, in batches."""


@dataclass(kw_only=True)
class ImportReport:
    kind: str
    source: str
    store: str
    n_parts: int = 0
    n_written: int = 0
    n_resumed: int = 0
    n_skipped: int = 0
    n_examples: int = 0
    n_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, what: str) -> None:
        """One more part written, resumed or skipped (from any writer thread)."""
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)

    def summary(self) -> str:
        return (
            f"imported {self.kind} {self.source} -> {self.store}: {self.n_examples:,} examples, {self.n_tokens:,} tokens "
            f"from {self.n_parts} parts ({self.n_written} written, {self.n_resumed} resumed, {self.n_skipped} already "
            "imported); verified"
        )


def run_import(
    source: Source,
    store: str | os.PathLike,
    *,
    workers: int = 2,
    progress: bool = True,
    commit_bytes: int | None = None,
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT,
) -> ImportReport:
    """Write every part of `source` into `store` (parallel, resumable), finalize and verify it.

    Args:
        source: the source (see Source).
        store: the store's root, a folder or an object-store URL (new, or a killed import of this source).
        workers: parts written at once (each by its own ShardWriter).
        progress: show a progress bar.
        commit_bytes: commit a shard's block every this many bytes (a kill loses at most one block).
        zarr_format: 3 (Zarr shard files, the default, as `actstore write`) or 2 (chunk files).
    """
    from actstore.progress import bar
    from actstore.write.finalize import finalize

    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1. Got {workers!r}.")
    if not source.parts:
        raise ImportSourceError(f"{source.url}: the {source.kind} source holds no data files; nothing to import")
    report = ImportReport(kind=source.kind, source=source.url, store=str(store), n_parts=len(source.parts))
    total = sum(p.n_examples or 0 for p in source.parts) or None
    probes: dict[int, int] = {}
    with bar(total=total, unit="ex", desc=f"import-{source.kind}", disable=not progress) as pbar:

        def one(i: int) -> None:
            probes[i] = _import_part(source, store, i, report, pbar.update, commit_bytes, zarr_format)

        if workers == 1:
            for i in range(len(source.parts)):
                one(i)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="actstore-import") as pool:
                for f in [pool.submit(one, i) for i in range(len(source.parts))]:
                    f.result()  # the first failure is raised (others finish their part or fail too)
    finalize(store)
    _verify(source, store, probes, report)
    return report


def _import_part(
    source: Source,
    store: str | os.PathLike,
    i: int,
    report: ImportReport,
    update: Callable[[int], Any],
    commit_bytes: int | None,
    zarr_format: int,
) -> int | None:
    """Part i -> shard i; returns the checksum of the part's first example (None when it
    was already imported, or is empty)."""
    from actstore.write import ShardWriter
    from actstore.write.options import WriterOptions

    part, g = source.parts[i], source.geometry
    state = _existing(store, i, part, source, zarr_format)
    if state == "done":
        report.count("n_skipped")
        update(part.n_examples or 0)
        return None
    attrs = {
        **g.attrs,
        IMPORT_ATTR: {"kind": source.kind, "source": source.url, "part": part.key, "fingerprint": part.fingerprint},
    }
    opts = WriterOptions(
        resume=state == "partial",
        overwrite=state == "unclaimed",
        **({"commit_bytes": commit_bytes} if commit_bytes else {}),
    )
    w = ShardWriter(store, shard=i, config=g.config(zarr_format, attrs), options=opts)
    probe = None
    with w:
        start = w.n_committed
        if state == "partial":
            report.count("n_resumed")
            update(start)
        else:
            report.count("n_written")
        per = max(1, commit_bytes // w.cfg.example_bytes()) if commit_bytes else None
        for batch in source.read(part, start):
            if probe is None and start == 0:
                probe = _checksum(batch.acts, 0, None if batch.lengths is None else int(batch.lengths[0]))
            for b in _pieces(batch, per):  # a commit may end inside a source's batch
                w.append(b.acts, lengths=b.lengths, token_ids=b.token_ids, token_labels=b.token_labels)
                update(len(b.acts))
        if part.n_examples is not None and w.n_written != part.n_examples:
            raise ImportSourceError(
                f"{source.url}/{part.key} gave {w.n_written} examples; its metadata says {part.n_examples}"
            )
    return probe


def _existing(store: str | os.PathLike, i: int, part: Part, source: Source, zarr_format: int) -> str:
    """'new' (no shard, or one whose writer was killed inside its claim), 'unclaimed' (a
    shard killed before its first commit, which records whose part it holds: started
    afresh), 'partial' (a killed import of this part: resumed) or 'done'."""
    from actstore import catalog

    storage = open_storage(store)
    if not catalog.shard_exists(storage, i):
        return "new"
    sh = catalog.shard_storage(storage, i)
    if catalog.claim_pending(sh):
        return "new"  # killed inside its claim: the writer claims it afresh, as `write --resume` does
    rec = catalog.read_commit(sh)
    key = records.group_attrs_key(zarr_format)
    try:
        mine = records.shard_attrs_config(sh.get(key), zarr_format, sh.where(key)).attrs.get(IMPORT_ATTR)
    except KeyNotFound:
        if rec.n_committed == 0:
            return "unclaimed"  # nothing committed, nothing said whose: no one's work is lost
        mine = None
    except (CorruptStoreError, AttributeError):
        mine = None
    want = {"kind": source.kind, "part": part.key, "fingerprint": part.fingerprint}
    if not isinstance(mine, dict) or any(mine.get(k) != v for k, v in want.items()):
        raise StoreMismatchError(
            f"{storage.url} already holds shard {i}, not imported from {source.url}/{part.key} as it is now "
            f"({'another source' if not isinstance(mine, dict) else mine.get('part')}); import into a new store path"
        )
    return "done" if rec.complete and part.n_examples in (None, rec.n_committed) else "partial"


def _pieces(b: Examples, rows: int | None) -> Iterator[Examples]:
    """`b` in pieces of at most `rows` examples (None: whole)."""
    n = len(b.acts)
    if rows is None or n <= rows:
        yield b
        return
    for i in range(0, n, rows):
        yield Examples(
            **{k: None if v is None else v[i : i + rows] for k, v in vars(b).items()},
        )


def _checksum(acts: Any, row: int, length: int | None) -> int:
    """crc32 of example `row`'s values (every layer, its tokens) as float32, which every
    stored dtype widens to exactly (the reader's dtype)."""
    x = acts[row]
    x = x.float().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float32)
    crc = 0
    for layer in range(x.shape[0]):
        crc = zlib.crc32(np.ascontiguousarray(x[layer, :length], dtype=np.float32).tobytes(), crc)
    return crc


def _verify(source: Source, store: str | os.PathLike, probes: dict[int, int | None], report: ImportReport) -> None:
    from actstore.read.store import ActStore
    from actstore.verify import verify_store

    verify_store(store, raise_on_error=True)
    st = ActStore(store)
    counts = [int(e.n_examples) for e in st.manifest.shards]
    for i, part in enumerate(source.parts):
        if part.n_examples is not None and counts[i] != part.n_examples:
            raise ImportVerifyError(f"{store}: shard {i} holds {counts[i]} examples; {part.key} has {part.n_examples}")
    start = 0
    for i, part in enumerate(source.parts):
        probe = probes.get(i)
        if probe is not None:
            crc = 0
            for layer in st.layers:
                x = np.ascontiguousarray(st[start, layer], dtype=np.float32)
                crc = zlib.crc32(x.tobytes(), crc)
            if crc != probe:
                raise ImportVerifyError(
                    f"{store}: example {start} (the first of {part.key}) does not hold the bytes read from the source"
                )
        start += counts[i]
    report.n_examples = len(st)
    report.n_tokens = int(np.asarray(st.field(f"{SEGMENT}_len"), dtype=np.int64).sum())
