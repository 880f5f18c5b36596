"""Verifying an aligned family (docs/format.md, section 9): every member store, each reported
under its folder, and that the members hold the same examples per shard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from actstore import catalog
from actstore.errors import ActstoreError
from actstore.layout.family import FAMILY_FILE
from actstore.storage import Storage
from actstore.verify.report import ERROR, Problem, VerifyReport

__all__ = ["FAMILY_FILE", "verify_members"]


def verify_members(storage: Storage, verify_one: Callable[[Storage], VerifyReport]) -> VerifyReport:
    """One report for the family at `storage`: each member's problems (their paths under
    `members/<name>/`), plus an `alignment` error where the members' example counts differ."""
    report = VerifyReport(path=storage.url, deep=False)
    try:
        family = catalog.read_family(storage)
    except ActstoreError as e:
        report.problems.append(Problem(severity=ERROR, kind="family-record", message=str(e), path=FAMILY_FILE))
        return report
    counts: dict[str, list[int]] = {}
    for m in family.members:
        sub = verify_one(storage.child(m.key))
        report.deep = sub.deep
        report.finalized = report.finalized and sub.finalized
        report.n_shards += sub.n_shards
        report.n_examples = max(report.n_examples, sub.n_examples)
        report.n_chunk_files += sub.n_chunk_files
        report.n_bytes_read += sub.n_bytes_read
        report.problems += [
            replace(p, path=f"{m.key}/{p.path}" if p.path else m.key, message=f"member {m.name}: {p.message}")
            for p in sub.problems
        ]
        try:
            counts[m.name] = [s.n_examples for s in catalog.read_manifest(storage.child(m.key)).shards]
        except ActstoreError:
            pass  # (the member's own report says why)
    if len({tuple(v) for v in counts.values()}) > 1:
        report.problems.append(
            Problem(
                severity=ERROR,
                kind="alignment",
                message=f"the members hold different examples per shard {counts}: they are not aligned; recapture the family",
            )
        )
    return report
