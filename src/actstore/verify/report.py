"""What verification found: problems and the report (summary, table, JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One finding. `example` is the global index (None before finalize; see `local`)."""

    severity: str
    kind: str
    message: str
    path: str | None = None
    shard: int | None = None
    example: int | None = None
    local: int | None = None
    layer: int | None = None
    segment: str | None = None


@dataclass(kw_only=True)
class VerifyReport:
    """What `verify_store` found. `ok` is True when there is no error (warnings allowed)."""

    path: str
    deep: bool
    finalized: bool = True
    problems: list[Problem] = field(default_factory=list)
    n_shards: int = 0
    n_examples: int = 0
    n_chunk_files: int = 0
    n_bytes_read: int = 0
    n_removed_examples: int = 0  # a spool's consumed examples, whose activation files were removed
    n_removed_bytes: int = 0

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def damaged(self) -> list[tuple[int | None, int | None, str | None]]:
        """(example, layer, file) of every error naming an example, in report order."""
        return [(p.example, p.layer, p.path) for p in self.errors if p.example is not None or p.local is not None]

    def summary(self) -> str:
        mode = "deep" if self.deep else "fast"
        head = (
            f"verify ({mode}) {self.path}: {self.n_examples} examples in {self.n_shards} shards, "
            f"{self.n_chunk_files} chunk files checked, {self.n_bytes_read} bytes read"
        )
        if self.n_removed_examples:
            head += (
                f"; {self.n_removed_examples} examples ({self.n_removed_bytes} bytes of activations) removed by the "
                "spool after every consumer read them: their activation files are not checked"
            )
        if not self.problems:
            return head + ": OK"
        return head + f": {plural(len(self.errors), 'error')}, {plural(len(self.warnings), 'warning')}"

    def table(self) -> str:
        """The problems as a fixed-width table, each followed by its message."""
        cols = ("SEVERITY", "PROBLEM", "SHARD", "EXAMPLE", "LAYER", "SEGMENT", "FILE")
        rows = [cols]
        for p in self.problems:
            ex = p.example if p.example is not None else (f"local {p.local}" if p.local is not None else None)
            rows.append(
                tuple(
                    "-" if v is None else str(v) for v in (p.severity, p.kind, p.shard, ex, p.layer, p.segment, p.path)
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols) - 1)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
            if i:
                lines.append("    " + self.problems[i - 1].message)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
