"""Integrity checks of a store: `actstore verify` and `ActStore(path, verify=...)`.

Fast mode reads metadata and file sizes only: the manifest against the identity file, the
commit records and the block records (counts, tiling, the per-shard crc32c total); every
chunk file of every published example present at its exact size; shards listed but
missing, shards present but unpublished, stray and leftover temporary files, symbolic
links. Deep mode also reads every published chunk, recomputes its crc32c and compares it
with what the writer recorded, naming each damaged (example, layer) and its files.

Missing chunk files. ActStore's direct writer (every uncompressed, unsharded store that
ShardWriter writes with engine "auto" or "direct") writes every chunk of every example, so
a missing chunk there is damage and fast mode reports it as an error. zarr-python (engine
"zarr": compressed or Zarr-sharded stores) omits chunks equal to the fill value, so there
a missing chunk is legal and read as zeros; deep mode's checksum says whether zeros are
what was written. In deep mode a missing chunk of an uncompressed store whose checksum
proves it was all zeros (written with engine="zarr") is downgraded to a warning.

Checksums: each block record holds, per segment, the crc32c of the block's chunk bytes in
(example, layer, token-chunk) order; `meta/example_layer_crc32c.u32` holds one crc32c per
(example, segment, layer), so deep mode names the damaged (example, layer). Shards written
without that file are checked per block (the damaged block, not the example, is named).
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actstore import spec
from actstore.chunkio import ChunkLayout, crc32c, layout_from_metadata, load_array_meta
from actstore.layout.config import SegmentSpec, StoreConfig
from actstore.errors import (
    ActstoreError,
    CorruptChunkError,
    FormatVersionError,
    StoreNotFoundError,
    UnsafePathError,
    VerificationError,
)
from actstore.fsutil import safe_child
from actstore.manifest import ShardEntry, blocks_checksum, load_manifest, read_blocks
from actstore.store import _consolidated, rows_on_disk
from actstore.writer import EL_CRC_FILE, _read_commit, read_identity

ERROR = "error"
WARNING = "warning"
MAX_LISTED = 50  # problems of one kind listed per shard; the rest are counted in one line
MAX_MISSING_ENUMERATED = 1_000_000  # beyond this many missing chunks, one summary line
_SHARD_RE = re.compile(r"^shard-(\d{5})\.zarr$")
_ZARR_META = {".zarray", ".zattrs", ".zgroup", ".zmetadata", "zarr.json"}
_STATS_RE = re.compile(r"^stats(-[0-9a-f]{8})?\.npz$")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One finding. `example` is the global index (None before finalize; see `local`)."""

    severity: str
    kind: str
    message: str
    path: str | None = None
    shard: int | None = None
    example: int | None = None
    local: int | None = None
    layer: int | None = None
    segment: str | None = None


@dataclass(kw_only=True)
class VerifyReport:
    """What `verify_store` found. `ok` is True when there is no error (warnings allowed)."""

    path: str
    deep: bool
    finalized: bool = True
    problems: list[Problem] = field(default_factory=list)
    n_shards: int = 0
    n_examples: int = 0
    n_chunk_files: int = 0
    n_bytes_read: int = 0

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def damaged(self) -> list[tuple[int | None, int | None, str | None]]:
        """(example, layer, file) of every error naming an example, in report order."""
        return [(p.example, p.layer, p.path) for p in self.errors if p.example is not None or p.local is not None]

    def summary(self) -> str:
        mode = "deep" if self.deep else "fast"
        head = (
            f"verify ({mode}) {self.path}: {self.n_examples} examples in {self.n_shards} shards, "
            f"{self.n_chunk_files} chunk files checked, {self.n_bytes_read} bytes read"
        )
        if not self.problems:
            return head + ": OK"
        return head + f": {_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"

    def table(self) -> str:
        """The problems as a fixed-width table, each followed by its message."""
        cols = ("SEVERITY", "PROBLEM", "SHARD", "EXAMPLE", "LAYER", "SEGMENT", "FILE")
        rows = [cols]
        for p in self.problems:
            ex = p.example if p.example is not None else (f"local {p.local}" if p.local is not None else None)
            rows.append(tuple("-" if v is None else str(v) for v in (p.severity, p.kind, p.shard, ex, p.layer, p.segment, p.path)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols) - 1)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
            if i:
                lines.append("    " + self.problems[i - 1].message)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def verify_store(
    path: str | os.PathLike,
    deep: bool = False,
    raise_on_error: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check a store's integrity; see the module docstring for what each mode checks.

    Args:
        path: the store root.
        deep: also read every published chunk and compare its crc32c with the record.
        raise_on_error: raise VerificationError (holding the report) if an error was found.
        progress: called with the number of bytes read after each example (deep mode).

    Returns:
        The report. A store written by a newer actstore raises FormatVersionError; a path
        that holds no store raises StoreNotFoundError.
    """
    root = Path(path)
    if not root.is_dir() or not (
        os.path.lexists(root / spec.IDENTITY_FILE) or os.path.lexists(root / spec.MANIFEST_FILE)
    ):
        raise StoreNotFoundError(f"{root} is not an actstore store (no {spec.IDENTITY_FILE} or {spec.MANIFEST_FILE})")
    report = _Verifier(root, deep, progress).run()
    if raise_on_error and not report.ok:
        first = report.errors[0]
        raise VerificationError(
            f"{root} failed verification ({'deep' if deep else 'fast'}): {_plural(len(report.errors), 'error')}, the first: "
            f"{first.message}. Run `actstore verify {root}{' --deep' if deep else ''}` for the full table",
            report,
        )
    return report


class _Verifier:
    """One run over one store; problems are appended to `self.report` as they are found."""

    def __init__(self, root: Path, deep: bool, progress: Callable[[int], None] | None):
        self.root = root
        self.deep = deep
        self.progress = progress
        self.report = VerifyReport(path=str(root), deep=deep)
        self._counts: dict[tuple[Any, str], int] = {}
        self.cfg: StoreConfig | None = None

    # ---- reporting ------------------------------------------------------------------
    def add(self, severity: str, kind: str, message: str, path: str | os.PathLike | None = None, **where: Any) -> None:
        key = (where.get("shard"), kind)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] <= MAX_LISTED:
            rel = None if path is None else os.path.relpath(path, self.root)
            self.report.problems.append(Problem(severity=severity, kind=kind, message=message, path=rel, **where))

    def _flush_counts(self, shard: int) -> None:
        for (s, kind), n in list(self._counts.items()):
            if s == shard and n > MAX_LISTED:
                sev = next(p.severity for p in self.report.problems if p.shard == shard and p.kind == kind)
                self.report.problems.append(
                    Problem(severity=sev, kind=kind, shard=shard, message=f"... and {n - MAX_LISTED} more {kind} problems in this shard")
                )

    # ---- store level ----------------------------------------------------------------
    def run(self) -> VerifyReport:
        root = self.root
        ident = None
        if os.path.lexists(root / spec.IDENTITY_FILE):
            try:
                ident = read_identity(root)
            except FormatVersionError:
                raise
            except (ActstoreError, OSError) as e:
                self.add(ERROR, "identity", str(e), root / spec.IDENTITY_FILE)
        else:
            self.add(ERROR, "identity", f"{spec.IDENTITY_FILE} is missing (every store has one, written by its first writer)")
        manifest = None
        if os.path.lexists(root / spec.MANIFEST_FILE):
            try:
                manifest = load_manifest(root)
            except FormatVersionError:
                raise
            except (ActstoreError, OSError) as e:
                self.add(ERROR, "manifest", str(e), root / spec.MANIFEST_FILE)
        else:
            self.report.finalized = False
            self.add(
                WARNING, "not-finalized",
                f"no {spec.MANIFEST_FILE}: the store was never finalized and readers cannot open it; "
                f"run `actstore finalize {root}` once every writer has closed",
            )
        if manifest is not None and ident is not None and ident.differences(manifest.config):
            self.add(
                ERROR, "identity",
                f"{spec.IDENTITY_FILE} and {spec.MANIFEST_FILE} describe different stores: {'; '.join(ident.differences(manifest.config))}",
                root / spec.MANIFEST_FILE,
            )
        self.cfg = manifest.config if manifest is not None else ident
        if self.cfg is None:
            return self.report
        self._check_root(manifest)
        self._check_shards(manifest)
        return self.report

    def _check_root(self, manifest) -> None:
        expected = {spec.IDENTITY_FILE, spec.MANIFEST_FILE, spec.SHARDS_DIR}
        if manifest is not None and manifest.stats:
            expected.add(manifest.stats)
            p = self.root / manifest.stats
            if not p.is_file():
                self.add(ERROR, "stats", f"statistics file {manifest.stats} named by the manifest is missing", p)
            elif self.deep:
                self._load_stats(p, None)
        with os.scandir(self.root) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.is_symlink():
                self._symlink(e.path, None)
            if e.name in expected:
                continue
            if e.name.startswith("."):
                if ".tmp-" in e.name:
                    self.add(WARNING, "temp-file", f"{e.name} is the temporary file of an interrupted write (finalize killed?); safe to delete", e.path)
            elif _STATS_RE.match(e.name):
                self.add(WARNING, "stale-stats", f"{e.name} holds statistics of an earlier finalize (kept for readers of the previous manifest); safe to delete", e.path)
            else:
                self.add(WARNING, "stray-file", f"{e.name} is not part of an actstore store", e.path)

    def _symlink(self, path: str, shard: int | None) -> None:
        """Any link is reported: an error if it leaves the store, else a warning."""
        target = os.path.realpath(path)
        root = os.path.realpath(self.root)
        if target != root and not target.startswith(root + os.sep):
            self.add(ERROR, "symlink", f"{os.path.relpath(path, self.root)} is a symbolic link to {target}, outside the store; readers refuse it", path, shard=shard)
        else:
            self.add(WARNING, "symlink", f"{os.path.relpath(path, self.root)} is a symbolic link; actstore never writes links (chunk reads refuse them)", path, shard=shard)

    def _check_shards(self, manifest) -> None:
        shards_dir = self.root / spec.SHARDS_DIR
        present: list[str] = []
        if os.path.islink(shards_dir):
            self._symlink(str(shards_dir), None)
        if shards_dir.is_dir():
            with os.scandir(shards_dir) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if _SHARD_RE.match(e.name):
                        present.append(e.name)
                    elif e.name.startswith(".") and ".tmp-" in e.name:
                        self.add(WARNING, "temp-file", f"{e.name} is the folder of a writer killed while creating its shard; safe to delete when no writer runs", e.path)
                    elif not e.name.startswith("."):
                        self.add(WARNING, "stray-file", f"{e.name} in {spec.SHARDS_DIR}/ is not a writer shard (names are shard-NNNNN.zarr)", e.path)
        if manifest is None:
            for name in present:
                self._check_shard(name, None)
            return
        listed = {s.name for s in manifest.shards}
        for entry in manifest.shards:
            if entry.name not in present:
                self.add(
                    ERROR, "missing-shard",
                    f"shard {entry.name} listed in the manifest (examples {entry.start}..{entry.start + entry.n_examples - 1}) is missing; "
                    f"shards present: {present}",
                    shards_dir / entry.name, shard=entry.shard,
                )
            else:
                self._check_shard(entry.name, entry)
        for name in present:
            if name not in listed:
                self.add(
                    WARNING, "unpublished-shard",
                    f"shard {name} is not in the manifest (written after the last finalize, or by a writer still running); "
                    "readers do not see it until `actstore finalize` publishes it",
                    shards_dir / name, shard=int(name[6:11]),
                )

    # ---- one shard ------------------------------------------------------------------
    def _check_shard(self, name: str, entry: ShardEntry | None) -> None:
        shard = int(name[6:11])
        try:
            sdir = safe_child(self.root, f"{spec.SHARDS_DIR}/{name}")
        except UnsafePathError as e:
            self.add(ERROR, "symlink", str(e), self.root / spec.SHARDS_DIR / name, shard=shard)
            return
        if os.path.islink(sdir):
            self._symlink(str(sdir), shard)
        try:
            rec = _read_commit(sdir)
        except FormatVersionError:
            raise
        except ActstoreError as e:
            self.add(ERROR, "commit", str(e), sdir / spec.COMMIT_FILE, shard=shard)
            rec = None
        if entry is None and rec is None:
            return
        n = entry.n_examples if entry is not None else rec["n_committed"]
        n_blocks = entry.n_blocks if entry is not None else rec["n_blocks"]
        ctx = _ShardCtx(sdir=sdir, shard=shard, start=entry.start if entry else None, n=n, rec=rec)
        self.report.n_shards += 1
        self.report.n_examples += n
        if rec is not None and entry is not None:
            self._commit_vs_manifest(ctx, entry)
        blocks = self._blocks(ctx, n_blocks, entry)
        el = self._el_crcs(ctx)
        self._check_dir_entries(ctx)
        # Deep reads only when the counts are backed by the commit record, the block records
        # and files on disk: damaged metadata must not make verify read (or allocate) forever.
        deep = self.deep and blocks is not None and (rec is None or rec["n_committed"] >= n) and self._rows_ok(ctx)
        for si, seg in enumerate(self.cfg.segments):
            _ActsCheck(self, ctx, seg, si, blocks, el, deep).run()
        self._check_per_sample(ctx, deep)
        self._check_texts(ctx, deep)
        if rec is not None and rec["stats_file"] and n:
            try:
                p = safe_child(sdir, rec["stats_file"])
            except UnsafePathError as e:
                self.add(ERROR, "symlink", str(e), sdir / spec.COMMIT_FILE, shard=shard)
            else:
                if not p.is_file():
                    self.add(ERROR, "stats", f"statistics file {rec['stats_file']} named by the commit record is missing", p, shard=shard)
                elif self.deep:
                    self._load_stats(p, shard)
        self._flush_counts(shard)

    def _rows_ok(self, ctx: _ShardCtx) -> bool:
        try:
            rows = rows_on_disk(ctx.sdir)
        except ActstoreError as e:
            self.add(ERROR, "array-meta", str(e), ctx.sdir / spec.ARRAYS_GROUP / spec.SAMPLE_KEY, shard=ctx.shard)
            return False
        if rows < ctx.n:
            self.add(
                ERROR, "per-sample", f"the {spec.SAMPLE_KEY} array has chunk files for at most {rows} examples; {ctx.n} are published",
                ctx.sdir / spec.ARRAYS_GROUP / spec.SAMPLE_KEY, shard=ctx.shard,
            )
            return False
        return True

    def _commit_vs_manifest(self, ctx: _ShardCtx, entry: ShardEntry) -> None:
        rec = ctx.rec
        where = dict(shard=ctx.shard)
        path = ctx.sdir / spec.COMMIT_FILE
        if rec["n_committed"] < entry.n_examples:
            self.add(ERROR, "commit", f"the commit record holds {rec['n_committed']} examples; the manifest publishes {entry.n_examples}", path, **where)
        if entry.complete and not (rec["complete"] and rec["n_committed"] == entry.n_examples):
            self.add(
                ERROR, "commit",
                f"the manifest says the shard is complete with {entry.n_examples} examples; its commit record says "
                f"complete={rec['complete']} with {rec['n_committed']}",
                path, **where,
            )
        if rec["n_blocks"] < entry.n_blocks:
            self.add(ERROR, "commit", f"the commit record holds {rec['n_blocks']} blocks; the manifest publishes {entry.n_blocks}", path, **where)

    def _blocks(self, ctx: _ShardCtx, n_blocks: int, entry: ShardEntry | None) -> list[dict[str, Any]] | None:
        path = ctx.sdir / spec.BLOCKS_FILE
        where = dict(shard=ctx.shard)
        try:
            blocks = read_blocks(ctx.sdir, n_blocks)
        except (ActstoreError, OSError) as e:
            self.add(ERROR, "blocks", str(e), path, **where)
            return None
        covered = 0
        seg_names = sorted(s.name for s in self.cfg.segments)
        for i, b in enumerate(blocks):
            if b["start"] != covered:
                self.add(ERROR, "blocks", f"block record {i} starts at example {b['start']}, expected {covered}", path, **where)
                return None
            if sorted(b["crc32c"]) != seg_names:
                self.add(ERROR, "blocks", f"block record {i} has checksums for segments {sorted(b['crc32c'])}, expected {seg_names}", path, **where)
                return None
            if b["nbytes"] != (b["stop"] - b["start"]) * self.cfg.example_bytes():
                self.add(ERROR, "blocks", f"block record {i} claims {b['nbytes']} bytes for {b['stop'] - b['start']} examples", path, **where)
            covered = b["stop"]
        if covered != ctx.n:
            self.add(ERROR, "blocks", f"the block records cover {covered} examples; {ctx.n} are published", path, **where)
            return None
        if entry is not None:
            total = blocks_checksum(blocks)
            if total != entry.crc32c:
                self.add(
                    ERROR, "checksum-manifest",
                    f"the block records' checksums add up to crc32c {total:#010x}, the manifest says {entry.crc32c:#010x}: "
                    "blocks.jsonl or the manifest was altered",
                    path, **where,
                )
            nbytes = sum(b["nbytes"] for b in blocks)
            if nbytes != entry.nbytes:
                self.add(ERROR, "checksum-manifest", f"the block records hold {nbytes} bytes, the manifest says {entry.nbytes}", path, **where)
        return blocks

    def _el_crcs(self, ctx: _ShardCtx) -> np.ndarray | None:
        """Per (example, segment, layer) crc32c, or None when the shard has no such file."""
        path = ctx.sdir / EL_CRC_FILE
        if not path.is_file():
            return None
        count = ctx.n * len(self.cfg.segments) * self.cfg.n_layers
        size = path.stat().st_size
        if size < count * 4:
            self.add(ERROR, "checksums", f"{EL_CRC_FILE} has {size} bytes; {ctx.n} examples need {count * 4}", path, shard=ctx.shard)
            return None
        arr = np.fromfile(path, dtype="<u4", count=count)  # bounded by the file size checked above
        return arr.reshape(ctx.n, len(self.cfg.segments), self.cfg.n_layers)

    def _check_dir_entries(self, ctx: _ShardCtx) -> None:
        """Links and stray files in the shard's own folders (arrays are walked per array)."""
        cfg = self.cfg
        expected = {
            ".": _ZARR_META | {spec.ARRAYS_GROUP, spec.META_DIR, spec.TEXT_DIR},
            spec.META_DIR: {os.path.basename(spec.COMMIT_FILE), os.path.basename(spec.BLOCKS_FILE), os.path.basename(EL_CRC_FILE)},
            spec.TEXT_DIR: {f"{t}.jsonl" for t in cfg.texts},
            spec.ARRAYS_GROUP: _ZARR_META | set(_array_names(cfg)),
        }
        current_stats = os.path.basename(ctx.rec["stats_file"]) if ctx.rec and ctx.rec["stats_file"] else None
        for sub, names in expected.items():
            d = ctx.sdir / sub
            if not d.is_dir() or d.is_symlink():
                if d.is_symlink():
                    self._symlink(str(d), ctx.shard)
                elif sub != "." and names:  # a folder with nothing to hold may be absent (object stores have no folders)
                    self.add(ERROR, "missing-file", f"folder {sub}/ of the shard is missing", d, shard=ctx.shard)
                continue
            with os.scandir(d) as it:
                for e in it:
                    if e.is_symlink():
                        self._symlink(e.path, ctx.shard)
                    elif e.name in names:
                        continue
                    elif e.name.startswith(".") and ".tmp-" in e.name:
                        self.add(WARNING, "temp-file", f"{e.name} is the temporary file of an interrupted write; safe to delete", e.path, shard=ctx.shard)
                    elif sub == spec.META_DIR and re.match(r"^stats-\d{12}\.npz$", e.name):
                        if e.name != current_stats:
                            self.add(WARNING, "stale-stats", f"{e.name} is the statistics file of an earlier commit (the writer was killed before deleting it); safe to delete", e.path, shard=ctx.shard)
                    elif not e.name.startswith("."):
                        self.add(WARNING, "stray-file", f"{e.name} is not part of a writer shard", e.path, shard=ctx.shard)

    def _check_per_sample(self, ctx: _ShardCtx, deep: bool) -> None:
        for name in _array_names(self.cfg):
            if name.endswith(spec.ACTS_SUFFIX):
                continue
            adir = ctx.sdir / spec.ARRAYS_GROUP / name
            where = dict(shard=ctx.shard)
            try:
                meta = load_array_meta(adir)
                shape = meta["shape"]
                ok = isinstance(shape, list) and shape and isinstance(shape[0], int)
            except FileNotFoundError:
                self.add(ERROR, "array-meta", f"per-sample array {name} is missing", adir, **where)
                continue
            except (ValueError, KeyError, TypeError) as e:
                self.add(ERROR, "array-meta", f"metadata of per-sample array {name} is damaged ({e!r})", adir, **where)
                continue
            if not ok or shape[0] < ctx.n:
                self.add(ERROR, "array-meta", f"per-sample array {name} holds {shape if not ok else shape[0]} values; {ctx.n} examples are published", adir, **where)
                continue
            if deep:
                self._deep_per_sample(ctx, name, adir)

    def _deep_per_sample(self, ctx: _ShardCtx, name: str, adir: Path) -> None:
        import zarr

        try:
            values = np.asarray(zarr.open_array(str(adir), mode="r")[: ctx.n])
        except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes is damage
            self.add(ERROR, "per-sample", f"per-sample array {name} cannot be read ({e!r})", adir, shard=ctx.shard)
            return
        for seg in self.cfg.segments:
            if name == seg.name + spec.LEN_SUFFIX and values.size and (values.min() < 0 or values.max() > seg.t_max):
                bad = int(np.flatnonzero((values < 0) | (values > seg.t_max))[0])
                self.add(
                    ERROR, "per-sample", f"length {int(values[bad])} of segment {seg.name!r} lies outside 0..{seg.t_max}",
                    adir, shard=ctx.shard, local=bad, example=ctx.global_index(bad), segment=seg.name,
                )

    def _check_texts(self, ctx: _ShardCtx, deep: bool) -> None:
        for name in self.cfg.texts:
            path = ctx.sdir / spec.TEXT_DIR / f"{name}.jsonl"
            where = dict(shard=ctx.shard)
            if not path.is_file() or path.is_symlink():
                if not path.is_symlink():
                    self.add(ERROR, "text", f"text file {name}.jsonl is missing", path, **where)
                continue
            want = ctx.rec["text_bytes"].get(name) if ctx.rec else None
            size = path.stat().st_size
            if want is not None and size < want:
                self.add(ERROR, "text", f"text file {name}.jsonl has {size} bytes; the commit record says {want}", path, **where)
                continue
            if deep:
                self._deep_text(ctx, name, path)

    def _deep_text(self, ctx: _ShardCtx, name: str, path: Path) -> None:
        n_lines = 0
        with open(path, "rb") as f:
            for line in f:
                if n_lines >= ctx.n:
                    break
                i = n_lines
                n_lines += 1
                try:
                    rec = json.loads(line)
                    ok = isinstance(rec, dict) and rec.get("i") == i and name in rec
                except ValueError:
                    ok = False
                if not ok:
                    self.add(
                        ERROR, "text", f"line {i + 1} of {name}.jsonl is damaged (expected {{\"i\": {i}, ..., \"{name}\": ...}})",
                        path, shard=ctx.shard, local=i, example=ctx.global_index(i),
                    )
        if n_lines < ctx.n:
            self.add(ERROR, "text", f"{name}.jsonl has {n_lines} lines; {ctx.n} examples are published", path, shard=ctx.shard)

    def _load_stats(self, path: Path, shard: int | None) -> None:
        from actstore.stats import RunningStats

        try:
            RunningStats.load(path)
        except Exception as e:  # noqa: BLE001 - np.load of a damaged file raises many types
            self.add(ERROR, "stats", f"statistics file {path.name} cannot be read ({e!r})", path, shard=shard)


@dataclass(frozen=True, kw_only=True)
class _ShardCtx:
    sdir: Path
    shard: int
    start: int | None
    n: int
    rec: dict[str, Any] | None

    def global_index(self, local: int) -> int | None:
        return None if self.start is None else self.start + local


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _name(ctx: _ShardCtx, local: int) -> str:
    """How a problem names an example: its global index, or its local index before finalize."""
    g = ctx.global_index(local)
    return str(g) if g is not None else f"local {local} of shard {ctx.shard}"


def _array_names(cfg: StoreConfig) -> list[str]:
    names = [s.name + spec.ACTS_SUFFIX for s in cfg.segments] + [s.name + spec.LEN_SUFFIX for s in cfg.segments]
    if cfg.token_labels:
        names += [s.name + spec.TOKEN_LABELS_SUFFIX for s in cfg.segments]
    return names + [spec.SAMPLE_KEY, *cfg.fields]


class _ActsCheck:
    """Checks of one segment's activation array in one shard (fast, then deep)."""

    def __init__(self, v: _Verifier, ctx: _ShardCtx, seg: SegmentSpec, si: int, blocks, el, deep: bool):
        self.v, self.ctx, self.seg, self.si, self.deep = v, ctx, seg, si, deep
        self.blocks, self.el = blocks, el
        self.cfg = v.cfg
        self.adir = ctx.sdir / spec.ARRAYS_GROUP / (seg.name + spec.ACTS_SUFFIX)
        self.n_tc = seg.n_chunks
        self.missing: dict[tuple[int, int], list[str]] = {}  # (local, layer pos) -> chunk files
        self.bad_size: set[tuple[int, int]] = set()

    def add(self, severity: str, kind: str, message: str, path: Any = None, local: int | None = None, lp: int | None = None) -> None:
        where: dict[str, Any] = dict(shard=self.ctx.shard, segment=self.seg.name)
        if local is not None:
            where.update(local=local, example=self.ctx.global_index(local))
        if lp is not None:
            where["layer"] = self.cfg.layers[lp]
        self.v.add(severity, kind, message, path, **where)

    def run(self) -> None:
        meta = self._meta()
        if meta is None:
            return
        try:
            lay = layout_from_metadata(self.adir, meta, self.cfg.n_layers, self.cfg.d_model)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e!r})", self.adir)
            return
        if lay is not None and (lay.t_chunk != self.seg.t_chunk or lay.dtype != np.dtype(self.cfg.zarr_dtype)):
            self.add(ERROR, "array-meta", f"chunks of {lay.t_chunk} tokens of {lay.dtype}; the store config says {self.seg.t_chunk} tokens of {self.cfg.zarr_dtype}", self.adir)
            return
        fmt, sep = _key_scheme(meta)
        self._walk(lay, fmt, sep, meta)
        if self.deep:
            self._deep(lay)
        for (local, lp), files in self.missing.items():
            self.add(
                ERROR, "missing-chunk",
                f"chunk file {os.path.relpath(files[0], self.v.root)} of (example {_name(self.ctx, local)}, "
                f"layer {self.cfg.layers[lp]}) is missing: the direct writer writes every chunk, so it was deleted (readers would return zeros)",
                files[0], local, lp,
            )

    def _meta(self) -> dict[str, Any] | None:
        """The array's metadata as readers see it: the consolidated copy when there is one."""
        cfg, seg = self.cfg, self.seg
        try:
            meta = load_array_meta(self.adir)
        except FileNotFoundError:
            self.add(ERROR, "array-meta", f"activation array {self.adir.name} is missing", self.adir)
            return None
        except ValueError as e:
            self.add(ERROR, "array-meta", f"array metadata is damaged ({e})", self.adir)
            return None
        try:
            consolidated = _consolidated(self.ctx.sdir)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            self.add(ERROR, "array-meta", f"the shard's consolidated metadata is damaged ({e!r})", self.ctx.sdir)
            return None
        rel = f"{spec.ARRAYS_GROUP}/{self.adir.name}"
        if consolidated is not None:
            if consolidated.get(rel) != meta:
                self.add(ERROR, "array-meta", "the shard's consolidated metadata disagrees with the array's own metadata "
                         "(readers use the consolidated copy)", self.adir)
            meta = consolidated.get(rel, meta)
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not isinstance(shape, list) or len(shape) != 4 or shape[1:] != [cfg.n_layers, seg.t_max, cfg.d_model]:
            self.add(ERROR, "array-meta", f"array has shape {shape}, expected (n, {cfg.n_layers}, {seg.t_max}, {cfg.d_model})", self.adir)
            return None
        if not isinstance(shape[0], int) or shape[0] < self.ctx.n:
            self.add(ERROR, "array-meta", f"array holds {shape[0]} examples; {self.ctx.n} are published", self.adir)
            return None
        return meta

    # ---- fast: every chunk file present at its size ----------------------------------
    def _walk(self, lay: ChunkLayout | None, fmt: int, sep: str, meta: dict[str, Any]) -> None:
        L, n_tc, n = self.cfg.n_layers, self.n_tc, self.ctx.n
        sharded = lay is not None and lay.shard_examples is not None
        raw = lay is not None and not sharded
        complete = bool(self.ctx.rec and self.ctx.rec["complete"])
        committed = self.ctx.rec["n_committed"] if self.ctx.rec else n
        found = array("q")  # flat (example, layer, token chunk) index of each chunk file present
        for path, rel, entry in _walk_files(self.adir):
            if entry.is_symlink():
                self.v._symlink(path, self.ctx.shard)
                continue
            if rel in _ZARR_META:
                continue
            key = _chunk_key(rel, fmt, sep)
            grid_ok = key is not None and (key[1:] == (0, 0, 0) if sharded else (key[1] < L and key[2] < n_tc and key[3] == 0))
            if not grid_ok:
                if not rel.split("/")[-1].startswith("."):
                    self.add(WARNING, "stray-file", f"{rel} in array {self.adir.name} is not a chunk of this array", path)
                continue
            ex = key[0] * lay.shard_examples if sharded else key[0]
            if ex >= n:
                if complete and ex >= committed:
                    self.add(WARNING, "stray-file", f"chunk {rel} belongs to example {ex}, past the shard's {committed} committed examples", path)
                continue
            self.v.report.n_chunk_files += 1
            if sharded:
                self._check_shard_file(lay, path, key[0])
            elif raw:
                size = entry.stat(follow_symlinks=False).st_size
                if size != lay.chunk_nbytes:
                    what = "truncated" if size < lay.chunk_nbytes else "too long"
                    self.add(ERROR, "chunk-size", f"chunk file {rel} has {size} bytes, expected {lay.chunk_nbytes} ({what})", path, ex, key[1])
                    self.bad_size.add((ex, key[1]))
                found.append((ex * L + key[1]) * n_tc + key[2])
        if not raw:
            return
        expected = n * L * n_tc
        if expected - len(found) > MAX_MISSING_ENUMERATED:
            self.deep = False
            self.add(
                ERROR, "missing-chunk",
                f"the shard publishes {n} examples ({expected} chunk files) but only {len(found)} chunk files exist",
                self.adir,
            )
            return
        if len(found) < expected:
            present = np.zeros(expected, bool)  # bounded: expected <= files found + MAX_MISSING_ENUMERATED
            present[np.asarray(found, np.int64)] = True
            for flat in np.flatnonzero(~present)[: 100 * MAX_LISTED]:
                ex, rest = divmod(int(flat), L * n_tc)
                lp, tc = divmod(rest, n_tc)
                self.missing.setdefault((ex, lp), []).append(lay.chunk_path(ex, lp, tc))

    def _check_shard_file(self, lay: ChunkLayout, path: str, k: int) -> None:
        S = lay.shard_examples
        try:
            index = lay._shard_index(path)
        except CorruptChunkError as e:
            self.add(ERROR, "chunk-size", str(e), path, k * S)
            return
        if index is None:
            return
        stop = min(self.ctx.n - k * S, S)
        sizes = index[:stop, :, :, 1]
        empty = index[:stop, :, :, 0] == np.uint64(2**64 - 1)
        bad = (~empty) & (sizes != lay.chunk_nbytes)
        for i, lp, tc in np.argwhere(bad)[:MAX_LISTED]:
            self.add(
                ERROR, "chunk-size", f"inner chunk (token chunk {tc}) in shard file {os.path.basename(path)} has {int(sizes[i, lp, tc])} bytes, expected {lay.chunk_nbytes}",
                path, k * S + int(i), int(lp),
            )
            self.bad_size.add((k * S + int(i), int(lp)))

    # ---- deep: recompute checksums ---------------------------------------------------
    def _deep(self, lay: ChunkLayout | None) -> None:
        if self.blocks is None:
            return
        L, seg = self.cfg.n_layers, self.seg
        buf = np.zeros((self.n_tc * seg.t_chunk, self.cfg.d_model), np.dtype(self.cfg.zarr_dtype))
        zarr_arr = None
        if lay is None:
            import zarr

            try:
                zarr_arr = zarr.open_array(str(self.adir), mode="r")
            except Exception as e:  # noqa: BLE001 - untrusted metadata
                self.add(ERROR, "array-meta", f"array cannot be opened by zarr ({e!r})", self.adir)
                return
        for bi, b in enumerate(self.blocks):
            block_crc = 0
            damaged_here = False
            for local in range(b["start"], b["stop"]):
                rows = self._read_example(lay, zarr_arr, local, buf.shape, buf.dtype)
                for lp in range(L):
                    if rows is None or (local, lp) in self.bad_size:
                        damaged_here = True
                        continue
                    crc = crc32c(rows[lp])
                    block_crc = crc32c(rows[lp], block_crc)
                    self.v.report.n_bytes_read += rows[lp].nbytes
                    missing = (local, lp) in self.missing
                    if self.el is None:
                        damaged_here |= missing
                        continue
                    want = int(self.el[local, self.si, lp])
                    if missing and crc == want:
                        files = self.missing.pop((local, lp))
                        self.add(
                            WARNING, "missing-chunk",
                            f"chunk file {os.path.relpath(files[0], self.v.root)} is missing, but the checksum shows zeros were written there "
                            "(zarr omits chunks equal to the fill value: the shard was written with engine='zarr')",
                            files[0], local, lp,
                        )
                    elif missing:
                        damaged_here = True
                    elif crc != want:
                        damaged_here = True
                        files = self._files(lay, local, lp)
                        where = f"chunk file {os.path.basename(files[0])}" if len(files) == 1 else (
                            f"one of its chunk files {', '.join(os.path.basename(f) for f in files)}"
                        )
                        self.add(
                            ERROR, "checksum",
                            f"crc32c of (example {_name(self.ctx, local)}, layer {self.cfg.layers[lp]}) is {crc:#010x}, "
                            f"the writer recorded {want:#010x}: the bytes of {where} were altered",
                            files[0], local, lp,
                        )
                if self.v.progress is not None:
                    self.v.progress(L * buf.nbytes)
            if block_crc != b["crc32c"][seg.name] and not damaged_here:
                self.add(
                    ERROR, "block-checksum",
                    f"block {bi} (examples {b['start']}..{b['stop'] - 1} of the shard) has crc32c {block_crc:#010x}, the writer recorded "
                    f"{b['crc32c'][seg.name]:#010x}: "
                    + ("one of its chunk files was altered (this shard records no per-example checksums to say which)" if self.el is None
                       else "the block record or the per-example checksums were altered"),
                    self.ctx.sdir / spec.BLOCKS_FILE,
                )

    def _read_example(self, lay, zarr_arr, local: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray | None:
        """(L, n_tc * t_chunk, D) rows of one example in the stored dtype, or None if unreadable."""
        L = self.cfg.n_layers
        out = np.zeros((L, *shape), dtype)
        if lay is not None:
            for lp in range(L):
                if (local, lp) in self.bad_size:
                    continue
                try:
                    lay.read_into(local, lp, out[lp])
                except CorruptChunkError as e:
                    if (local, lp) not in self.bad_size:
                        self.bad_size.add((local, lp))
                        self.add(ERROR, "chunk-size", str(e), self._files(lay, local, lp)[0], local, lp)
            return out
        try:
            out[:, : self.seg.t_max] = zarr_arr[local]
        except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes is damage
            self.add(ERROR, "chunk-decode", f"example cannot be decoded by zarr ({e!r})", self.adir, local)
            return None
        return out

    def _files(self, lay: ChunkLayout | None, local: int, lp: int) -> list[str]:
        if lay is None:
            return [str(self.adir)]
        if lay.shard_examples is not None:
            return [lay.shard_path(local)]
        return [lay.chunk_path(local, lp, tc) for tc in range(self.n_tc)]


def _walk_files(top: Path):
    """(path, path relative to `top` with '/', DirEntry) of every file below `top`; links are not followed."""
    stack = [(str(top), "")]
    while stack:
        d, prefix = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                rel = prefix + e.name
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, rel + "/"))
                else:
                    yield e.path, rel, e


def _key_scheme(meta: dict[str, Any]) -> tuple[int, str]:
    """(zarr format, chunk key separator) of an array's metadata."""
    if meta.get("zarr_format") == 3:
        enc = meta.get("chunk_key_encoding") or {}
        conf = enc.get("configuration") or {}
        if enc.get("name") == "v2":
            return 2, conf.get("separator", ".")
        return 3, conf.get("separator", "/")
    return 2, meta.get("dimension_separator") or "."


def _chunk_key(rel: str, fmt: int, sep: str) -> tuple[int, ...] | None:
    if fmt == 3:
        if not rel.startswith("c" + sep):
            return None
        rel = rel[2:]
    if sep == "." and "/" in rel:
        return None
    parts = rel.split(sep)
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)

