"""The files of a local import source, read only inside its folder.

An import reads another tool's folder (a dictionary_learning cache, a SAELens dataset, an
Activault hook). A symbolic link in it may lead anywhere (a key file, another user's data),
and the import would copy what it reads into the store byte for byte. So a file of a local
source is read only when it is a regular file inside the folder: a link whose target lies
inside is followed, one leading out is refused with that reason, and a FIFO, socket,
device or folder where a file belongs is named.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from actstore.errors import ImportSourceError
from actstore.storage.regular import describe, open_regular


def local_file(storage: Any, key: str, url: str, error: type[ImportSourceError] = ImportSourceError) -> Path:
    """The path to read file `key` of a local source folder (`storage`, named `url`): the
    file itself, or the target of a link that stays inside the folder."""
    where = f"{url}/{key}"
    path = storage.local_root / key
    kind = storage.kind(key)
    if kind is None:
        raise error(f"{where} is missing")
    if kind == "link":
        target, inside = storage.link_target(key)
        if not inside:
            raise error(
                f"{where} is a symbolic link to {target}, outside the source folder {url}: an import reads only "
                "files inside its source folder (copy the file in instead of linking to it)"
            )
        path = Path(target)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise error(f"{where} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{where} is {describe(mode)} where a data file belongs")
    return path


def local_size(storage: Any, key: str, url: str, error: type[ImportSourceError] = ImportSourceError) -> int:
    """Bytes of file `key` of a local source folder, as local_file reads it."""
    return local_file(storage, key, url, error).stat().st_size


def read_bytes(
    storage: Any, key: str, url: str, max_bytes: int, error: type[ImportSourceError] = ImportSourceError
) -> bytes:
    """The bytes of a small file of a source folder (local: as local_file reads it), at most
    `max_bytes`; KeyNotFound when it is missing."""
    if storage.local_root is None or storage.kind(key) != "link":
        return storage.get(key, max_bytes=max_bytes)
    path = local_file(storage, key, url, error)
    fd = open_regular(str(path), error=error, hint="replace it with the source's file")
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{url}/{key} cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise error(f"{url}/{key} has more than the {max_bytes} bytes allowed for it")
    return data
