"""Store-level checks: identity against manifest, root entries, shards present and listed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actstore import catalog
from actstore.errors import ActstoreError, FormatVersionError, StoreNotFoundError, VerificationError
from actstore.layout import keys
from actstore.layout.records import Manifest
from actstore.layout.spool import SPOOL_DIR, SPOOL_FILE, removed_union
from actstore.spoolstate import read_record, read_removed
from actstore.storage import open_storage
from actstore.verify.check import Checker
from actstore.verify.deep import load_stats
from actstore.verify.family import FAMILY_FILE, verify_members
from actstore.verify.report import ERROR, WARNING, VerifyReport, plural
from actstore.verify.shard import check_shard


def verify_store(
    path: Any,
    *,
    deep: bool = False,
    raise_on_error: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check a store's integrity (docs/reliability.md says what each mode checks).

    Args:
        path: the store root: a folder, an object-store URL, or a Storage; of an aligned
            family (docs/format.md, section 9), every member, and their example counts.
        deep: also read every published chunk and compare its crc32c with the record.
        raise_on_error: raise VerificationError (holding the report) if an error was found.
        progress: called with the number of bytes read after each example (deep mode).

    Returns:
        The report. A store written by a newer actstore raises FormatVersionError; a path
        that holds no store raises StoreNotFoundError.
    """
    storage = open_storage(path)
    catalog.check_folder(storage)
    root = storage.url
    names = storage.list_dir()  # empty for a missing folder or a file
    if FAMILY_FILE in names and not (keys.IDENTITY in names or keys.MANIFEST in names):
        report = verify_members(storage, lambda s: verify_store(s, deep=deep, progress=progress))
    elif not (keys.IDENTITY in names or keys.MANIFEST in names):
        raise StoreNotFoundError(f"{root} is not an actstore store (no {keys.IDENTITY} or {keys.MANIFEST})")
    else:
        report = _run(Checker(storage, deep, progress))
    if raise_on_error and not report.ok:
        first = report.errors[0]
        raise VerificationError(
            f"{root} failed verification ({'deep' if deep else 'fast'}): {plural(len(report.errors), 'error')}, the first: "
            f"{first.message}. Run `actstore verify {root}{' --deep' if deep else ''}` for the full table",
            report,
        )
    return report


def _record(v: Checker, key: str, kind: str, read: Callable[[Any], Any]) -> Any:
    """A root record read through `read`, or None with its damage reported (a newer format raises)."""
    try:
        return read(v.storage)
    except FormatVersionError:
        raise
    except (ActstoreError, OSError) as e:
        v.add(ERROR, kind, str(e), key)
        return None


def _run(v: Checker) -> VerifyReport:
    ident = manifest = None
    if v.listing.kind(keys.IDENTITY) is not None:
        ident = _record(v, keys.IDENTITY, "identity", catalog.read_identity)
    else:
        v.add(ERROR, "identity", f"{keys.IDENTITY} is missing (every store has one, written by its first writer)")
    if v.listing.kind(keys.MANIFEST) is not None:
        manifest = _record(v, keys.MANIFEST, "manifest", catalog.read_manifest)
    else:
        v.report.finalized = False
        v.add(
            WARNING,
            "not-finalized",
            f"no {keys.MANIFEST}: the store was never finalized and readers cannot open it; "
            f"run `actstore finalize {v.storage.url}` once every writer has closed",
        )
    if manifest is not None and ident is not None and ident.differences(manifest.config):
        v.add(
            ERROR,
            "identity",
            f"{keys.IDENTITY} and {keys.MANIFEST} describe different stores: "
            f"{'; '.join(ident.differences(manifest.config))}",
            keys.MANIFEST,
        )
    if manifest is not None and manifest.partial is not None:
        p = manifest.partial
        v.add(
            WARNING,
            "partial",
            f"the store was finalized as partial (finalize --allow-partial): "
            f"{f'ranks {list(p.missing_ranks)} of {manifest.world_size} wrote no shard' if p.missing_ranks else ''}"
            f"{'; ' if p.missing_ranks and p.incomplete_shards else ''}"
            f"{f'shards {list(p.incomplete_shards)} were never closed (only their committed prefix is published)' if p.incomplete_shards else ''}; "
            "resume those writers and finalize again for the whole run",
            keys.MANIFEST,
        )
    v.cfg = manifest.config if manifest is not None else ident
    if v.cfg is None:
        return v.report
    _load_spool(v)
    _check_root(v, manifest)
    _check_shards(v, manifest)
    return v.report


def _load_spool(v: Checker) -> None:
    """A spool's removed examples, whose activation files are gone on purpose (damaged spool
    records are an error: then every missing file is reported)."""
    if v.listing.kind(SPOOL_FILE) is None:
        return
    try:
        if read_record(v.storage) is not None:
            v.removed = {s: removed_union(r.values()) for s, r in read_removed(v.storage).items()}
    except (ActstoreError, OSError) as e:
        v.add(ERROR, "spool", f"the spool's records cannot be read ({e})", SPOOL_DIR)


def _check_root(v: Checker, manifest: Manifest | None) -> None:
    expected = {keys.IDENTITY, keys.MANIFEST, keys.SHARDS, SPOOL_DIR}
    if manifest is not None and manifest.stats:
        expected.add(manifest.stats)
        kind = v.listing.kind(manifest.stats)
        if kind is None:
            v.add(ERROR, "stats", f"statistics file {manifest.stats} named by the manifest is missing", manifest.stats)
        elif not v.not_a_file(manifest.stats, kind, None) and v.deep:
            load_stats(v, manifest.stats, None)
    _check_leases(v)
    for name, kind in sorted(v.listing.children("").items()):
        if v.odd_entry(name, kind, None) or name in expected or name == keys.LEASES:
            continue
        if keys.is_temporary(name):
            if keys.is_interrupted_write(name):
                v.add(
                    WARNING,
                    "temp-file",
                    f"{name} is the temporary file of an interrupted write (finalize killed?); safe to delete",
                    name,
                )
        elif keys.is_store_stats_file(name) and manifest is None and v.listing.kind(keys.MANIFEST) is not None:
            v.add(  # the manifest that names the live statistics is damaged: this may be them
                WARNING,
                "stale-stats",
                f"{name} holds statistics of a finalize; {keys.MANIFEST}, which names the live ones, is damaged, so "
                "these may be them: keep it (`actstore finalize` rewrites the manifest)",
                name,
            )
        elif keys.is_store_stats_file(name):
            v.add(
                WARNING,
                "stale-stats",
                f"{name} holds statistics of an earlier finalize (kept for readers of the previous manifest); safe to delete",
                name,
            )
        else:
            v.add(WARNING, "stray-file", f"{name} is not part of an actstore store", name)


def _check_leases(v: Checker) -> None:
    """leases/ holds the lease of each shard a writer is writing now (or was, when killed)."""
    for name, kind in sorted(v.listing.children(keys.LEASES).items()):
        key = f"{keys.LEASES}/{name}"
        parsed = keys.parse_lease_name(name)
        if v.odd_entry(key, kind, None) or keys.is_temporary(name):
            continue
        if parsed is None:
            v.add(WARNING, "stray-file", f"{key} is not a shard lease (names are shard-NNNNN.<generation>.json)", key)
        else:
            v.add(
                WARNING,
                "lease",
                f"shard {parsed[0]} is leased to a writer ({key}): one is writing it now, or was killed; "
                "`actstore write --resume` (or ShardWriter(..., resume=True)) takes a dead writer's shard over",
                key,
                shard=parsed[0],
            )


def _check_shards(v: Checker, manifest: Manifest | None) -> None:
    present: list[str] = []
    for name, kind in sorted(v.listing.children(keys.SHARDS).items()):
        key = f"{keys.SHARDS}/{name}"
        if keys.parse_shard_name(name) is not None:
            present.append(name)
        elif v.odd_entry(key, kind, None):
            continue
        elif keys.is_interrupted_write(name):
            v.add(
                WARNING,
                "temp-file",
                f"{name} is the folder of a writer killed while creating its shard; safe to delete when no writer runs",
                key,
            )
        elif not keys.is_temporary(name):
            v.add(
                WARNING,
                "stray-file",
                f"{name} in {keys.SHARDS}/ is not a writer shard (names are shard-NNNNN.zarr)",
                key,
            )
    if manifest is None:
        for name in present:
            check_shard(v, name, None)
        return
    listed = {s.name for s in manifest.shards}
    for entry in manifest.shards:
        if entry.name not in present:
            v.add(
                ERROR,
                "missing-shard",
                f"shard {entry.name} listed in the manifest (examples {entry.start}..{entry.start + entry.n_examples - 1}) is missing; "
                f"shards present: {present}",
                keys.shard_prefix(entry.name),
                shard=entry.shard,
            )
        else:
            check_shard(v, entry.name, entry)
    for name in present:
        if name not in listed:
            v.add(
                WARNING,
                "unpublished-shard",
                f"shard {name} is not in the manifest (written after the last finalize, or by a writer still running); "
                "readers do not see it until `actstore finalize` publishes it",
                keys.shard_prefix(name),
                shard=keys.parse_shard_name(name),
            )
