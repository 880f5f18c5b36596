"""Where a store's bytes live: the Storage interface and its implementations."""

from __future__ import annotations

import os
import re
from pathlib import Path

from actstore.storage.base import Entry, KeyNotFound, Storage, Writeback
from actstore.storage.local import LocalStorage
from actstore.storage.objectstore import SCHEMES as OBJECT_SCHEMES
from actstore.storage.objectstore import ObjectStorage

__all__ = ["Entry", "KeyNotFound", "LocalStorage", "ObjectStorage", "Storage", "Writeback", "is_url", "open_storage"]


def open_storage(location: str | os.PathLike | Storage) -> Storage:
    """The Storage of a store location: a local path, a `file://` URL, an object-store URL
    (`s3://bucket/prefix`, `gs://...`, `az://...`), or a Storage itself."""
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.startswith("file://"):
        return LocalStorage(Path(text[len("file://") :]))
    if text.startswith(OBJECT_SCHEMES):
        return ObjectStorage(text)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        scheme = text.split("://", 1)[0]
        raise ValueError(
            f"{text}: unknown URL scheme {scheme!r}; a store is a local folder, a file:// URL or an "
            f"object-store URL ({', '.join(s.rstrip(':/') for s in OBJECT_SCHEMES)})"
        )
    return LocalStorage(Path(text))


def is_url(location: str | os.PathLike | Storage) -> bool:
    """Whether `location` names an object store (not the local file system)."""
    return not isinstance(location, Storage) and os.fspath(location).startswith(OBJECT_SCHEMES)
