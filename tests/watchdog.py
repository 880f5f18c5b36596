"""A per-call time limit for tests of hostile input: a call that blocks (a FIFO opened for
reading, a loop without end) is interrupted by SIGALRM and fails the test instead of
hanging the suite. Main thread only (signals are delivered there)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

LIMIT_S = 5.0  # the time limit of one call on hostile input


class Hang(Exception):
    """A call ran past its time limit."""


@contextlib.contextmanager
def within(seconds: float = LIMIT_S, what: str = "the call") -> Iterator[None]:
    """Run the block under a real-time alarm; past `seconds` it raises Hang (blocking
    system calls are interrupted: the handler raises, so Python does not retry them)."""

    def _fire(signum, frame):
        raise Hang(f"{what} ran past {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
