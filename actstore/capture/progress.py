"""The capture progress bar: examples with tokens/s and MB/s, and the ETA."""

from __future__ import annotations

import time


class Progress:
    """A tqdm bar over examples, with tokens/s and MB/s (ETA from tqdm)."""

    def __init__(self, total: int | None, desc: str = "capture", disable: bool = False):
        from actstore.progress import bar

        self.bar = bar(total=total, desc=desc, unit="ex", disable=disable, dynamic_ncols=True, smoothing=0.1)
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.nbytes = 0

    def update(self, examples: int, tokens: int, nbytes: int) -> None:
        self.tokens += tokens
        self.nbytes += nbytes
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / dt:,.0f} tok/s, {self.nbytes / dt / 2**20:.1f} MB/s", refresh=False)
        self.bar.update(examples)

    def close(self) -> None:
        self.bar.close()
