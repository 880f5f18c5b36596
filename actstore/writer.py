"""Transitional: the old module path of ShardWriter, and helpers the old verify.py uses."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from actstore import catalog
from actstore.layout import keys, spec
from actstore.layout.config import StoreConfig
from actstore.storage import LocalStorage, open_storage
from actstore.write import ShardWriter, claim_store  # noqa: F401

EL_CRC_FILE = spec.EL_CRC_FILE


def shard_dir(root: str | os.PathLike, shard: int) -> Path:
    return Path(root) / keys.shard_prefix(shard)


def read_identity(root: Any) -> StoreConfig:
    return catalog.read_identity(open_storage(root))


def _read_commit(shard_path: Any) -> dict[str, Any]:
    return asdict(catalog.read_commit(LocalStorage(shard_path)))
