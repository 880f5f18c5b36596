"""The source of a copy (`actstore cp`): SRC's manifest and identity, held in memory, and
every object it lists, classified by the step that publishes it (actstore.copy.copier)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from actstore.errors import CorruptStoreError, UnsafePathError
from actstore.layout import keys, records
from actstore.storage import KeyNotFound, Storage

ZARR_META = frozenset({keys.ZARRAY, keys.ZATTRS, keys.ZGROUP, keys.ZMETADATA})  # begin with '.' but are not temporary


@dataclass(frozen=True, slots=True)
class Item:
    """An object of SRC to copy."""

    key: str
    size: int
    data: bool  # an activation chunk or shard file: immutable once committed, may be skipped by size


@dataclass
class CopyPlan:
    """What a copy publishes, step by step (see actstore.copy.copier)."""

    identity: bytes
    manifest: bytes
    stats: Item | None
    commits: dict[str, bytes]  # shard name -> its commit.json, read before any data (published in step 2)
    objects: list[Item]  # step 1
    n_temporary: int = 0
    unlisted: tuple[str, ...] = ()
    not_files: tuple[str, ...] = ()


def plan_copy(s: Storage, pool: ThreadPoolExecutor) -> CopyPlan:
    """SRC's manifest and identity (held: published from memory), every object classified."""
    try:
        manifest = s.get(keys.MANIFEST)
    except KeyNotFound:
        from actstore import catalog

        catalog.read_manifest(s)  # raises the right error: not a store, or not finalized
        raise
    m = records.parse_manifest(manifest, s.where(keys.MANIFEST), s.url)
    try:
        identity = s.get(keys.IDENTITY)
    except KeyNotFound:
        raise CorruptStoreError(
            f"{s.url} has a {keys.MANIFEST} but no {keys.IDENTITY}; the store is damaged "
            f"(run `actstore verify {s.url}`)"
        ) from None
    if records.parse_identity(identity, s.where(keys.IDENTITY)) != m.config:
        raise CorruptStoreError(
            f"{s.where(keys.MANIFEST)} and {s.where(keys.IDENTITY)} describe different stores; "
            f"rerun `actstore finalize {s.url}`"
        )
    listed = [e.name for e in m.shards]
    commit_keys = [f"{keys.shard_prefix(n)}/{keys.COMMIT}" for n in listed]
    try:  # read before anything is listed or copied: the data copied is never older than its records
        commits = dict(zip(listed, pool.map(s.get, commit_keys)))
    except KeyNotFound as e:
        raise CorruptStoreError(
            f"{s.url} is damaged: its manifest lists a shard without a commit record ({e}); "
            f"run `actstore verify {s.url}`"
        ) from None
    data_dirs = tuple(f"/{keys.acts_array(seg.name)}/" for seg in m.config.segments)
    plan = CopyPlan(identity=identity, manifest=manifest, stats=None, commits=commits, objects=[])
    unlisted, odd, temporary = set(), [], 0
    for e in s.list(""):
        parts = e.key.split("/")
        if e.kind == "dir" or (e.key.endswith("/") and e.size == 0):
            continue  # an empty folder, or an object store's folder marker
        if any(p in ("", ".", "..") for p in parts) or e.key.startswith("/"):
            raise UnsafePathError(
                f"{s.where(e.key)}: key {e.key!r} is not a path inside the store; refusing to copy it"
            )
        if any(keys.is_temporary(p) and p not in ZARR_META for p in parts):
            temporary += 1
        elif parts[0] == keys.SHARDS and (len(parts) < 3 or parts[1] not in commits):
            unlisted.add(parts[1] if len(parts) > 2 else e.key)
        elif e.kind != "file":
            odd.append(f"{e.key} ({e.kind})")
        elif e.key in (keys.MANIFEST, keys.IDENTITY) or "/".join(parts[2:]) == keys.COMMIT:
            continue  # held in memory, published in their own steps
        elif m.stats is not None and e.key == m.stats:
            plan.stats = Item(e.key, e.size, False)
        else:
            data = (
                parts[0] == keys.SHARDS
                and any(d in e.key for d in data_dirs)
                and parts[-1] not in ZARR_META | {keys.ZARR_JSON}
            )
            plan.objects.append(Item(e.key, e.size, data))
    if m.stats is not None and plan.stats is None:
        raise CorruptStoreError(
            f"{s.url} is damaged: its manifest names the statistics file {m.stats}, which does not "
            f"exist (run `actstore verify {s.url}`)"
        )
    plan.n_temporary, plan.unlisted, plan.not_files = temporary, tuple(sorted(unlisted)), tuple(sorted(odd))
    return plan
