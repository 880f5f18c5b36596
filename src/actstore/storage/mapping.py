"""FileRegion: local files mapped read-only into one reserved address range, seen as rows;
MappedFile: one whole file mapped, for `store[ex, layer]`'s warm reads of a Zarr shard file.

The token stream's one-copy read path. Each file (a chunk file, or a whole Zarr shard
file) gets a slot of a fixed stride in one reserved range of virtual memory, and is
mapped there (`mmap` with MAP_FIXED, read-only, shared: the page cache's own pages, no
copy). The whole range is one numpy array of rows, so a batch is one gather
(`np.take`) straight from the page cache into the batch buffer. Mappings stay from one
epoch to the next (the page tables with them), so a warm epoch costs the gather alone.

Bounds: at most `n_slots` files are mapped, fewer than the kernel's map count allows;
beyond that, or when the bytes made resident through the mappings pass `resident_cap`
(default: the machine's memory), the least recently used unpinned files are unmapped.
Pinned slots (files a window in flight gathers from) are never unmapped.

Linux only (mmap with MAP_FIXED_NOREPLACE-free reservations, madvise POPULATE_READ,
mincore); `FileRegion.supported()` says whether it works here. A file truncated in place
while mapped would fault (SIGBUS) on access: actstore never truncates published data,
sizes are checked before a file is used, and populating a range first turns a short
file into an OSError (EFAULT) instead.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actstore.storage.base import KeyNotFound, Storage

PROT_NONE, PROT_READ = 0, 1
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MADV_WILLNEED, MADV_POPULATE_READ = 3, 22
ADDRESS_BUDGET = 2**40  # virtual address space one region may reserve (1 TiB of the 128 TiB a process has)
MAX_SLOTS = 16384  # mappings per region, well under vm.max_map_count (65530 by default)


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@dataclass
class _Slot:
    index: int
    size: int
    path: str
    pins: int = 0
    populated: set = field(default_factory=set)  # (offset, nbytes) ranges populated through this mapping
    resident_bytes: int = 0


class FileRegion:
    """Up to `n_slots` local files mapped read-only, each at a fixed stride, as one array
    of `row_bytes`-byte rows (`rows`).

    Args:
        row_bytes: bytes of one row (a token vector in the stored dtype).
        file_bytes: the largest file a slot must hold.
        n_slots: files mapped at once, at most (also bounded by the address budget and
            the kernel's map count).
        resident_cap: bytes populated through the mappings before the least recently
            used files are unmapped (default: the machine's memory).

    Raises OSError when the address range cannot be reserved (e.g. under `ulimit -v`).
    """

    @staticmethod
    def supported() -> bool:
        return _LIBC is not None and mmap.PAGESIZE > 0

    def __init__(self, row_bytes: int, file_bytes: int, n_slots: int, *, resident_cap: int | None = None):
        if not self.supported():
            raise OSError(errno.ENOSYS, "file mappings into a reserved range need Linux")
        page = mmap.PAGESIZE
        unit = math.lcm(page, row_bytes)
        self.row_bytes = row_bytes
        self.stride = max(unit, -(-int(file_bytes) // unit) * unit)
        self.rows_per_slot = self.stride // row_bytes
        self.n_slots = max(1, min(int(n_slots), ADDRESS_BUDGET // self.stride, MAX_SLOTS, _max_map_count() // 4))
        self.resident_cap = physical_memory() if resident_cap is None else int(resident_cap)
        self.nbytes = self.n_slots * self.stride
        base = _LIBC.mmap(None, self.nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, _FAILED):
            e = ctypes.get_errno()
            raise OSError(e, f"cannot reserve {self.nbytes} bytes of address space: {os.strerror(e)}")
        self.base = base
        self.pid = os.getpid()
        # The whole range as rows; every row read lies in a mapped slot.
        self._view = (ctypes.c_char * self.nbytes).from_address(base)
        self.rows = np.frombuffer(self._view, dtype=np.dtype((np.void, row_bytes)))
        self._lock = threading.Lock()
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # path -> slot, least recently used first
        self._by_index: list[_Slot | None] = [None] * self.n_slots
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._gen = [0] * self.n_slots  # per slot: how many times a file left it
        self._vec = ctypes.create_string_buffer(1)  # mincore's answer (reader thread only)
        self._resident = 0
        # unit id -> (chunks, their slots' generations): where each unit lay when last
        # mapped (kept by the loaders from epoch to epoch, checked against `generation`).
        self.known_units: dict[int, tuple[list, list[int]]] = {}

    def __getstate__(self) -> dict:
        raise TypeError("a FileRegion holds this process's mappings and cannot be pickled")

    # ---- slots ------------------------------------------------------------------------
    def open(self, storage: Storage, key: str) -> tuple[int, int] | None:
        """Map the file `key` of a local storage (if not mapped already) and pin it: its
        (slot, size in bytes); None when no file is there. A file larger than a slot is
        not mapped: (-1, size). Release each successful pin with `unpin`."""
        path = storage.where(key)
        with self._lock:
            slot = self._slots.get(path)
            if slot is not None:
                self._slots.move_to_end(path)
                slot.pins += 1
                return slot.index, slot.size
        try:
            fd = storage.open_regular(key)  # the local storage's own checks: no links, regular files only
        except KeyNotFound:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > self.stride:
                return -1, size
            with self._lock:
                slot = self._slots.get(path)
                if slot is not None:  # mapped meanwhile by another thread
                    slot.pins += 1
                    return slot.index, slot.size
                index = self._take_slot()
                if index is None:
                    return -1, size
                if size:
                    addr = self.base + index * self.stride
                    if _LIBC.mmap(addr, size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0) != addr:
                        e = ctypes.get_errno()
                        self._free.append(index)
                        raise OSError(e, f"cannot map {path}: {os.strerror(e)}")
                self._slots[path] = self._by_index[index] = _Slot(index, size, path, pins=1)
                return index, size
        finally:
            os.close(fd)

    def generation(self, slot: int) -> int:
        """Changes whenever the file in `slot` is unmapped: rows remembered with it are stale."""
        return self._gen[slot]

    def repin(self, slots: list[int], gens: list[int]) -> bool:
        """Pin `slots` again if each still holds the file it held at generation `gens`."""
        with self._lock:
            if any(self._gen[i] != g or self._by_index[i] is None for i, g in zip(slots, gens)):
                return False
            for i in slots:
                s = self._by_index[i]
                s.pins += 1
                self._slots.move_to_end(s.path)
            return True

    def unpin(self, slots: Any) -> None:
        """Release one pin of each slot in `slots` (from `open`)."""
        with self._lock:
            for i in slots:
                s = self._by_index[int(i)]
                if s is not None and s.pins > 0:
                    s.pins -= 1
            self._trim()

    def _take_slot(self) -> int | None:
        """A free slot, unmapping the least recently used unpinned file if none is (lock held)."""
        if not self._free:
            for path, s in self._slots.items():
                if s.pins == 0:
                    self._release(path)
                    break
        return self._free.pop() if self._free else None

    def _trim(self) -> None:
        """Unmap least recently used unpinned files while too much is resident (lock held)."""
        if self._resident <= self.resident_cap:
            return
        for path in [p for p, s in self._slots.items() if s.pins == 0]:
            if self._resident <= self.resident_cap:
                break
            self._release(path)

    def _release(self, path: str) -> None:
        s = self._slots.pop(path)
        self._by_index[s.index] = None
        self._gen[s.index] += 1
        addr = self.base + s.index * self.stride
        # Replace the file mapping by reserved, inaccessible memory (the range stays ours).
        _LIBC.mmap(addr, self.stride, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        self._resident -= s.resident_bytes
        self._free.append(s.index)

    def path_of(self, slot: int) -> str:
        """The file mapped in `slot` (for messages)."""
        s = self._by_index[slot] if 0 <= slot < len(self._by_index) else None
        return s.path if s is not None else f"<slot {slot}>"

    def first_row(self, slot: int, offset: int) -> int:
        """The row of `rows` at byte `offset` of the file in `slot` (offset % row_bytes == 0)."""
        return slot * self.rows_per_slot + offset // self.row_bytes

    # ---- residency ----------------------------------------------------------------------
    def to_populate(self, ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Those of `ranges` (slot, offset, nbytes) to populate before a gather: never
        populated through this mapping, or with pages that left the page cache (mincore,
        about 2 us a range)."""
        todo = []
        vec = self._vec
        for r in ranges:
            s = self._by_index[r[0]]
            if s is None or (r[1], r[2]) not in s.populated:
                todo.append(r)
                continue
            lo, hi = self._page_span(*r)
            n = (hi - lo) // mmap.PAGESIZE
            if n > len(vec):
                vec = self._vec = ctypes.create_string_buffer(n)
            # A resident page reads 1 (the other bits are reserved, 0); any 0 byte: not all resident.
            if _LIBC.mincore(lo, hi - lo, vec) != 0 or vec.raw.find(0, 0, n) >= 0:
                todo.append(r)
        return todo

    def populate(self, slot: int, offset: int, nbytes: int) -> None:
        """Read a range into the page cache and map its pages (on the calling thread,
        without the GIL); OSError on a short file (EFAULT) or a read error (EIO)."""
        lo, hi = self._page_span(slot, offset, nbytes)
        _LIBC.madvise(lo, hi - lo, MADV_WILLNEED)  # one readahead of the whole range
        if _LIBC.madvise(lo, hi - lo, MADV_POPULATE_READ) != 0:
            e = ctypes.get_errno()
            if e != errno.EINVAL:  # EINVAL: a kernel before 5.14 (the gather faults the pages in itself)
                raise OSError(e, os.strerror(e))
        with self._lock:
            s = self._by_index[slot]
            if s is not None and (offset, nbytes) not in s.populated:
                s.populated.add((offset, nbytes))
                s.resident_bytes += nbytes
                self._resident += nbytes

    def _page_span(self, slot: int, offset: int, nbytes: int) -> tuple[int, int]:
        page = mmap.PAGESIZE
        start = self.base + slot * self.stride + offset
        return start - start % page, -(-(start + nbytes) // page) * page

    # ---- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Unmap everything (in the process that mapped it; a forked child only forgets)."""
        base, self.base = getattr(self, "base", None), None
        self.rows = None
        if base is not None and self.pid == os.getpid():
            _LIBC.munmap(base, self.nbytes)
        self._slots = OrderedDict()
        self._by_index = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "mapped": len(self._slots),
                "slots": self.n_slots,
                "resident_bytes": self._resident,
                "pinned": sum(1 for s in self._slots.values() if s.pins),
            }


class MappedFile:
    """A whole local file mapped read-only and shared (the page cache's own pages, no
    copy), for readers that copy many small ranges of one large file (Zarr shard files).

    `copy_resident` copies a range only when every page of it is in the page cache
    (mincore, about 2 us): a range that would wait for the disk is left to a read (one
    request for the whole range instead of a fault page by page), and so is a range past
    the end of a file truncated since it was mapped (its pages have left the page cache):
    the read reports the damage where touching the mapping would fault (SIGBUS).
    """

    def __init__(self, mm: mmap.mmap):
        self.size = len(mm)
        self.bytes = np.frombuffer(mm, np.uint8)  # holds the mapping
        self._addr = self.bytes.ctypes.data

    @staticmethod
    def supported() -> bool:
        return _LIBC is not None

    @classmethod
    def map(cls, fd: int, size: int) -> MappedFile | None:
        """Map `size` bytes of the open file `fd`; None when this process already holds
        MAX_MAPPED_FILES of them (readers keep theirs until they drop them: the rest read)."""
        global _mapped_files
        with _mapped_lock:
            if _mapped_files >= MAX_MAPPED_FILES:
                return None
            _mapped_files += 1
        try:
            f = cls(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
        except BaseException:
            _unmapped()
            raise
        weakref.finalize(f, _unmapped)  # the mapping goes with its last reference
        return f

    def copy_resident(self, offset: int, dest: np.ndarray) -> bool:
        """Copy bytes offset.. into `dest` (uint8, 1-d) when every page holding them is
        resident; False (nothing copied) otherwise."""
        n = dest.shape[0]
        end = offset + n
        if offset < 0 or end > self.size:
            return False
        lo = offset - offset % mmap.PAGESIZE
        pages = -(-(end - lo) // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)  # one per call: readers may share the file across threads
        # A resident page reads 1 (the other bits are reserved, 0); any 0 byte: not all resident.
        if _LIBC.mincore(self._addr + lo, end - lo, vec) != 0 or vec.raw.find(0, 0, pages) >= 0:
            return False
        dest[:] = self.bytes[offset:end]
        return True


# Whole files mapped by MappedFile in this process, at most: far below the kernel's map
# count (vm.max_map_count, 65,530 by default), which every other mapping shares.
MAX_MAPPED_FILES = 1024
_mapped_files = 0
_mapped_lock = threading.Lock()


def _unmapped() -> None:
    global _mapped_files
    with _mapped_lock:
        _mapped_files -= 1
