"""A writer shard's append-only record files (text lines, block records, per-row checksums).

A local disk appends in place. An object store has no append: each append is the whole
object put again, so the writer keeps the bytes it wrote (read once, on a resume) instead
of getting the object before every put, and a file created empty is first put by the
commit that needs it: a one-commit shard puts each of these objects once.
"""

from __future__ import annotations

from actstore.storage import KeyNotFound, Storage


class AppendFiles:
    """Append-only files of one shard, written through `storage` (keys relative to the shard)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.whole = storage.local_root is None  # no append in place: objects are put whole
        self._bytes: dict[str, bytes] = {}  # whole: each file's bytes as written (or to be)
        self._unwritten: set[str] = set()

    def create(self, key: str) -> None:
        """An empty file (on an object store, put by the next `write_created`)."""
        if self.whole:
            self._bytes[key] = b""
            self._unwritten.add(key)
        else:
            self.storage.put(key, b"")

    def append(self, key: str, data: bytes) -> int:
        """Append `data`; returns the file's new size."""
        if not self.whole:
            return self.storage.append(key, data)
        old = self._bytes.get(key)
        if old is None:
            try:
                old = self.storage.get(key)
            except KeyNotFound:
                old = b""
        new = old + bytes(data)
        self.storage.put(key, new)
        self._bytes[key] = new
        self._unwritten.discard(key)
        return len(new)

    def forget(self, key: str) -> None:
        """Drop what is known of `key` (it was cut back or deleted by other means)."""
        self._bytes.pop(key, None)
        self._unwritten.discard(key)

    def write_created(self) -> None:
        """Put every file created and not yet written (before the commit record names them)."""
        for key in sorted(self._unwritten):
            self.storage.put(key, self._bytes[key])
        self._unwritten.clear()
