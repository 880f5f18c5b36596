"""metadata.json of a legacy pkl.gz directory: parsed and validated field by field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from actstore.errors import LegacyFormatError

METADATA_FILE = "metadata.json"
SHARD_NAME_FORMAT = "shard_{:04d}.pkl.gz"
SUPPORTED_MAJOR = "1"
_SHA256_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
MAX_COUNT = 2**40  # counts beyond this are refused before anything is allocated


@dataclass(frozen=True, kw_only=True)
class LegacyShardInfo:
    shard_id: int
    filename: str
    size_bytes: int | None
    num_samples: int
    layers: tuple[int, ...]
    sample_id_range: tuple[int, int] | None
    compressed: bool
    sha256: str | None


@dataclass(frozen=True, kw_only=True)
class LegacyMetadata:
    version: str
    created_at: str | None
    extraction_config: dict[str, Any]
    distributed_config: dict[str, Any] | None
    statistics: dict[str, Any]
    shards: tuple[LegacyShardInfo, ...]
    layers: tuple[int, ...]
    hidden_size: int | None
    max_seq_length: int | None
    model_name: str | None


def _count(v: Any, what: str, where: str, *, positive: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < (1 if positive else 0) or v > MAX_COUNT:
        kind = "positive" if positive else "non-negative"
        raise LegacyFormatError(f"{where}: {what} must be a {kind} int (at most {MAX_COUNT}). Got {v!r}.")
    return v


def _layers(v: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not v:
        raise LegacyFormatError(f"{where}: {what} must be a non-empty list of layer indices. Got {v!r}.")
    layers = tuple(_count(x, f"{what} entry", where) for x in v)
    if len(set(layers)) != len(layers):
        raise LegacyFormatError(f"{where}: {what} lists a layer twice: {list(layers)}")
    return layers


def _optional_count(d: dict[str, Any], key: str, where: str) -> int | None:
    return None if d.get(key) is None else _count(d[key], key, where, positive=True)


def parse_shard_info(s: Any, where: str) -> LegacyShardInfo:
    if not isinstance(s, dict):
        raise LegacyFormatError(f"{where}: each entry of shards must be an object. Got {s!r}.")
    missing = [k for k in ("shard_id", "filename", "num_samples", "layers") if k not in s]
    if missing:
        raise LegacyFormatError(f"{where}: shard entry lacks fields {missing}: {str(s)[:200]}")
    fname = s["filename"]
    if not isinstance(fname, str) or not fname:
        raise LegacyFormatError(f"{where}: shard filename must be a non-empty string. Got {fname!r}.")
    rng = s.get("sample_id_range")
    if rng is not None:
        if not isinstance(rng, list) or len(rng) != 2:
            raise LegacyFormatError(f"{where}: sample_id_range of {fname} must be [first, last]. Got {rng!r}.")
        rng = (_count(rng[0], "sample_id_range", where), _count(rng[1], "sample_id_range", where))
    checksum = s.get("checksum")
    sha = None
    if checksum is not None:
        m = _SHA256_RE.match(checksum) if isinstance(checksum, str) else None
        if m is None:
            raise LegacyFormatError(f"{where}: checksum of {fname} must be 'sha256:<64 hex digits>'. Got {checksum!r}.")
        sha = m.group(1)
    compressed = s.get("compressed", fname.endswith(".gz"))
    if not isinstance(compressed, bool):
        raise LegacyFormatError(f"{where}: compressed of {fname} must be true or false. Got {compressed!r}.")
    size = s.get("size_bytes")
    return LegacyShardInfo(
        shard_id=_count(s["shard_id"], "shard_id", where),
        filename=fname,
        size_bytes=None if size is None else _count(size, "size_bytes", where),
        num_samples=_count(s["num_samples"], "num_samples", where),
        layers=_layers(s["layers"], f"layers of {fname}", where),
        sample_id_range=rng,
        compressed=compressed,
        sha256=sha,
    )


def parse_metadata(doc: Any, where: str = METADATA_FILE) -> LegacyMetadata:
    """Validate a legacy metadata.json document; every problem is a LegacyFormatError."""
    if not isinstance(doc, dict):
        raise LegacyFormatError(f"{where} must hold a JSON object. Got {type(doc).__name__}.")
    missing = [k for k in ("version", "extraction_config", "shards") if k not in doc]
    if missing:
        raise LegacyFormatError(
            f"{where} lacks required fields {missing}; is this a legacy pkl.gz activation directory?"
        )
    version = doc["version"]
    if not isinstance(version, str) or version.split(".")[0] != SUPPORTED_MAJOR:
        raise LegacyFormatError(
            f"{where} has version {version!r}; actstore imports the legacy format version {SUPPORTED_MAJOR}.x"
        )
    cfg = doc["extraction_config"]
    if not isinstance(cfg, dict):
        raise LegacyFormatError(f"{where}: extraction_config must be an object. Got {cfg!r}.")
    params = cfg.get("model_params") or {}
    if not isinstance(params, dict):
        raise LegacyFormatError(f"{where}: extraction_config.model_params must be an object. Got {params!r}.")
    shards_raw = doc["shards"]
    if not isinstance(shards_raw, list) or not shards_raw:
        raise LegacyFormatError(f"{where}: shards must be a non-empty list")
    shards = tuple(parse_shard_info(s, where) for s in shards_raw)
    names = [s.filename for s in shards]
    if len(set(names)) != len(names):
        raise LegacyFormatError(f"{where}: a shard filename is listed twice")
    if cfg.get("layers_extracted") is not None:
        layers = _layers(cfg["layers_extracted"], "extraction_config.layers_extracted", where)
    else:
        layers = shards[0].layers
    for s in shards:
        if set(s.layers) != set(layers):
            raise LegacyFormatError(
                f"{where}: shard {s.filename} holds layers {list(s.layers)} but the store needs every layer "
                f"{list(layers)} for every example; import the shards with the same layers separately"
            )
    model = cfg.get("model_name")
    for key, d in (("distributed_config", doc.get("distributed_config")), ("statistics", doc.get("statistics"))):
        if d is not None and not isinstance(d, dict):
            raise LegacyFormatError(f"{where}: {key} must be an object. Got {d!r}.")
    created = doc.get("created_at")
    return LegacyMetadata(
        version=version,
        created_at=created if isinstance(created, str) else None,
        extraction_config=cfg,
        distributed_config=doc.get("distributed_config"),
        statistics=doc.get("statistics") or {},
        shards=shards,
        layers=layers,
        hidden_size=_optional_count(params, "hidden_size", where),
        max_seq_length=_optional_count(cfg, "max_seq_length", where),
        model_name=model if isinstance(model, str) else None,
    )
