"""The storage interface: every byte of a store is read and written through a `Storage`.

A key is a '/'-separated path relative to the store's root (`shards/shard-00000.zarr/
meta/commit.json`). The interface is what an object store offers (whole-object puts,
create-only puts, range reads, listing by prefix), plus the few operations a local disk
does better (appends, in-place writes, durability); an object-store implementation gives
those the same meaning with the means it has (e.g. append = read + put of the whole
object, sync = nothing, since a finished put is durable).

Errors: a missing key raises `KeyNotFound` (a FileNotFoundError); every other failure is
the implementation's OSError (or the project's own error, e.g. UnsafePathError).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actstore.errors import KeyNotFound


@dataclass(frozen=True)
class Entry:
    """One listed key. `kind` is "file" for an object or regular file; a local disk also
    reports "dir" (an empty folder), "link" (a symbolic link, never followed) and "other"
    (a FIFO, socket or device), which a store never holds legitimately."""

    key: str
    size: int
    kind: str = "file"


class Writeback(abc.ABC):
    """Optional helper an implementation may accept to finish a write on another thread."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Storage(abc.ABC):
    """The bytes of one store, by key.

    Attributes:
        url: the store's location as the user gave it (a path or a URL), for messages.
        local_root: the root folder when the store is on a local file system, else None.
    """

    url: str
    local_root: Path | None = None
    coalesce_bytes = 0  # read_ranges_into fetches ranges closer than this with one request (object stores)
    keeps_ranges = False  # what is read is kept by byte range (a local cache): read ranges, not whole objects

    # ---- naming ---------------------------------------------------------------------
    def where(self, key: str) -> str:
        """The full path or URL of `key`, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def child(self, prefix: str) -> Storage:
        """A Storage whose keys are relative to `prefix` (a sub-folder of this one)."""
        raise NotImplementedError

    # ---- reads ----------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object. With `max_bytes`, an object larger than that raises
        ValueError before it is read (a bound for metadata that could be hostile)."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start` (fewer at the end of the object)."""

    @abc.abstractmethod
    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> int:
        """Read up to len(dest) bytes at `offset` into `dest`; returns the count read."""

    def read_ranges_into(self, key: str, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Several `read_into` of one object at once: each (offset, dest) filled with up to
        len(dest) bytes from offset; returns the counts read. An object store issues them
        together (adjacent ranges coalesced into one request); here, one after another."""
        return [self.read_into(key, dest, offset) for offset, dest in ranges]

    @abc.abstractmethod
    def read_object_into(self, key: str, dest: memoryview) -> int | None:
        """Fill `dest` with the start of a whole object; returns the object's size (so a
        caller can tell an object of the wrong size), or None when there is none."""

    def read_object(self, key: str, *, max_bytes: int) -> memoryview | None:
        """The whole object as a read-only buffer (the response itself, not a copy, where
        the storage can), or None when there is none; ValueError when it is larger than
        `max_bytes` (nothing read)."""
        if (size := self.size(key)) is None:
            return None
        if size > max_bytes:
            raise ValueError(f"{self.where(key)} has {size} bytes, more than the {max_bytes} expected")
        try:
            return memoryview(self.get(key, max_bytes=max_bytes))
        except KeyNotFound:
            return None

    def read_cached(self, key: str, dest: memoryview, offset: int = 0) -> bool:
        """read_into only when it cannot wait for a device or network (a page-cache or
        local-cache hit); False (dest partly written or not) otherwise. Default: False."""
        return False

    def map_file(self, key: str) -> Any:
        """The whole regular file `key` mapped read-only (actstore.storage.mapping.MappedFile),
        for readers that copy many small ranges of one large file (Zarr shard files); None
        where the storage cannot map it (the default: not a local file, absent, empty). Its
        `size` is the file's when mapped: a caller checks its ranges against it."""
        return None

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when there is none."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def kind(self, key: str) -> str | None:
        """What stands at `key`: "file", or on a local disk also "dir", "link", "other";
        None when nothing does."""
        return "file" if self.size(key) is not None else None

    def link_target(self, key: str) -> tuple[str, bool] | None:
        """Where the symbolic link at `key` finally leads (a full path) and whether that lies
        inside the store; None when no link stands there (object stores hold none)."""
        return None

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[Entry]:
        """Every key under `prefix` (a folder: "" for the whole store), recursively, in
        no particular order. Keys whose last part begins with '.' are temporary files of
        unfinished writes and are listed too (callers decide)."""

    def stored_bytes(self, prefix: str = "") -> int:
        """Bytes the objects under `prefix` take in the storage."""
        return sum(e.size for e in self.list(prefix))

    @abc.abstractmethod
    def list_dir(self, prefix: str = "") -> list[str]:
        """Names directly under the folder `prefix` (objects and sub-folders), sorted."""

    # ---- writes ---------------------------------------------------------------------
    @abc.abstractmethod
    def put(
        self, key: str, *parts: Any, atomic: bool = True, durable: bool = False, writeback: Writeback | None = None
    ) -> None:
        """Write the concatenation of `parts` (bytes-like) as the whole object `key`; the
        parts are read, never copied whole (an object store uploads a large object in
        parts). Background writes are the writer's job (actstore.write.pipeline).

        atomic: readers see the old object or the new one, never a part (local: a
            temporary file renamed into place). With atomic=False a local disk writes in
            place, for objects nobody reads until a later commit names them.
        durable: the object (and its name) survive a power loss when put returns.
        writeback: an implementation-specific helper that finishes the write elsewhere.
        """

    def put_stream(self, key: str, parts: Iterator[bytes]) -> None:
        """An atomic put of an object given as a stream of parts, each held only while it
        is written (large objects: a multipart upload, or a temporary file renamed)."""
        buf = bytearray()
        for part in parts:
            buf += part
        self.put(key, buf)

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` with `data` only if no object is there; False if one was. Two
        writers racing can never both succeed, and nobody sees a partial object. Make
        `data` unique to the caller (e.g. name the writer): an object store recognises a
        create whose first try succeeded but whose answer was lost by its bytes."""

    @abc.abstractmethod
    def append(self, key: str, data: bytes) -> int:
        """Append to an object (created empty if missing); returns its new size. Only one
        writer appends to a key (a shard's files belong to its one writer)."""

    @abc.abstractmethod
    def truncate(self, key: str, size: int) -> None:
        """Cut an object to its first `size` bytes (dropping an uncommitted tail)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error."""

    def delete_many(self, keys: list[str]) -> None:
        """Remove objects (an object store: in batched requests); missing ones are not errors."""
        for key in keys:
            self.delete(key)

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under the folder `prefix`."""

    @abc.abstractmethod
    def sync(self, prefix: str = "") -> None:
        """The durability step: everything written so far under `prefix` survives a power
        loss when this returns (local: syncfs; object stores: finished puts already do)."""

    def track_writes(self) -> None:
        """Remember what this storage writes from now on, for `sync_written` (local disks)."""

    def mark_written(self, key: str) -> None:
        """Note `key` as written by someone else (zarr-python's own store) for `sync_written`."""

    def sync_written(self) -> None:
        """The durability step of a group commit: what was written through this storage (and
        marked) since the last call survives a power loss when this returns; the default is `sync`."""
        self.sync()

    # ---- access -------------------------------------------------------------------
    def check_access(self, *, write: bool) -> None:
        """Raise StorageAccessError (naming the location and the cause) when the store
        cannot be read or, with write, written; meant to run before hours of work."""

    # ---- zarr -----------------------------------------------------------------------
    @abc.abstractmethod
    def zarr_store(self, prefix: str, *, read_only: bool) -> Any:
        """A zarr.abc.store.Store over the folder `prefix`, for zarr-python I/O."""

    def writeback(self) -> Writeback | None:
        """A helper that finishes puts on another thread, where the implementation has one."""
        return None
