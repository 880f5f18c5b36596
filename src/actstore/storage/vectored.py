"""Vectored reads of an open local file: adjacent ranges gathered into one preadv, and
page-cache-only reads (preadv2 with RWF_NOWAIT). Pure functions of a file descriptor;
LocalStorage opens and checks the file."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16)  # buffers one preadv fills


def preadv_runs(fd: int, ranges: Sequence[tuple[int, memoryview]]) -> tuple[list[int], bool]:
    """Read each (offset, buffer) of `ranges`, each run of adjacent ranges (one ending where
    the next begins, in the order given) in one preadv of several buffers. Returns the bytes
    each buffer got and whether any run came back short (the caller checks the file)."""
    counts: list[int] = []
    short = False
    i = 0
    while i < len(ranges):
        start, first = ranges[i]
        bufs, end = [first], start + len(first)
        j = i + 1
        while j < len(ranges) and ranges[j][0] == end and len(bufs) < IOV_MAX:
            bufs.append(ranges[j][1])
            end += len(ranges[j][1])
            j += 1
        n = os.preadv(fd, bufs, start)
        short = short or n < end - start
        for b in bufs:
            counts.append(min(len(b), max(0, n)))
            n -= len(b)
        i = j
    return counts, short


def pread_cached(fd: int, dest: memoryview, offset: int) -> bool | None:
    """Fill `dest` from `offset` only from the page cache: True when it did, False when the
    data is not cached (or any other failure, which a plain read explains), None when this
    kernel or file system cannot tell (the caller stops asking)."""
    try:
        n = os.preadv(fd, [dest], offset, RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError as e:
        return None if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS) else False
    return n == len(dest)
