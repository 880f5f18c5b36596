"""The lease record: which writer holds a shard exclusively (docs/format.md, section 5.1).

A lease is a small JSON file `leases/shard-NNNNN.<generation>.json` at the store root,
created with a create-only put; the holder is the highest generation. No I/O here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from actstore.errors import CorruptStoreError
from actstore.layout import jsonio, spec
from actstore.layout.records import is_count


@dataclass(frozen=True, kw_only=True)
class Lease:
    shard: int
    generation: int
    token: str  # unique per holder: a holder owns the lease only while the file carries its token
    host: str
    pid: int
    pid_start: int | None  # the process's start time in clock ticks (Linux), against pid reuse
    started: str  # UTC time the holder took the lease
    renewed: float  # Unix time of the holder's last renewal
    ttl: float  # seconds after `renewed` that the lease stays valid for a holder on another host

    def holder(self) -> str:
        """The holder, as error messages name it."""
        return f"pid {self.pid} on host {self.host}, writing since {self.started}"


def dump_lease(lease: Lease) -> bytes:
    d = asdict(lease)
    return jsonio.dumps({k: d[k] for k in spec.LEASE_FIELDS})


def parse_lease(data: bytes, where: str) -> Lease:
    rec = jsonio.loads(data, where, what="shard lease")
    if not isinstance(rec, dict) or set(rec) != set(spec.LEASE_FIELDS):
        raise CorruptStoreError(f"{where}: a lease must have exactly the fields {list(spec.LEASE_FIELDS)}, got {rec!r}")
    ok = (
        is_count(rec["shard"])
        and is_count(rec["generation"])
        and is_count(rec["pid"])
        and (rec["pid_start"] is None or is_count(rec["pid_start"]))
        and all(isinstance(rec[k], str) for k in ("token", "host", "started"))
        and all(
            isinstance(rec[k], (int, float)) and not isinstance(rec[k], bool) and math.isfinite(rec[k]) and rec[k] >= 0
            for k in ("renewed", "ttl")
        )
    )
    if not ok:
        raise CorruptStoreError(f"{where}: a lease field has the wrong type: {rec!r}")
    return Lease(**rec)
