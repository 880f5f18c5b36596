"""The verifier's state: the store's storage, one listing of it, the report being built."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from actstore.layout.config import StoreConfig
from actstore.storage import Entry, Storage
from actstore.verify.report import ERROR, WARNING, Problem, VerifyReport

MAX_LISTED = 50  # problems of one kind listed per shard; the rest are counted in one line


class Listing:
    """Every key of the store, listed once (kinds: file, dir, link, other)."""

    def __init__(self, storage: Storage):
        self.entries: dict[str, Entry] = {e.key: e for e in storage.list()}
        self._children: dict[str, list[Entry]] | None = None

    def kind(self, key: str) -> str | None:
        e = self.entries.get(key)
        if e is not None:
            return e.kind
        return "dir" if self.under(key) else None

    def size(self, key: str) -> int | None:
        e = self.entries.get(key)
        return e.size if e is not None and e.kind == "file" else None

    def under(self, prefix: str) -> list[Entry]:
        """Entries below the folder `prefix` (recursively)."""
        head = prefix.rstrip("/") + "/" if prefix else ""
        return [e for k, e in self.entries.items() if k.startswith(head)]

    def children(self, prefix: str) -> dict[str, str]:
        """{name: kind} directly under the folder `prefix` (a sub-folder is "dir")."""
        head = prefix.rstrip("/") + "/" if prefix else ""
        out: dict[str, str] = {}
        for k, e in self.entries.items():
            if k.startswith(head):
                rest = k[len(head):]
                name, sep, _ = rest.partition("/")
                out[name] = "dir" if sep else e.kind
        return out


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
                    Problem(severity=sev, kind=kind, shard=shard, message=f"... and {n - MAX_LISTED} more {kind} problems in this shard")
                )

    def symlink(self, key: str, shard: int | None) -> None:
        """Any link is reported: an error if it leaves the store, else a warning."""
        root = self.storage.local_root
        target = os.path.realpath(os.path.join(root, key)) if root is not None else key
        real_root = os.path.realpath(root) if root is not None else ""
        if target != real_root and not target.startswith(real_root + os.sep):
            self.add(ERROR, "symlink", f"{key} is a symbolic link to {target}, outside the store; readers refuse it", key, shard=shard)
        else:
            self.add(WARNING, "symlink", f"{key} is a symbolic link; actstore never writes links (chunk reads refuse them)", key, shard=shard)

    def load_stats(self, key: str, shard: int | None) -> None:
        """Report a statistics file that does not load."""
        from actstore.stats import RunningStats

        try:
            RunningStats.from_bytes(self.storage.get(key))
        except Exception as e:  # noqa: BLE001 - np.load of a damaged file raises many types
            self.add(ERROR, "stats", f"statistics file {key.rsplit('/', 1)[-1]} cannot be read ({e!r})", key, shard=shard)
