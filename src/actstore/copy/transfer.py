"""Object transfer for `actstore cp` (actstore.copy): streamed puts, checksums, a bounded pool.

Kept apart from the copy's logic (what to copy, in which order) because it is the part
that belongs in the Storage interface once it grows a streaming put.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actstore.errors import CopyError
from actstore.layout.checksum import crc32c
from actstore.storage import LocalStorage, Storage

STREAM_BYTES = 64 * 2**20  # larger objects are copied range by range, never whole in memory
RANGE_BYTES = 16 * 2**20  # one range of a streamed object


def parallel(pool: ThreadPoolExecutor, workers: int, fn: Callable[[Any], None], items: Iterable[Any]) -> None:
    """fn over items on the pool with at most 2 * workers submitted at a time (so a store of
    millions of objects never holds millions of futures); the first failure is raised once
    the ones in flight have finished; nothing is started after it."""
    slots = threading.Semaphore(2 * workers)
    failures: list[BaseException] = []

    def run(item: Any) -> None:
        if not failures:  # queued behind a failure: skip
            fn(item)

    def done(f) -> None:
        if not f.cancelled() and f.exception() is not None:
            failures.append(f.exception())
        slots.release()

    for item in items:
        slots.acquire()
        if failures:
            slots.release()
            break
        pool.submit(run, item).add_done_callback(done)
    for _ in range(2 * workers):
        slots.acquire()
    if failures:
        raise failures[0]


def stream(s: Storage, d: Storage, key: str, size: int) -> tuple[int, int]:
    """Copy a large object range by range; its (size, crc32c) as read from SRC."""
    crc = 0

    def ranges() -> Iterator[bytes]:
        nonlocal crc
        for start in range(0, size, RANGE_BYTES):
            part = s.get_range(key, start, RANGE_BYTES)
            if len(part) != min(RANGE_BYTES, size - start):
                raise CopyError(f"{s.where(key)} changed size while it was copied; rerun the same command")
            crc = crc32c(part, crc)
            yield part

    put_stream(d, key, ranges())
    return size, crc


def put_stream(d: Storage, key: str, parts: Iterator[bytes]) -> None:
    """An atomic put of an object given as a stream of parts (Storage.put_stream)."""
    d.put_stream(key, parts)


def checksum(st: Storage, key: str) -> tuple[int, int]:
    """(size, crc32c) of an object as stored, read whole or range by range; (-1, 0) if missing."""
    size = st.size(key)
    if size is None:
        return -1, 0
    if size <= STREAM_BYTES:
        data = st.get(key)
        return len(data), crc32c(data)
    crc, n = 0, 0
    while n < size:
        part = st.get_range(key, n, RANGE_BYTES)
        if not part:
            break
        crc, n = crc32c(part, crc), n + len(part)
    return n, crc


def make_folders(d: Storage, prefixes: Iterable[str]) -> None:
    """Create (possibly empty) folders at a local DST; elsewhere nothing (an object store has
    no folders). A writer shard's folders exist even when empty (`text/` of a store without
    texts), which `actstore verify` expects, and which a copy out of object storage lacks."""
    if isinstance(d, LocalStorage):
        for prefix in prefixes:
            os.makedirs(d.path(prefix), exist_ok=True)
