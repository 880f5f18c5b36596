"""saev shard protocols 2.0 (the seed) and 2.1 (what saev's loaders read): constants only,
plus the pure functions every other module shares (hash, shard maths, offsets).

Protocol 2.0 is `saev-protocol-2.0.txt` exactly; 2.1 is what saev's own loaders accept
(docs/export.md lists both side by side). Both store float32 little-endian C-order
(examples_per_shard, L, T, D) shard files with T = content tokens + 1 if cls_token.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

PROTOCOLS = ("2.0", "2.1")
DEFAULT_PROTOCOL = "2.0"  # of make_plan; export_saev's default is "auto" (choose_protocol)


def choose_protocol(protocol: str | None, root: Any) -> str:
    """ "auto" (or None): 2.1, what saev's current loaders read, where they can read it (a
    directory under .../saev/shards, the layout they require); else the seed's 2.0."""
    if protocol not in (None, "auto"):
        return protocol
    parts = tuple(str(root).rstrip("/").split("/")[-2:])
    return "2.1" if parts == SHARDS_ROOT_PARTS else "2.0"


METADATA_FILE = "metadata.json"
SHARDS_FILE = "shards.json"
LABELS_FILE = "labels.bin"
# Exports of padded (LLM) stores hold real tokens only, packed: this file maps them back.
# int64 little-endian, n_store_examples + 1 values: exported token k (in the stream of
# exported examples x content tokens) is position k - offsets[e] of store example e, where
# offsets[e] <= k < offsets[e + 1] (the example's tokens as store[e, layer] returns them).
OFFSETS_FILE = "example_offsets.bin"
# actstore's checksum sidecar (saev/checksums.py): saev's loaders never open it.
CHECKSUMS_FILE = "actstore_checksums.json"
SHARD_NAME_FORMAT = "acts{:06d}.bin"
SHARD_NAME_RE = re.compile(r"^acts(\d{6})\.bin$")
DTYPE = "float32"
ITEMSIZE = 4
DEFAULT_BUDGET = 2_400_000
PIXEL_AGGS = ("majority", "prefer-fg")
DEFAULT_PIXEL_AGG = "majority"
SHARDS_ROOT_PARTS = ("saev", "shards")  # 2.1 directories must sit at .../saev/shards/<hash>

# Field names in file order, per protocol.
FIELDS = {
    "2.0": (
        "family",
        "ckpt",
        "layers",
        "patches_per_ex",
        "cls_token",
        "d_model",
        "n_ex",
        "patches_per_shard",
        "data",
        "dataset",
        "dtype",
        "protocol",
    ),
    "2.1": (
        "family",
        "ckpt",
        "layers",
        "content_tokens_per_example",
        "cls_token",
        "d_model",
        "n_examples",
        "max_tokens_per_shard",
        "data",
        "dataset",
        "pixel_agg",
        "dtype",
        "protocol",
    ),
}
# The protocol's name for: content tokens per example, total examples, token budget per shard.
CONTENT_KEY = {"2.0": "patches_per_ex", "2.1": "content_tokens_per_example"}
N_KEY = {"2.0": "n_ex", "2.1": "n_examples"}
BUDGET_KEY = {"2.0": "patches_per_shard", "2.1": "max_tokens_per_shard"}
SHARD_COUNT_KEY = {"2.0": "n_ex", "2.1": "n_examples"}  # the count key of a shards.json entry

FAMILIES = {
    "2.0": ("clip", "siglip", "dinov2"),
    "2.1": ("bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core", "pe-spatial", "siglip"),
}
HASH_RULE = {
    "2.0": "full sha256 of the sorted-keys compact JSON of metadata",
    "2.1": "first 8 hex digits of sha256 of the field-ordered compact JSON of metadata",
}


def metadata_hash(metadata: dict[str, Any], protocol: str) -> str:
    """The directory name of a saev shard directory with this metadata."""
    if protocol == "2.0":
        text = json.dumps(metadata, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
    if protocol == "2.1":
        text = json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
    raise ValueError(f"protocol must be one of {list(PROTOCOLS)}. Got {protocol!r}.")


def metadata_bytes(metadata: dict[str, Any], protocol: str) -> bytes:
    """metadata.json as saev writes it (2.0: json indent 4; 2.1: orjson indent 2, UTF-8)."""
    indent = 4 if protocol == "2.0" else 2
    return json.dumps(metadata, indent=indent, ensure_ascii=protocol == "2.0").encode("utf-8")


def shards_bytes(counts: list[int], protocol: str) -> bytes:
    """shards.json: one {name, n_ex} (2.0) or {name, n_examples} (2.1) entry per shard."""
    key = SHARD_COUNT_KEY[protocol]
    entries = [{"name": SHARD_NAME_FORMAT.format(i), key: int(n)} for i, n in enumerate(counts)]
    return json.dumps(entries, indent=2).encode("utf-8")


@dataclass(frozen=True, kw_only=True)
class ShardGeometry:
    """The shape maths of section 3 of the seed, from the fields of a metadata document."""

    n_examples: int
    n_layers: int
    content_tokens: int
    cls_token: bool
    d_model: int
    budget: int

    @property
    def tokens_per_example(self) -> int:
        return self.content_tokens + int(self.cls_token)

    @property
    def examples_per_shard(self) -> int:
        return self.budget // (self.tokens_per_example * self.n_layers)

    @property
    def n_shards(self) -> int:
        s = self.examples_per_shard
        return -(-self.n_examples // s) if s else 0

    @property
    def shard_shape(self) -> tuple[int, int, int, int]:
        return (self.examples_per_shard, self.n_layers, self.tokens_per_example, self.d_model)

    @property
    def example_nbytes(self) -> int:
        return self.n_layers * self.tokens_per_example * self.d_model * ITEMSIZE

    @property
    def shard_nbytes(self) -> int:
        """Size of every shard file, the last one included (zero-padded to full size)."""
        return self.examples_per_shard * self.example_nbytes

    def shard_counts(self) -> list[int]:
        """Examples in each shard: examples_per_shard each, the remainder in the last."""
        s = self.examples_per_shard
        return [min(s, self.n_examples - i * s) for i in range(self.n_shards)]

    def locate(self, ex: int, layer_idx: int, token: int) -> tuple[int, int]:
        """(shard index, byte offset of the vector) for a coordinate (seed section 4.2)."""
        s, L, T = self.examples_per_shard, self.n_layers, self.tokens_per_example
        shard_idx, ex_in_shard = divmod(ex, s)
        offset_in_vectors = ex_in_shard * L * T + layer_idx * T + token
        return shard_idx, offset_in_vectors * self.d_model * ITEMSIZE


def geometry(metadata: dict[str, Any], protocol: str) -> ShardGeometry:
    """ShardGeometry of a metadata document whose fields were already checked."""
    return ShardGeometry(
        n_examples=metadata[N_KEY[protocol]],
        n_layers=len(metadata["layers"]),
        content_tokens=metadata[CONTENT_KEY[protocol]],
        cls_token=metadata["cls_token"],
        d_model=metadata["d_model"],
        budget=metadata[BUDGET_KEY[protocol]],
    )
