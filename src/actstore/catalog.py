"""The store's records read through its Storage: identity, manifest, commits, blocks.

The one place that turns a store's keys into typed records (actstore.layout.records) and
a missing or damaged record into the project's error. Writers, readers and verification
all read records here.
"""

from __future__ import annotations

from typing import Any

from actstore.errors import CorruptStoreError, NotFinalizedError, StoreNotFoundError
from actstore.layout import jsonio, keys, records, spec
from actstore.layout.config import StoreConfig
from actstore.layout.family import FAMILY_FILE, MAX_FAMILY_BYTES, Family
from actstore.layout.family import parse as parse_family
from actstore.storage import KeyNotFound, Storage


def read_identity(storage: Storage) -> StoreConfig:
    """The configuration in the store's identity file (actstore.json)."""
    try:
        data = storage.get(keys.IDENTITY)
    except KeyNotFound:
        raise StoreNotFoundError(f"{storage.url} is not an actstore store (no {keys.IDENTITY})") from None
    return records.parse_identity(data, storage.where(keys.IDENTITY))


def check_folder(storage: Storage) -> None:
    """A local store path that is a file (or anything but a folder) is no store."""
    root = storage.local_root
    if root is not None and root.exists() and not root.is_dir():
        raise StoreNotFoundError(
            f"{storage.url} is a file, not an actstore store (a store is a folder holding {keys.MANIFEST})"
        )


def has_identity(storage: Storage) -> bool:
    return storage.exists(keys.IDENTITY)


def read_family(storage: Storage) -> Family:
    """The record of the aligned family at `storage` (family.json, docs/format.md section 9)."""
    try:
        data = storage.get(FAMILY_FILE, max_bytes=MAX_FAMILY_BYTES)
    except KeyNotFound:
        raise StoreNotFoundError(f"{storage.url} is not an actstore family (no {FAMILY_FILE})") from None
    except ValueError as e:  # larger than any family record
        raise CorruptStoreError(f"{storage.where(FAMILY_FILE)} is damaged ({e})") from None
    return parse_family(data, storage.where(FAMILY_FILE))


def read_manifest(storage: Storage) -> records.Manifest:
    """The validated manifest of a finalized store."""
    return read_manifest_bytes(storage)[0]


def read_manifest_bytes(storage: Storage) -> tuple[records.Manifest, bytes]:
    """The validated manifest of a finalized store and the bytes it was parsed from (their
    sha256 names the exact state a reader opened)."""
    try:
        data = storage.get(keys.MANIFEST)
    except KeyNotFound:
        if storage.exists(keys.IDENTITY) or storage.list_dir(keys.SHARDS):
            raise NotFinalizedError(
                f"{storage.url} has writer shards but was never finalized (no {keys.MANIFEST}); "
                f"run `actstore finalize {storage.url}` once every writer has closed"
            ) from None
        raise StoreNotFoundError(f"{storage.url} is not an actstore store (no {keys.MANIFEST})") from None
    manifest = records.parse_manifest(data, storage.where(keys.MANIFEST), storage.url)
    return _without_claims(manifest), data


def _without_claims(m: records.Manifest) -> records.Manifest:
    """The manifest without entries of shards that were only claimed (no example, never
    closed: an older finalize --allow-partial published them), which hold no arrays: every
    reader skips them alike, as finalize now leaves them out."""
    if all(e.n_examples or e.complete for e in m.shards):
        return m
    from dataclasses import replace

    return replace(m, shards=tuple(e for e in m.shards if e.n_examples or e.complete))


def shard_numbers(storage: Storage) -> list[int]:
    """Shard numbers present under shards/, ascending (temporary names left out)."""
    nums = (keys.parse_shard_name(n) for n in storage.list_dir(keys.SHARDS))
    return sorted(n for n in nums if n is not None)


def shard_storage(storage: Storage, shard: int | str) -> Storage:
    """The Storage of one writer shard (keys relative to the shard's folder)."""
    return storage.child(keys.shard_prefix(shard))


def read_commit(shard: Storage) -> records.Commit:
    """A writer shard's commit record (meta/commit.json)."""
    try:
        data = shard.get(keys.COMMIT)
    except KeyNotFound:
        raise CorruptStoreError(
            f"{shard.url} has no {keys.COMMIT}: it is not a writer shard (or was never initialised)"
        ) from None
    return records.parse_commit(data, shard.where(keys.COMMIT))


def committed(storage: Storage, shard: int) -> tuple[int, bool]:
    """(examples committed, complete) of a writer shard; (0, False) when it does not exist."""
    sh = shard_storage(storage, shard)
    if sh.kind(keys.COMMIT) is None:
        return 0, False
    rec = read_commit(sh)
    return rec.n_committed, rec.complete


def claim_pending(shard: Storage) -> bool:
    """Whether a started shard folder holds no commit record and nothing but temporary
    files: a claim under way, or a writer killed inside its claim (a new writer claims it
    afresh; finalize and verify treat it as a shard with nothing committed). Names only: a
    racing claimant deletes its temporary file at any time."""
    if shard.exists(keys.COMMIT):
        return False
    if shard.list_dir("") not in ([], [keys.META_DIR]):
        return False
    return all(keys.is_temporary(n) for n in shard.list_dir(keys.META_DIR))


def shard_exists(storage: Storage, shard: int) -> bool:
    """Whether a writer shard of this number has been started (anything under its folder)."""
    return bool(storage.list_dir(keys.shard_prefix(shard)))


def read_blocks(shard: Storage, n_blocks: int) -> list[records.Block]:
    """The first `n_blocks` block records of a shard (later lines are uncommitted)."""
    try:
        data = shard.get(keys.BLOCKS)
    except KeyNotFound:
        if n_blocks == 0:
            return []
        raise CorruptStoreError(
            f"{shard.url} has no {keys.BLOCKS} but its commit record says {n_blocks} blocks"
        ) from None
    return records.parse_blocks(data, n_blocks, shard.where(keys.BLOCKS))


def rows_on_disk(shard: Storage, zarr_format: int | None = None) -> int:
    """An upper bound on a shard's examples from the chunk files its sample_key array holds.

    Checked before per-sample arrays are read, so that metadata claiming more examples than
    were ever written cannot make a reader allocate for them. (zarr omits only chunks of all
    zero bytes; the writer's default keys are never empty, and a whole chunk of empty
    user-given keys is refused here.)
    """
    rel = keys.field_array(spec.SAMPLE_KEY)
    try:
        meta = array_meta(shard, rel, zarr_format)
        chunks = meta["chunks"] if meta.get("zarr_format") == 2 else meta["chunk_grid"]["configuration"]["chunk_shape"]
        rows = int(chunks[0])
        heads = [n.split(".")[0] for n in shard.list_dir(rel + "/c" if meta.get("zarr_format") == 3 else rel)]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, CorruptStoreError) as e:
        raise CorruptStoreError(f"array {shard.where(rel)} has damaged metadata ({e!r})") from None
    top = max((int(h) for h in heads if h.isdigit()), default=-1)
    return (top + 1) * rows


def consolidated_arrays(shard: Storage, zarr_format: int | None = None) -> dict[str, Any] | None:
    """Array metadata keyed by path from a shard's consolidated metadata, when it has it.

    Each document is fetched by one GET, a missing one answered by its KeyNotFound (no
    existence check first: on an object store that would be a request more); the store's
    `zarr_format`, when given, says which to try first."""
    v2 = _get_json(shard, keys.ZMETADATA, "consolidated metadata") if zarr_format != 3 else None
    if v2 is not None:
        return {k[: -len("/" + keys.ZARRAY)]: v for k, v in v2["metadata"].items() if k.endswith("/" + keys.ZARRAY)}
    root = _get_json(shard, keys.ZARR_JSON, "group metadata")
    if root is None:
        return None
    cm = (root.get("consolidated_metadata") or {}).get("metadata")
    return {k: v for k, v in cm.items() if v.get("node_type") == "array"} if cm else None


def _get_json(shard: Storage, key: str, what: str) -> Any:
    """The JSON document at `key`, or None where there is none."""
    try:
        data = shard.get(key)
    except KeyNotFound:
        return None
    return jsonio.loads(data, shard.where(key), what=what)


def array_meta(shard: Storage, rel: str, zarr_format: int | None = None) -> dict[str, Any]:
    """The Zarr metadata document of array `rel` (format 2 or 3; the store's `zarr_format`,
    when given, is looked for first); whatever stands there instead of a file raises
    (Storage.get names it). One GET a name tried: no existence check first."""
    names = (keys.ZARR_JSON, keys.ZARRAY) if zarr_format == 3 else (keys.ZARRAY, keys.ZARR_JSON)
    for name in names:
        key = f"{rel}/{name}"
        try:
            data = shard.get(key)
        except KeyNotFound:
            continue
        doc = jsonio.loads(data, shard.where(key), what="array metadata")
        if not isinstance(doc, dict):
            raise CorruptStoreError(
                f"{shard.where(key)}: array metadata must be a JSON object, got {type(doc).__name__}"
            )
        return doc
    raise KeyNotFound(f"{shard.where(rel)} holds no Zarr array metadata ({keys.ZARRAY} or {keys.ZARR_JSON})")


def array_attrs(shard: Storage, rel: str, meta: dict[str, Any]) -> dict[str, Any]:
    """An array's attributes: `.zattrs` beside a format 2 `.zarray` (absent: none), the
    `attributes` of a format 3 `zarr.json`; damage raises CorruptStoreError."""
    if meta.get("zarr_format") == 3:
        attrs = meta.get("attributes", {})
        where = shard.where(f"{rel}/{keys.ZARR_JSON}")
    else:
        key = f"{rel}/{keys.ZATTRS}"
        where = shard.where(key)
        attrs = jsonio.loads(shard.get(key), where, what="array attributes") if shard.kind(key) is not None else {}
    if not isinstance(attrs, dict):
        raise CorruptStoreError(f"{where}: array attributes must be a JSON object, got {type(attrs).__name__}")
    return attrs
