"""Copy a finalized store between locations, verified and resumable: `actstore cp SRC DST`.

SRC and DST are any store locations (`open_storage`: folders, file://, s3://, gs://, az://).

Order of publication, so that DST is never a readable partial store: (1) every object of
the store but the commit points, (2) each shard's meta/commit.json, (3) actstore.json,
(4) the merged statistics file the manifest names, then manifest.json. Readers open a
store through its manifest, so until step 4 ends DST is "not finalized" (or, when it held
an older copy of the same store, that older copy, intact: stores only ever grow).
Temporary names and shards the manifest does not list are left out. Nothing at DST is
ever deleted. A DST holding a different store is refused before anything is written.

Verification: the crc32c of every object is computed from the bytes read from SRC; with
verify=True each copied object is then read back from DST and its size and crc32c
compared (a size check cannot see same-size damage: a wrong range, a flipped bit, an
object replaced meanwhile). A mismatch deletes the object at DST and fails. At the end
DST (a local folder or an object store) is also checked by `verify_store(deep=True)`: the copy against the checksums
its writers recorded, so a source damaged before the copy is reported too.

Resume: while a copy runs, DST holds MARKER (a temporary name, so never part of the
store) recording the crc32c of the source's identity and manifest. A rerun skips the
activation chunk and shard files already at DST with the right size when DST's contents
provably come from this very source version (the marker matches, or DST's manifest is
SRC's); every other object already there (and every object, otherwise) is compared by
content and copied only when it differs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from actstore.copy import transfer
from actstore.copy.listing import ZARR_META, CopyPlan, Item, plan_copy
from actstore.copy.transfer import (
    checksum,
    make_folders,
    parallel,
    stream,
)
from actstore.errors import (
    ActstoreError,
    CopyError,
    CopyVerifyError,
    CorruptStoreError,
    StoreMismatchError,
    VerificationError,
)
from actstore.layout import jsonio, keys, records
from actstore.layout.checksum import crc32c
from actstore.storage import KeyNotFound, Storage, open_storage

__all__ = ["MARKER", "CopyError", "CopyResult", "CopyVerifyError", "copy_store"]

MARKER = ".actstore-cp.json"  # at DST's root while a copy is unfinished
_NAMED = 5  # keys named in a message; the rest are counted

try:  # obstore's errors are not OSError: both are I/O failures to turn into CopyError
    from obstore.exceptions import BaseError as _ObstoreError

    _IO_ERRORS: tuple[type[BaseException], ...] = (OSError, _ObstoreError)
except ImportError:  # pragma: no cover - obstore is a declared dependency
    _IO_ERRORS = (OSError,)


@dataclass(frozen=True, kw_only=True)
class CopyResult:
    """What `copy_store` did.

    Attributes:
        src, dst: the locations.
        n_objects, total_bytes: objects and bytes of the store (what DST now holds of it).
        n_copied, bytes_copied: objects written to DST by this call.
        n_present, bytes_present: objects already at DST (right size, or same bytes).
        n_temporary: temporary files of SRC left out.
        unlisted_shards: SRC's shard folders (or other names under shards/) the manifest
            does not list, left out.
        not_files: SRC entries that are not regular files (links, FIFOs), left out.
        verified: every copied object was read back and compared.
        deep_verified: `verify_store(deep=True)` passed on DST; None when not run (verify=False).
        seconds: wall time of the copy (read-backs included).
        verify_seconds: wall time of the final deep verification.
    """

    src: str
    dst: str
    n_objects: int
    total_bytes: int
    n_copied: int
    bytes_copied: int
    n_present: int
    bytes_present: int
    n_temporary: int
    unlisted_shards: tuple[str, ...]
    not_files: tuple[str, ...]
    verified: bool
    deep_verified: bool | None
    seconds: float
    verify_seconds: float = 0.0

    @property
    def warnings(self) -> list[str]:
        out = []
        if self.unlisted_shards:
            out.append(
                f"left out {_plural(len(self.unlisted_shards), 'shard')} the manifest does not list: "
                f"{_names(self.unlisted_shards)} (finalize SRC to publish them)"
            )
        if self.not_files:
            out.append(
                f"left out {_plural(len(self.not_files), 'non-file entry', 'non-file entries')}: {_names(self.not_files)}"
            )
        return out

    def summary(self) -> str:
        rate = self.bytes_copied / self.seconds / 2**20 if self.seconds > 0 else 0.0
        checks = (
            "not verified"
            if not self.verified
            else "read back and compared, "
            + ("verify --deep passed" if self.deep_verified else "verify --deep not run")
        )
        line = (
            f"copied {self.src} to {self.dst}: {_plural(self.n_copied, 'object')} ({_size(self.bytes_copied)}) "
            f"in {self.seconds:.1f} s ({rate:.1f} MiB/s), {self.n_present} already there; {checks}"
        )
        extra = self.warnings + (
            [f"{_plural(self.n_temporary, 'temporary file')} left out"] if self.n_temporary else []
        )
        return line + ("; " + "; ".join(extra) if extra else "")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["unlisted_shards"], d["not_files"] = list(self.unlisted_shards), list(self.not_files)
        d["warnings"] = self.warnings
        return d


def copy_store(
    src: str | os.PathLike | Storage,
    dst: str | os.PathLike | Storage,
    *,
    progress: Callable[[int, int], None] | None = None,
    verify: bool = True,
    workers: int = 8,
) -> CopyResult:
    """Copy the finalized store SRC to DST (see the module docstring for the guarantees).

    Args:
        src: a finalized store (has manifest.json): a path, a URL or a Storage.
        dst: where to copy it: empty, an interrupted copy of SRC, or an older copy of it.
        progress: called as progress(n_bytes, total_bytes) once with 0 when the work is
            known, then after each object (copied or found already there).
        verify: read every copied object back and compare its crc32c; then, for a local
            DST, run `verify_store(deep=True)`. False: nothing is read back.
        workers: objects copied at once (threads); at most this many are in memory.

    Returns:
        A CopyResult. Raises NotFinalizedError / StoreNotFoundError for a SRC that is not a
        finalized store, StoreMismatchError for a DST holding another store, CopyError when
        an I/O fails (rerun to resume), CopyVerifyError when a read-back differs, and
        VerificationError when the copy is exact but the store fails deep verification.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    t0 = time.monotonic()
    s, d = open_storage(src), open_storage(dst)
    _check_apart(s, d)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="actstore-cp") as pool:
            try:
                plan = plan_copy(s, pool)
                copier = _Copier(s, d, plan, verify=verify, progress=progress)
                copier.check_destination(pool)  # refuses a different store: nothing written yet
                copier.run(pool, workers)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a failure or Ctrl-C: start nothing more, finish what runs
                raise
    except ActstoreError:
        raise
    except _IO_ERRORS as e:
        raise CopyError(f"copying {s.url} to {d.url} failed: {_err(e)}; rerun the same command to resume") from e
    seconds = time.monotonic() - t0
    deep = _deep_verify(s, d) if verify else None
    c = copier
    return CopyResult(
        src=s.url,
        dst=d.url,
        n_objects=c.n_copied + c.n_present,
        total_bytes=c.total,
        n_copied=c.n_copied,
        bytes_copied=c.bytes_copied,
        n_present=c.n_present,
        bytes_present=c.bytes_present,
        n_temporary=plan.n_temporary,
        unlisted_shards=plan.unlisted,
        not_files=plan.not_files,
        verified=verify,
        deep_verified=deep,
        seconds=seconds,
        verify_seconds=time.monotonic() - t0 - seconds,
    )


def _check_apart(s: Storage, d: Storage) -> None:
    """SRC and DST must not be one store, nor one inside the other."""
    if s.local_root is not None and d.local_root is not None:
        a, b = str(s.local_root.resolve()), str(d.local_root.resolve())
    elif s.local_root is None and d.local_root is None:
        a, b = s.url.rstrip("/"), d.url.rstrip("/")
    else:
        return
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise ValueError(
            f"cannot copy {s.url} to {d.url}: {'they are the same location' if a == b else 'one lies inside the other'}"
        )
    if d.local_root is not None and d.local_root.exists() and not d.local_root.is_dir():
        raise ValueError(f"cannot copy to {d.url}: it is a file, not a folder")


# ---- the copy ----------------------------------------------------------------------------
class _Copier:
    """One copy: checks DST, then publishes the plan in order with a bounded thread pool."""

    def __init__(
        self, s: Storage, d: Storage, plan: CopyPlan, *, verify: bool, progress: Callable[[int, int], None] | None
    ):
        self.s, self.d, self.plan, self.verify, self.progress = s, d, plan, verify, progress
        self.lock = threading.Lock()
        self.n_copied = self.bytes_copied = self.n_present = self.bytes_present = 0
        sized = plan.objects + ([plan.stats] if plan.stats else [])
        self.total = (
            sum(i.size for i in sized) + len(plan.identity) + len(plan.manifest) + sum(map(len, plan.commits.values()))
        )
        self.have: dict[str, int] = {}
        self.trust_size = False

    def check_destination(self, pool: ThreadPoolExecutor) -> None:
        """Refuse a DST holding another store; decide whether sizes can be trusted on resume."""
        d, p = self.d, self.plan
        self.have = {e.key: e.size for e in d.list("") if e.kind == "file"}
        stored = [k for k in self.have if not any(keys.is_temporary(x) and x not in ZARR_META for x in k.split("/"))]
        marker = self._marker()
        ident_crc, manifest_crc = crc32c(p.identity), crc32c(p.manifest)
        if keys.IDENTITY in self.have:
            theirs = d.get(keys.IDENTITY)
            if theirs != p.identity:
                raise StoreMismatchError(
                    f"{d.url} already holds a different store ({_identity_diff(theirs, p.identity, d)}); "
                    f"nothing was written. Copy into an empty location, or delete {d.url} first"
                )
            if keys.MANIFEST not in self.have and marker is None:
                raise StoreMismatchError(
                    f"{d.url} holds an unfinalized store of the same configuration (writer shards, "
                    f"not a copy of {self.s.url}); nothing was written. Finalize it, or copy elsewhere"
                )
        elif stored and (marker is None or marker.get("identity_crc32c") != ident_crc):
            what = (
                f"an unfinished copy of another store ({marker.get('source', 'unknown')})"
                if marker
                else "objects that are not an actstore store"
            )
            raise StoreMismatchError(
                f"{d.url} holds {what}: {_names(sorted(stored))}; nothing was written. "
                f"Copy into an empty location, or delete {d.url} first"
            )
        self._check_lineage(pool)
        self.trust_size = (
            not stored
            or (marker or {}).get("manifest_crc32c") == manifest_crc
            or (keys.MANIFEST in self.have and d.get(keys.MANIFEST) == p.manifest)
        )
        doc = {
            "source": self.s.url,
            "identity_crc32c": ident_crc,
            "manifest_crc32c": manifest_crc if self.trust_size else None,
            "started": records.now(),
        }
        d.put(MARKER, jsonio.dumps(doc))

    def _marker(self) -> dict[str, Any] | None:
        if MARKER not in self.have:
            return None
        try:
            doc = jsonio.parse(self.d.get(MARKER))
        except ValueError:
            return {}  # damaged: it trusts nothing
        return doc if isinstance(doc, dict) else {}

    def _check_lineage(self, pool: ThreadPoolExecutor) -> None:
        """Each shard DST has committed must be a prefix of SRC's shard: same block records."""
        names = [n for n in self.plan.commits if f"{keys.shard_prefix(n)}/{keys.COMMIT}" in self.have]
        for problem in pool.map(self._lineage, names):
            if problem:
                raise StoreMismatchError(
                    f"{self.d.url} holds a different store with the same configuration: {problem}; "
                    f"nothing was written. Copy into an empty location, or delete {self.d.url} first"
                )

    def _lineage(self, name: str) -> str | None:
        prefix = keys.shard_prefix(name)
        ours = records.parse_commit(self.plan.commits[name], self.s.where(f"{prefix}/{keys.COMMIT}"))
        theirs = records.parse_commit(self.d.get(f"{prefix}/{keys.COMMIT}"), self.d.where(f"{prefix}/{keys.COMMIT}"))
        if theirs.n_blocks == 0:
            return None
        if theirs.n_blocks > ours.n_blocks or theirs.n_committed > ours.n_committed:
            return f"its {name} has {theirs.n_committed} committed examples, the source's {ours.n_committed}"
        blocks = f"{prefix}/{keys.BLOCKS}"
        try:
            mine = self.d.get(blocks)
            head = mine[: records.committed_length(mine, theirs.n_blocks, self.d.where(blocks))]
        except (KeyNotFound, CorruptStoreError):
            return f"its {name} has damaged block records"
        return None if self.s.get_range(blocks, 0, len(head)) == head else f"the block records of its {name} differ"

    def run(self, pool: ThreadPoolExecutor, workers: int) -> None:
        p, d = self.plan, self.d
        if self.progress is not None:
            self.progress(0, self.total)
        parallel(pool, workers, self._copy, p.objects)  # 1. data and per-shard files
        make_folders(
            d,
            (f"{keys.shard_prefix(n)}/{sub}" for n in p.commits for sub in (keys.ARRAYS, keys.META_DIR, keys.TEXT_DIR)),
        )
        d.sync()
        commits = [(f"{keys.shard_prefix(n)}/{keys.COMMIT}", b) for n, b in sorted(p.commits.items())]
        parallel(pool, workers, lambda kb: self._publish(*kb), commits)  # 2. each shard's commit point
        d.sync()
        self._publish(keys.IDENTITY, p.identity)  # 3. the store's identity
        if p.stats is not None:
            self._copy(p.stats)  # 4. the statistics file the manifest names, then the manifest
        d.sync()
        self._publish(keys.MANIFEST, p.manifest)
        d.sync()
        d.delete(MARKER)

    def _copy(self, item: Item) -> None:
        """Copy one object from SRC (whole, or range by range when large) unless DST has it."""
        key, have = item.key, self.have.get(item.key)
        if have == item.size and item.data and self.trust_size:
            return self._tick(item.size, present=True)
        with self._io(key):
            if item.size > transfer.STREAM_BYTES:
                if have == item.size and checksum(self.d, key) == checksum(self.s, key):
                    return self._tick(item.size, present=True)
                size, crc = stream(self.s, self.d, key, item.size)
            else:
                data = self.s.get(key)
                size, crc = len(data), crc32c(data)
                if have == size and self.d.get(key) == data:
                    return self._tick(size, present=True)
                self.d.put(key, data)
                del data  # the read-back below holds the object once more, never twice
            self._check(key, size, crc)
        self._tick(size)

    def _publish(self, key: str, data: bytes) -> None:
        """Write a record held in memory (commit, identity, manifest) unless DST has it."""
        with self._io(key):
            if self.have.get(key) == len(data) and self.d.get(key) == data:
                return self._tick(len(data), present=True)
            self.d.put(key, data)
            self._check(key, len(data), crc32c(data))
        self._tick(len(data))

    @contextlib.contextmanager
    def _io(self, key: str) -> Iterator[None]:
        """An I/O failure copying `key` as one CopyError naming both ends (actstore's errors pass)."""
        try:
            yield
        except ActstoreError:
            raise
        except _IO_ERRORS as e:
            raise CopyError(
                f"copying {self.s.where(key)} to {self.d.where(key)} failed: {_err(e)}; "
                "rerun the same command to resume"
            ) from e

    def _check(self, key: str, size: int, crc: int) -> None:
        if not self.verify:
            return
        got = checksum(self.d, key)
        if got != (size, crc):
            self.d.delete(key)  # so that a rerun copies it again
            raise CopyVerifyError(
                f"{self.d.where(key)} read back as {got[0]} bytes with crc32c {got[1]:08x}, but {size} bytes with crc32c "
                f"{crc:08x} were copied from {self.s.where(key)}; it was deleted: rerun the same command to copy it again"
            )

    def _tick(self, n: int, *, present: bool = False) -> None:
        with self.lock:
            if present:
                self.n_present, self.bytes_present = self.n_present + 1, self.bytes_present + n
            else:
                self.n_copied, self.bytes_copied = self.n_copied + 1, self.bytes_copied + n
        if self.progress is not None:
            self.progress(n, self.total)


def _deep_verify(s: Storage, d: Storage) -> bool:
    """verify_store(deep=True) on DST, a local folder or an object store."""
    from actstore.verify import verify_store

    report = verify_store(d.local_root if d.local_root is not None else d.url, deep=True)
    if not report.ok:
        first = report.errors[0]
        raise VerificationError(
            f"{d.url} holds every object of {s.url} byte for byte, but fails `actstore verify --deep`: "
            f"{_plural(len(report.errors), 'error')}, the first: {first.message}. Run `actstore verify --deep {s.url}`: "
            "a source damaged before the copy fails the same way",
            report,
        )
    return True


# ---- messages ----------------------------------------------------------------------------
def _identity_diff(theirs: bytes, ours: bytes, d: Storage) -> str:
    try:
        a = records.parse_identity(theirs, d.where(keys.IDENTITY)).to_json()
    except CorruptStoreError:
        return f"its {keys.IDENTITY} is not one actstore reads"
    b = jsonio.parse(ours)["config"]
    fields = [k for k in b if a.get(k) != b[k]]
    return f"its {keys.IDENTITY} differs in {', '.join(fields) if fields else 'layout'}"


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _names(items: Iterable[str]) -> str:
    items = list(items)
    more = len(items) - _NAMED
    return ", ".join(items[:_NAMED]) + (f" and {more} more" if more > 0 else "")


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
