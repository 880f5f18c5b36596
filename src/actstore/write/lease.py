"""Exclusive shard leases: one writer (or resumer) per shard at a time (docs/format.md, 5.1).

A writer takes generation 0 of its shard's lease with a create-only put; a second writer
finds it held and is refused, naming the holder. The holder renews the file every TTL/4
from a background thread and deletes it when the writer closes. A holder is dead when its
process is gone (same host: the pid, with its start time against pid reuse) or, on another
host, when the lease was not renewed within its TTL; then the next writer takes generation
g + 1 (create-only again, so of several takers one wins) and deletes the older files. A
holder whose lease was taken over finds out at its next commit and stops before committing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

from actstore.errors import CorruptStoreError, LeaseLostError, ShardBusyError
from actstore.layout import keys, spec
from actstore.layout.leases import Lease, dump_lease, parse_lease
from actstore.layout.records import now
from actstore.storage import Storage

_LIVE_TOKENS: set[str] = set()  # tokens of the leases this process's open writers hold
_HOST = socket.gethostname()


def host_name() -> str:
    """This host's name, as leases record it."""
    return _HOST


def lease_ttl() -> float:
    """The TTL of new leases: ACTSTORE_LEASE_TTL seconds, else the format's default."""
    v = os.environ.get("ACTSTORE_LEASE_TTL")
    if v is None:
        return spec.DEFAULT_LEASE_TTL
    try:
        ttl = float(v)
    except ValueError:
        ttl = -1.0
    if not 0.5 <= ttl <= 86_400:
        raise ValueError(f"ACTSTORE_LEASE_TTL must be a number of seconds in 0.5..86400. Got {v!r}.")
    return ttl


def _proc(pid: int) -> tuple[bool, int | None]:
    """(running, start time in clock ticks) of a local process; a zombie is not running."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read().decode("ascii", "replace")
    except FileNotFoundError:
        return False, None
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False, None
        except PermissionError:
            pass
        return True, None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] not in ("Z", "X"), int(fields[19])


def holder_alive(lease: Lease, at: float | None = None) -> bool:
    """Whether the lease's holder may still be writing."""
    if lease.host == _HOST:
        if lease.pid == os.getpid():
            return lease.token in _LIVE_TOKENS
        running, start = _proc(lease.pid)
        return running and (lease.pid_start is None or start is None or start == lease.pid_start)
    return (time.time() if at is None else at) < lease.renewed + lease.ttl


def _generations(storage: Storage, shard: int) -> list[int]:
    gens = []
    for name in storage.list_dir(keys.LEASES):
        parsed = keys.parse_lease_name(name)
        if parsed is not None and parsed[0] == shard:
            gens.append(parsed[1])
    return sorted(gens)


def current(storage: Storage, shard: int) -> Lease | None:
    """The lease of the highest generation on `shard`, or None (a file deleted meanwhile: None)."""
    for _ in range(3):
        gens = _generations(storage, shard)
        if not gens:
            return None
        key = keys.lease_key(shard, gens[-1])
        try:
            return parse_lease(storage.get(key), storage.where(key))
        except FileNotFoundError:
            continue  # released or replaced while we looked: look again
    return None


class ShardLease:
    """A held lease; `release()` gives it back. Renewed in the background while held."""

    def __init__(self, storage: Storage, lease: Lease):
        self.storage = storage
        self.lease = lease
        self.key = keys.lease_key(lease.shard, lease.generation)
        self.lost: str | None = None  # why the lease is no longer ours
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"actstore-lease-{lease.shard}", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, storage: Storage, shard: int, what: str) -> ShardLease:
        """Take the lease of `shard`, or raise ShardBusyError naming its live holder.
        `what` names the shard in messages ("shard 3 of s3://b/store")."""
        ttl = lease_ttl()
        for _ in range(5):
            gens = _generations(storage, shard)
            gen = 0
            if gens:
                key = keys.lease_key(shard, gens[-1])
                try:
                    held = parse_lease(storage.get(key), storage.where(key))
                except FileNotFoundError:
                    continue  # released meanwhile: look again
                except CorruptStoreError as e:
                    raise CorruptStoreError(
                        f"{e}; the lease of {what} is damaged: delete {storage.where(key)} if no writer of it runs"
                    ) from None
                if holder_alive(held):
                    raise ShardBusyError(_busy_message(what, held))
                gen = gens[-1] + 1
            token = uuid.uuid4().hex
            running, start = _proc(os.getpid())
            lease = Lease(
                shard=shard,
                generation=gen,
                token=token,
                host=_HOST,
                pid=os.getpid(),
                pid_start=start,
                started=now(),
                renewed=time.time(),
                ttl=ttl,
            )
            # Live before it is visible: a writer of this process that reads the lease
            # between the put and the registration would take it for a dead holder's.
            _LIVE_TOKENS.add(token)
            try:
                taken = storage.put_if_absent(keys.lease_key(shard, gen), dump_lease(lease))
            except BaseException:
                _LIVE_TOKENS.discard(token)
                raise
            if taken:
                for old in gens:  # the dead holders' files: ours is the highest now
                    try:
                        storage.delete(keys.lease_key(shard, old))
                    except FileNotFoundError:
                        pass
                return cls(storage, lease)
            _LIVE_TOKENS.discard(token)  # another writer took this generation first: the next look names it
        held = current(storage, shard)
        raise ShardBusyError(
            _busy_message(what, held)
            if held
            else f"{what} is being taken by several writers at once; give each writer its own shard"
        )

    def check(self) -> None:
        """Raise LeaseLostError when another writer took the lease over (before a commit)."""
        if self.lost is None:
            self._verify()
        if self.lost is not None:
            raise LeaseLostError(self.lost)

    def _verify(self) -> None:
        held = current(self.storage, self.lease.shard)
        if held is None or held.token != self.lease.token:
            by = f" by {held.holder()}" if held is not None else ""
            self.lost = (
                f"this writer's lease on shard {self.lease.shard} of {self.storage.url} was taken over{by} "
                f"(it was not renewed within {self.lease.ttl:g} s: a paused or partitioned writer); "
                "nothing more is committed by this writer. Its committed examples are kept; the new holder continues"
            )

    def _renew_loop(self) -> None:
        period = max(self.lease.ttl / 4, 0.1)
        while not self._stop.wait(period):
            try:
                self._verify()
                if self.lost is not None:
                    return
                self.lease = Lease(**{**self.lease.__dict__, "renewed": time.time()})
                self.storage.put(self.key, dump_lease(self.lease))
            except Exception:  # noqa: BLE001 - a failed renewal is retried; expiry decides
                continue

    def release(self) -> None:
        """Give the lease back (idempotent): delete its file if it is still ours."""
        if self._stop.is_set():
            return
        self._stop.set()
        _LIVE_TOKENS.discard(self.lease.token)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        # Our generation's file is ours or gone: a taker puts a higher generation (create-only)
        # and deletes the lower ones. So it is deleted without reading it first.
        try:
            self.storage.delete(self.key)
        except (FileNotFoundError, OSError):
            pass  # gone, or the storage unreachable: a later taker replaces it


def _busy_message(what: str, held: Lease) -> str:
    return (
        f"{what} is being written by another writer: {held.holder()} (lease {keys.lease_key(held.shard, held.generation)}). "
        "Two writers of one shard would interleave their blocks. Wait for it to finish or stop it; "
        f"once its process is gone (or, from another host, {held.ttl:g} s after its last renewal) --resume takes the shard over"
    )
