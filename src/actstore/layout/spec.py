"""Constants of the actstore format v1; this module mirrors docs/format.md.

A test (tests/test_format_doc.py) checks that every name defined here appears in the
document and that the document's field tables list exactly these fields.
"""

from __future__ import annotations

FORMAT_NAME = "actstore"
FORMAT_VERSION = 1

# Files and folders at the store root.
IDENTITY_FILE = "actstore.json"
MANIFEST_FILE = "manifest.json"
SHARDS_DIR = "shards"
SHARD_NAME_FORMAT = "shard-{:05d}.zarr"
MAX_SHARD = 99_999
LEASES_DIR = "leases"  # a writer's exclusive lease on a shard: leases/shard-NNNNN.<generation>.json
LEASE_FILE_FORMAT = "leases/shard-{:05d}.{}.json"
DEFAULT_LEASE_TTL = 60.0  # seconds a lease on another host stays valid without renewal
MAX_WORLD_SIZE = MAX_SHARD + 1

# Inside one writer shard (a Zarr group).
ARRAYS_GROUP = "arrays"
META_DIR = "meta"
TEXT_DIR = "text"
COMMIT_FILE = "meta/commit.json"
BLOCKS_FILE = "meta/blocks.jsonl"
EL_CRC_FILE = "meta/example_layer_crc32c.u32"
STATS_FILE_FORMAT = "meta/stats-{:012d}.npz"

# Array names inside `arrays/`, per segment.
ACTS_SUFFIX = "_activations"
LEN_SUFFIX = "_len"
TOKEN_LABELS_SUFFIX = "_token_labels"
# What a store's per-token labels mean (the config's `token_labels`, section 1.2): `true` =
# classes (data: no reader masks by them); an object {"meaning": TOKEN_LABELS_KINDS, "names":
# {label: name}} = token kinds, of which the default mask keeps label CONTENT_LABEL only.
TOKEN_LABELS_FIELDS = ("meaning", "names")
TOKEN_LABELS_KINDS = "kinds"
CONTENT_LABEL = 0
TOKEN_KIND_NAMES = {0: "content", 1: "special", 2: "template"}  # what the capture records
# A text whose model has no BOS token: its first position (the attention sink) is labelled
# FIRST_LABEL (the capture's --bos auto), a kind the default mask leaves out. Stores that use
# it add FIRST_KIND to their kind names; stores written before never hold it.
FIRST_LABEL = 3
FIRST_KIND = {FIRST_LABEL: "first"}
BOS_MODES = ("auto", "always", "never")  # the capture's --bos: what token 0 of a text is
# Stores written before the config said so: capture-made ones carry this attr, whose label
# "0" is "content" (the capture's TOKEN_LABEL_MEANING); their labels read as token kinds.
LEGACY_KINDS_ATTR = "token_labels"
TOKEN_IDS_SUFFIX = "_token_ids"  # per token: the model's vocabulary id (int32; padding 0)
TOKEN_ID_DTYPE = "<i4"
SAMPLE_KEY = "sample_key"
RESERVED_SUFFIXES = (ACTS_SUFFIX, LEN_SUFFIX, TOKEN_LABELS_SUFFIX, TOKEN_IDS_SUFFIX)

# Axis names of an activation array, in order.
AXES = ("example", "layer", "token", "d_model")
# Dimension names of a shard's arrays (format 3 `dimension_names`, format 2 the
# `_ARRAY_DIMENSIONS` attribute), so that xarray opens a shard: activations are
# (EXAMPLE_DIM, LAYER_DIM, token_dim(segment), D_MODEL_DIM); per-sample arrays (EXAMPLE_DIM,);
# token labels (EXAMPLE_DIM, token_dim(segment)); format 3's sample_key rows
# (EXAMPLE_DIM, SAMPLE_KEY_BYTE_DIM).
EXAMPLE_DIM, LAYER_DIM, TOKEN_DIM, D_MODEL_DIM = AXES
SAMPLE_KEY_BYTE_DIM = "sample_key_byte"


def token_dim(segment: str) -> str:
    """The token dimension name of `segment`: TOKEN_DIM for DEFAULT_SEGMENT, else `<segment>_token`.

    Segments differ in length, so each needs its own dimension name in one Zarr group.
    """
    return TOKEN_DIM if segment == DEFAULT_SEGMENT else f"{segment}_{TOKEN_DIM}"


# Activation dtypes: the name users pass -> the Zarr dtype on disk.
# bfloat16 has no numpy/Zarr v2 dtype: its 16 bits are stored as little-endian uint16
# and the array attribute `actstore_dtype` says "bfloat16".
ACT_DTYPES = {"float16": "<f2", "float32": "<f4", "bfloat16": "<u2"}
DEFAULT_DTYPE = "float16"
FLOAT16_MAX = 65504.0

# Chunking: one chunk is (1, 1, T_chunk, D). By default T_chunk = T_max unless a chunk
# would exceed MAX_CHUNK_BYTES; then the token axis is split into equal chunks.
MAX_CHUNK_BYTES = 4 * 2**20
PER_SAMPLE_CHUNK = 65_536  # rows of a per-sample chunk, at most
# A per-sample chunk holds about this many bytes (at least one row), so a small store is not
# mostly zero padding; stores written before chunked them at LEGACY_PER_SAMPLE_CHUNK_BYTES.
PER_SAMPLE_CHUNK_BYTES = 64 * 2**10
LEGACY_PER_SAMPLE_CHUNK_BYTES = 4 * 2**20
# A per-sample array with this attribute true has every chunk that holds a published row
# on disk, zeros included (the writer sets Zarr's write_empty_chunks): a missing chunk is
# damage, not zeros. Arrays without it (written before the attribute existed) may omit chunks of
# zeros, as Zarr does by default.
EVERY_CHUNK_ATTR = "actstore_every_chunk"
FILL_VALUE = 0
ZARR_FORMATS = (2, 3)
# The default layout: Zarr format 3 with sharding, each Zarr shard file holding the
# examples that fill about DEFAULT_SHARD_BYTES (SHARD_EXAMPLES_AUTO); the chunk-file layout
# (one object per chunk) is zarr_format=2.
DEFAULT_ZARR_FORMAT = 3
DEFAULT_SHARD_BYTES = 256 * 2**20
# ... and at most this many examples, so that a shard file's index (16 bytes per inner
# chunk, written whole even for a partly filled file) stays small for tiny examples.
MAX_AUTO_SHARD_EXAMPLES = 4096
SHARD_EXAMPLES_AUTO = "auto"

# Commit blocks: a writer commits after this many bytes of activations (or at close).
DEFAULT_COMMIT_BYTES = 256 * 2**20

# Segment names.
DEFAULT_SEGMENT = "tokens"
SEGMENT_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
SAMPLE_KEY_BYTES = 64

# Manifest ordering of examples: shards in ascending shard number, each in local order.
ORDER_SHARD_MAJOR = "shard-major"

# Fields of the JSON documents (checked against docs/format.md).
IDENTITY_FIELDS = ("format", "format_version", "config")
CONFIG_FIELDS = (
    "layers",
    "d_model",
    "dtype",
    "segments",
    "zarr_format",
    "shard_examples",
    "fields",
    "texts",
    "token_labels",
    "model_id",
    "attrs",
)
CONFIG_OPTIONAL_FIELDS = ("token_ids",)  # written only when true: older stores read unchanged
SEGMENT_FIELDS = ("t_max", "t_chunk", "fixed")
COMMIT_FIELDS = (
    "format_version",
    "shard",
    "n_committed",
    "complete",
    "n_blocks",
    "text_bytes",
    "truncated",
    "nonfinite",
    "overflow",
    "stats_file",
    "updated",
)
COMMIT_OPTIONAL_FIELDS = ("world_size",)  # written by ranked writers only
MANIFEST_FIELDS = (
    "format",
    "format_version",
    "actstore_version",
    "created",
    "config",
    "order",
    "n_examples",
    "shards",
    "truncation",
    "nonfinite",
    "overflow",
    "stats",
)
MANIFEST_OPTIONAL_FIELDS = ("world_size", "partial", "spool_budget")
PARTIAL_FIELDS = ("missing_ranks", "incomplete_shards")
LEASE_FIELDS = ("shard", "generation", "token", "host", "pid", "pid_start", "started", "renewed", "ttl")
STATS_FILE = "stats-{:08x}.npz"
MANIFEST_SHARD_FIELDS = ("shard", "name", "start", "n_examples", "complete", "n_blocks", "crc32c", "nbytes")
