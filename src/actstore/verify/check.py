"""The verifier's state: the store's storage, one listing of it, the report being built, and
the shard being checked."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from actstore import catalog
from actstore.errors import ActstoreError
from actstore.layout import keys, spec
from actstore.layout.chunks import parse_chunk_key
from actstore.layout.config import StoreConfig
from actstore.layout.records import Commit
from actstore.layout.spool import Ranges
from actstore.storage import Entry, Storage
from actstore.verify.report import ERROR, WARNING, Problem, VerifyReport

MAX_LISTED = 50  # problems of one kind listed per shard; the rest are counted in one line


class Listing:
    """Every key of the store, listed once (kinds: file, dir, link, other), sorted, so that
    the keys below a folder are one contiguous range found by bisection: a query costs
    O(log n + its answer), and checking every shard of a store stays linear in its keys."""

    def __init__(self, storage: Storage):
        self.entries: dict[str, Entry] = {e.key: e for e in storage.list()}
        self._keys = sorted(self.entries)

    def kind(self, key: str) -> str | None:
        e = self.entries.get(key)
        if e is not None:
            return e.kind
        lo, hi = self._range(key)
        return "dir" if lo < hi else None

    def size(self, key: str) -> int | None:
        e = self.entries.get(key)
        return e.size if e is not None and e.kind == "file" else None

    def _range(self, prefix: str) -> tuple[int, int]:
        """The index range of the sorted keys below the folder `prefix`."""
        if not prefix:
            return 0, len(self._keys)
        head = prefix.rstrip("/") + "/"
        # every key that starts with head sorts between head and head + U+10FFFF
        return bisect_left(self._keys, head), bisect_left(self._keys, head + "\U0010ffff")

    def under(self, prefix: str) -> list[Entry]:
        """Entries below the folder `prefix` (recursively), in key order."""
        lo, hi = self._range(prefix)
        return [self.entries[k] for k in self._keys[lo:hi]]

    def children(self, prefix: str) -> dict[str, str]:
        """{name: kind} directly under the folder `prefix` (a sub-folder is "dir")."""
        head = prefix.rstrip("/") + "/" if prefix else ""
        lo, hi = self._range(prefix)
        out: dict[str, str] = {}
        for k in self._keys[lo:hi]:
            name, sep, _ = k[len(head) :].partition("/")
            out[name] = "dir" if sep else self.entries[k].kind
        return out


@dataclass(frozen=True, kw_only=True)
class ShardCtx:
    """The writer shard being checked and the counts its checks go by."""

    name: str
    prefix: str  # the shard's key prefix in the store
    storage: Storage  # keys relative to the shard
    shard: int
    start: int | None  # its first global example; None before finalize
    n: int  # examples published (or committed, before finalize)
    rec: Commit | None
    removed: Ranges = ()  # examples whose activation files a spool removed (not looked for)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if rel else self.prefix

    @property
    def complete(self) -> bool:
        """Whether the shard's writer closed it with exactly the examples checked (its last
        commit set every array's shape to them)."""
        return self.rec is not None and self.rec.complete and self.rec.n_committed == self.n

    def global_index(self, local: int) -> int | None:
        return None if self.start is None else self.start + local

    def example_name(self, local: int) -> str:
        """How a problem names an example: its global index, or its local index before finalize."""
        g = self.global_index(local)
        return str(g) if g is not None else f"local {local} of shard {self.shard}"


class Checker:
    """One verification run over one store; problems are added as they are found."""

    def __init__(self, storage: Storage, deep: bool, progress: Callable[[int], None] | None):
        self.storage = storage
        self.deep = deep
        self.progress = progress
        self.report = VerifyReport(path=storage.url, deep=deep)
        self.listing = Listing(storage)
        self._counts: dict[tuple[Any, str], int] = {}
        self.cfg: StoreConfig | None = None
        self.removed: dict[int, Ranges] = {}  # a spool's removed examples by shard (actstore.spoolstate)

    def add(self, severity: str, kind: str, message: str, key: str | None = None, **where: Any) -> None:
        c = (where.get("shard"), kind)
        self._counts[c] = self._counts.get(c, 0) + 1
        if self._counts[c] <= MAX_LISTED:
            self.report.problems.append(Problem(severity=severity, kind=kind, message=message, path=key, **where))

    def flush_counts(self, shard: int) -> None:
        for (s, kind), n in list(self._counts.items()):
            if s == shard and n > MAX_LISTED:
                sev = next(p.severity for p in self.report.problems if p.shard == shard and p.kind == kind)
                self.report.problems.append(
                    Problem(
                        severity=sev,
                        kind=kind,
                        shard=shard,
                        message=f"... and {n - MAX_LISTED} more {kind} problems in this shard",
                    )
                )

    def odd_entry(self, key: str, kind: str | None, shard: int | None, **where: Any) -> bool:
        """Report a link, FIFO, socket or device at `key` (a store holds only regular files
        and folders); True when there was one. `where` names the example, layer, segment."""
        if kind == "link":
            self.symlink(key, shard, **where)
            return True
        if kind == "other":
            self.add(
                ERROR,
                "not-a-file",
                f"{key} is a FIFO, socket or device; a store holds only regular files and folders (readers refuse it)",
                key,
                shard=shard,
                **where,
            )
            return True
        return False

    def not_a_chunk_file(self, key: str, kind: str | None, shard: int | None, **where: Any) -> bool:
        """odd_entry, and a folder where a chunk file belongs (reported); True when either."""
        if kind == "dir":
            self.add(
                ERROR,
                "not-a-file",
                f"{key} is a folder where the array has a chunk file (readers refuse it)",
                key,
                shard=shard,
                **where,
            )
            return True
        return self.odd_entry(key, kind, shard, **where)

    def not_a_file(self, key: str, kind: str | None, shard: int | None) -> bool:
        """Report whatever stands at `key` where the format has a regular file (a folder, a
        link, ...); True when something other than a file is there."""
        if kind in (None, "file") or self.odd_entry(key, kind, shard):
            return kind not in (None, "file")
        self.add(
            ERROR,
            "not-a-file",
            f"{key} is a folder where the store has the file {keys.basename(key)} (readers refuse it)",
            key,
            shard=shard,
        )
        return True

    def symlink(self, key: str, shard: int | None, **where: Any) -> None:
        """Any link is reported: an error if it leaves the store, else a warning."""
        target, inside = self.storage.link_target(key) or (key, False)
        if not inside:
            self.add(
                ERROR,
                "symlink",
                f"{key} is a symbolic link to {target}, outside the store; readers refuse it",
                key,
                shard=shard,
                **where,
            )
        else:
            self.add(
                WARNING,
                "symlink",
                f"{key} is a symbolic link; actstore never writes links (chunk reads refuse them)",
                key,
                shard=shard,
                **where,
            )


def attrs_problem(ctx: ShardCtx, array: str, meta: dict[str, Any], cfg: StoreConfig) -> str | None:
    """What is wrong with an array's attributes (unreadable, or an activation array's
    `actstore_dtype` other than the store's dtype: it says how the stored bits are read)."""
    try:
        attrs = catalog.array_attrs(ctx.storage, array, meta)
    except ActstoreError as e:
        return str(e)
    got = attrs.get("actstore_dtype", cfg.dtype)
    if array.endswith(spec.ACTS_SUFFIX) and got != cfg.dtype:
        return f"attribute actstore_dtype {got!r}; the store config says {cfg.dtype!r} (it decides how the stored bits are read)"
    return None


def array_entries(
    listing: Listing, akey: str, fmt: int, sep: str, ndim: int
) -> Iterator[tuple[str, tuple[int, ...] | None, Entry]]:
    """(key relative to the array, chunk grid coordinates or None, entry) of everything in
    an array's folder but its Zarr metadata. A folder standing at a chunk's key (empty or
    not) comes once, as an entry of kind "dir"; other folders are left out."""
    head = akey + "/"
    folders: set[str] = set()
    for entry in listing.under(akey):
        rel = entry.key[len(head) :]
        if rel in keys.ZARR_NAMES:
            continue
        coords = parse_chunk_key(rel, fmt, sep, ndim)
        if coords is not None and entry.kind != "dir":
            yield rel, coords, entry
            continue
        folder = rel if coords is not None else _chunk_folder(rel, fmt, sep, ndim)
        if folder is not None and folder not in folders:
            folders.add(folder)
            yield folder, parse_chunk_key(folder, fmt, sep, ndim), Entry(head + folder, 0, "dir")
        elif folder is None and entry.kind != "dir":
            yield rel, None, entry


def _chunk_folder(rel: str, fmt: int, sep: str, ndim: int) -> str | None:
    """The chunk key that a path inside the array lies below (a folder at a chunk's key)."""
    parts = rel.split("/")
    for i in range(len(parts) - 1, 0, -1):
        prefix = "/".join(parts[:i])
        if parse_chunk_key(prefix, fmt, sep, ndim) is not None:
            return prefix
    return None
