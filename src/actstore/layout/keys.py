"""Names of every object in a store, as storage keys ('/'-separated, relative to the root).

The only place that spells a file or array name of the format (docs/format.md, sections
1 and 3); everything else asks this module.
"""

from __future__ import annotations

import re

from actstore.layout import spec

SHARD_NAME_RE = re.compile(r"^shard-(\d{5})\.zarr$")

IDENTITY = spec.IDENTITY_FILE
MANIFEST = spec.MANIFEST_FILE
SHARDS = spec.SHARDS_DIR
LEASES = spec.LEASES_DIR
_LEASE_NAME_RE = re.compile(r"^shard-(\d{5})\.(\d{1,9})\.json$")


def shard_name(shard: int) -> str:
    """`shard-NNNNN.zarr` of shard number `shard`."""
    return spec.SHARD_NAME_FORMAT.format(shard)


def parse_shard_name(name: str) -> int | None:
    """The shard number of a shard folder name, or None when `name` is not one."""
    m = SHARD_NAME_RE.match(name)
    return int(m.group(1)) if m else None


def shard_prefix(shard: int | str) -> str:
    """Key prefix of a writer shard (by number or by folder name)."""
    return f"{spec.SHARDS_DIR}/{shard_name(shard) if isinstance(shard, int) else shard}"


def lease_key(shard: int, generation: int) -> str:
    """The lease file of generation `generation` on shard `shard` (from the store root)."""
    return spec.LEASE_FILE_FORMAT.format(shard, generation)


def parse_lease_name(name: str) -> tuple[int, int] | None:
    """(shard, generation) of a file name in leases/, or None when `name` is not a lease."""
    m = _LEASE_NAME_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_temporary(name: str) -> bool:
    """Names beginning with '.' are temporary files of unfinished atomic writes (and other
    private files), except zarr's own metadata names (.zarray, .zattrs, .zgroup, .zmetadata)."""
    return name.startswith(".") and name not in ZARR_NAMES


def is_interrupted_write(name: str) -> bool:
    """Whether `name` is the temporary name (`.<name>.tmp-<...>`) of a file or shard folder
    whose atomic write was interrupted: left behind only by a killed process."""
    return is_temporary(name) and ".tmp-" in name


def basename(key: str) -> str:
    """The last part of a key (`meta/commit.json` -> `commit.json`)."""
    return key.rsplit("/", 1)[-1]


def store_stats_file(crc: int) -> str:
    """The merged statistics file of a finalized store, named by the crc32c of its bytes."""
    return spec.STATS_FILE.format(crc)


# Statistics files by name: a store's (`stats-<crc32c hex>.npz`, or `stats.npz` of early
# stores) at its root, a shard's (`stats-<n_committed, 12 digits>.npz`) in its meta folder.
_STORE_STATS_RE = re.compile(r"^stats(-[0-9a-f]{8})?\.npz$")
_SHARD_STATS_RE = re.compile(r"^stats-\d{12}\.npz$")


def is_store_stats_file(name: str) -> bool:
    """Whether a name at the store's root is a statistics file of some finalize."""
    return _STORE_STATS_RE.match(name) is not None


def is_shard_stats_file(name: str) -> bool:
    """Whether a name in a shard's meta folder is a statistics file of some commit."""
    return _SHARD_STATS_RE.match(name) is not None


# ---- zarr's own metadata files -------------------------------------------------------
ZARRAY = ".zarray"  # format 2 array metadata
ZATTRS = ".zattrs"  # format 2 attributes
ZGROUP = ".zgroup"
ZMETADATA = ".zmetadata"  # format 2 consolidated metadata
ZARR_JSON = "zarr.json"  # format 3 array or group metadata (consolidated inside for groups)
ZARR_NAMES = (ZARRAY, ZATTRS, ZGROUP, ZMETADATA, ZARR_JSON)


# ---- inside one writer shard (keys relative to the shard's prefix) -----------------
COMMIT = spec.COMMIT_FILE
BLOCKS = spec.BLOCKS_FILE
EL_CRC = spec.EL_CRC_FILE
META_DIR = spec.META_DIR
TEXT_DIR = spec.TEXT_DIR
ARRAYS = spec.ARRAYS_GROUP


def shard_stats_file(n_committed: int) -> str:
    """The statistics file a shard's commit of `n_committed` examples writes."""
    return spec.STATS_FILE_FORMAT.format(n_committed)


def text_file(name: str) -> str:
    return f"{spec.TEXT_DIR}/{name}.jsonl"


def acts_array(segment: str) -> str:
    return f"{spec.ARRAYS_GROUP}/{segment}{spec.ACTS_SUFFIX}"


def len_array(segment: str) -> str:
    return f"{spec.ARRAYS_GROUP}/{segment}{spec.LEN_SUFFIX}"


def labels_array(segment: str) -> str:
    return f"{spec.ARRAYS_GROUP}/{segment}{spec.TOKEN_LABELS_SUFFIX}"


def field_array(name: str) -> str:
    return f"{spec.ARRAYS_GROUP}/{name}"


def len_field(segment: str) -> str:
    """The per-sample field name of a segment's lengths (`<segment>_len`)."""
    return segment + spec.LEN_SUFFIX


def token_ids_array(segment: str) -> str:
    return f"{spec.ARRAYS_GROUP}/{segment}{spec.TOKEN_IDS_SUFFIX}"


def token_ids_field(segment: str) -> str:
    return segment + spec.TOKEN_IDS_SUFFIX


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p)


def is_published_data(key: str) -> bool:
    """Whether `key` (from the store root) is data that a finalized store never rewrites
    while its manifest stands: activation chunks and Zarr shard files, per-sample chunks,
    texts. Records (commit, blocks, checksums, manifest) and Zarr metadata are not: a
    resumed shard rewrites them. A read cache keeps only these keys."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != SHARDS or parts[2] == META_DIR:
        return False
    return parts[-1] not in ZARR_NAMES and not is_temporary(parts[-1])
