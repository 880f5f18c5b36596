"""The capture progress bar: examples with tokens/s and MB/s, the ETA, and the writers' I/O."""

from __future__ import annotations

import time
from typing import Any


class CaptureBar:
    """A tqdm bar over examples, with tokens/s and MB/s (ETA from tqdm), and what the
    writers' pipelines hold: bytes written (or uploaded) and queued in memory."""

    def __init__(self, total: int | None, desc: str = "capture", disable: bool = False):
        from actstore.progress import bar

        self.bar = bar(total=total, desc=desc, unit="ex", disable=disable, dynamic_ncols=True, smoothing=0.1)
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.nbytes = 0
        self._io: dict[Any, Any] = {}

    def update(self, examples: int, tokens: int, nbytes: int) -> None:
        self.tokens += tokens
        self.nbytes += nbytes
        dt = max(time.perf_counter() - self.t0, 1e-9)
        note = f"{self.tokens / dt:,.0f} tok/s, {self.nbytes / dt / 2**20:.1f} MB/s"
        if self._io:
            note += ", " + io_note(list(self._io.values()))
        self.bar.set_postfix_str(note, refresh=False)
        self.bar.update(examples)

    def io(self, stats: Any, who: Any = 0) -> None:
        """The latest IOStats of writer `who` (shown with the next update)."""
        self._io[who] = stats

    def close(self) -> None:
        self.bar.close()


def io_note(stats: list[Any]) -> str:
    """'upload 1,234 MB done, 96/1,024 MiB queued' over several writers' IOStats."""
    verb = "upload" if any(s.remote for s in stats) else "write"
    done = sum(s.written_bytes for s in stats)
    pending = sum(s.pending_bytes for s in stats)
    bound = sum(s.max_bytes for s in stats)
    return f"{verb} {done / 1e6:,.0f} MB done, {pending / 2**20:,.0f}/{bound / 2**20:,.0f} MiB queued"
