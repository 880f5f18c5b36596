"""Lent: a buffer lent to several holders, handed back once every holder is done."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Lent:
    """`release` runs once, on the thread that ends the last hold.

    The lender holds it from the start (one hold); each further holder calls `hold()`
    and later `done()`; the lender's own `done()` ends its hold. A `done()` beyond the
    holds is a bug in the caller and raises (a buffer handed back twice could be
    refilled while still being read).

    Args:
        release: called once when the last hold ends (gives the buffer back).
    """

    def __init__(self, release: Callable[[], None]):
        self._release = release
        self.held = 1  # the lender's own hold, until every holder is counted
        self._lock = threading.Lock()

    def hold(self) -> None:
        """One more holder (before the lender's own `done`)."""
        with self._lock:
            if self.held == 0:
                raise RuntimeError("Lent.hold() after the buffer was handed back: hold it before the last done()")
            self.held += 1

    def done(self) -> None:
        """One holder is done; the last one hands the buffer back."""
        with self._lock:
            if self.held == 0:
                raise RuntimeError("Lent.done() called more times than the buffer was held")
            self.held -= 1
            last = self.held == 0
        if last:
            self._release()

    @property
    def released(self) -> bool:
        return self.held == 0
