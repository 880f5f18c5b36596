"""Retries of object-store requests that failed at the connection level.

obstore retries 5xx answers, throttling and some dropped connections itself, but not every
connection-level failure: a connection reset before the first answer byte ("connection was
not ready", `retries: 0`), a listing whose body is cut midway, a request that timed out. A
week-long training run reading from a bucket must ride through those, so every read (GET,
ranged GET, HEAD, LIST) and every idempotent write (a whole-object put, a create-only put,
which recognises its own earlier success by its bytes, a delete) goes through `call` /
`acall`: the failure is classified, counted, and the request tried again with exponential
backoff and jitter until it succeeds or its total deadline (`deadline_s`) has passed. A
refused connection or a name that does not resolve is retried only when the endpoint
answered before in this process; otherwise the configuration is the likely cause and the
caller's error says so at once.

After the deadline the request raises StorageAccessError saying what happened and how often
(`cannot read URL: 9 connection failures in 120 s (7 connection resets, 2 responses cut
midway); the last: Connection reset by peer ...`). Once one request of an endpoint gave up,
the endpoint is down for this process until a request of it succeeds: further requests
(the next write, a writer's cleanup) are tried once and fail at once, naming the request
that waited out the deadline, so an endpoint that went away costs one deadline, not one
per operation. `counts()` gives this process's totals,
which progress bars show and the CLI's `--json` summaries report as `network`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from actstore.errors import StorageAccessError
from actstore.progress import add_note

T = TypeVar("T")

DEADLINE_ENV = "ACTSTORE_RETRY_SECONDS"  # a request's total retry deadline, seconds

# Text in obstore's (reqwest's, hyper's) error -> the kind of failure; first match wins.
_KINDS: tuple[tuple[str, str], ...] = (
    ("timed out", "timeout"),
    ("timedout", "timeout"),
    ("deadline has elapsed", "timeout"),
    ("connection refused", "refused"),
    ("dns error", "unresolved"),
    ("failed to lookup address", "unresolved"),
    ("connection was not ready", "reset"),
    ("connection reset", "reset"),
    ("connectionreset", "reset"),
    ("broken pipe", "reset"),
    ("brokenpipe", "reset"),
    ("connection closed before message completed", "reset"),
    ("incompletemessage", "cut"),
    ("response body error", "cut"),
    ("error decoding response body", "cut"),
    ("unexpected eof", "cut"),
    ("unexpectedeof", "cut"),
    ("end of file before message length", "cut"),
    ("error sending request", "reset"),
    ("connection error", "reset"),
)
LABELS = {
    "reset": "connection resets",
    "cut": "responses cut midway",
    "timeout": "timeouts",
    "refused": "refused connections",
    "unresolved": "failed name lookups",
}
ONE = {
    "reset": "connection reset",
    "cut": "response cut midway",
    "timeout": "timeout",
    "refused": "refused connection",
    "unresolved": "failed name lookup",
}
_UNREACHED = {"refused", "unresolved"}  # never reached: the configuration is the likely cause
_MESSAGE = re.compile(r'message: "([^"]+)"|hyper::Error\(\s*\w+,\s*"([^"]+)"')


@dataclass(frozen=True)
class RetryPolicy:
    """How long one request may retry: at most `attempts` tries within `deadline_s` seconds,
    waiting `first_wait_s` after the first failure, doubling up to `max_wait_s` (with jitter)."""

    deadline_s: float = 120.0
    attempts: int = 60
    first_wait_s: float = 0.05
    max_wait_s: float = 4.0


_policy: RetryPolicy | None = None
_lock = threading.Lock()
_counts: Counter = Counter()  # this process's failures by kind, "retried" and "recovered" requests
_reached: set[str] = set()  # roots (scheme://bucket) that answered a request in this process
_down: dict[str, str] = {}  # roots whose last request gave up after its deadline -> what it said


def policy() -> RetryPolicy:
    """The policy in force: `set_policy`'s, else the default with ACTSTORE_RETRY_SECONDS."""
    if _policy is not None:
        return _policy
    env = os.environ.get(DEADLINE_ENV)
    try:
        return RetryPolicy(deadline_s=float(env)) if env else RetryPolicy()
    except ValueError:
        raise StorageAccessError(f"{DEADLINE_ENV} must be a number of seconds, got {env!r}") from None


def set_policy(p: RetryPolicy | None) -> None:
    """Use `p` for every request of this process (None: back to the default)."""
    global _policy
    _policy = p


def counts() -> dict[str, int]:
    """This process's connection failures by kind (reset, cut, timeout, refused,
    unresolved), `retried` (tries repeated) and `recovered` (requests that then succeeded)."""
    with _lock:
        return {k: _counts.get(k, 0) for k in ("retried", "recovered", *LABELS)}


def counts_since(before: dict[str, int], *others: dict[str, int]) -> dict[str, int]:
    """This process's counts minus `before` (what one run added), plus the `others` (the
    counts of runs in other processes, which this one never saw)."""
    now = counts()
    return {k: now[k] - before.get(k, 0) + sum(o.get(k, 0) for o in others) for k in now}


def reset_counts() -> None:
    with _lock:
        _counts.clear()
        _down.clear()


def kind(e: BaseException) -> str | None:
    """The connection-level failure `e` is (a key of LABELS), or None: not ours to retry
    (a 4xx/5xx answer obstore already retried, a missing key, refused credentials...)."""
    if not (type(e).__module__ or "").startswith("obstore") and not isinstance(e, (ConnectionError, TimeoutError)):
        return None
    if isinstance(e, (FileNotFoundError, PermissionError)) or "status code" in str(e).lower().replace("_", " "):
        return None
    text = str(e).lower()
    for needle, k in _KINDS:
        if needle in text:
            return k
    return "timeout" if isinstance(e, TimeoutError) else "reset" if isinstance(e, ConnectionError) else None


def reached() -> set[str]:
    """The roots (scheme://bucket) that answered a request in this process."""
    with _lock:
        return set(_reached)


def last_cause(e: BaseException) -> str:
    """The innermost cause in obstore's text, e.g. `Connection reset by peer`."""
    found = [a or b for a, b in _MESSAGE.findall(str(e))]
    if found:
        return found[-1]
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


class _Attempts:
    """One request's tries: what failed, whether to go on, how long to wait."""

    def __init__(self, root: str, deadline_s: float | None = None):
        self.root, self.p, self.start = root, policy(), time.monotonic()
        with _lock:
            self.down = _down.get(root)  # an earlier request gave up: one try, no retries
        if self.down is not None:
            deadline_s = 0.0
        if deadline_s is not None and deadline_s < self.p.deadline_s:
            self.p = RetryPolicy(
                deadline_s=deadline_s,
                attempts=self.p.attempts,
                first_wait_s=self.p.first_wait_s,
                max_wait_s=self.p.max_wait_s,
            )
        self.failures: Counter = Counter()
        self.n = 0

    def failed(self, e: BaseException, what: str, where: str) -> float:
        """Count `e`; the seconds to wait before the next try, or raise: not retryable
        (`e` itself) or out of tries (StorageAccessError)."""
        k = kind(e)
        if k is None or (k in _UNREACHED and self.root not in _reached):
            raise e
        self.failures[k] += 1
        self.n += 1
        wait = min(self.p.max_wait_s, self.p.first_wait_s * 2 ** (self.n - 1)) * random.uniform(0.5, 1.0)
        elapsed = time.monotonic() - self.start
        with _lock:
            _counts[k] += 1
        if self.n >= self.p.attempts or elapsed + wait > self.p.deadline_s:
            err = self.gave_up(e, what, where, elapsed)
            if self.down is None:
                with _lock:
                    _down[self.root] = f"cannot {what} {where} after {elapsed:.0f} s of retries"
            raise err from None
        with _lock:
            _counts["retried"] += 1
        return wait

    def succeeded(self) -> None:
        with _lock:
            _reached.add(self.root)
            _down.pop(self.root, None)
            if self.failures:
                _counts["recovered"] += 1

    def gave_up(self, e: BaseException, what: str, where: str, elapsed: float) -> StorageAccessError:
        if self.down is not None:
            return StorageAccessError(
                f"cannot {what} {where}: the endpoint stopped answering ({self.down}; tried once more now: "
                f"{last_cause(e)}); not retried again until it answers. Try again later, or let requests retry "
                f"longer ({DEADLINE_ENV}, now {policy().deadline_s:g} s)"
            )
        total = sum(self.failures.values())
        kinds = ", ".join(f"{n} {LABELS[k] if n > 1 else ONE[k]}" for k, n in self.failures.most_common())
        return StorageAccessError(
            f"cannot {what} {where}: {total} connection failure{'s' if total > 1 else ''} in {elapsed:.1f} s ({kinds}); "
            f"the last: {last_cause(e)}. The endpoint answered before, so the network or the server failed, not the "
            f"configuration; try again later, or let requests retry longer ({DEADLINE_ENV}, now {self.p.deadline_s:g} s)"
        )


def call(fn: Callable[[], T], *, what: str, where: str, root: str, deadline_s: float | None = None) -> T:
    """`fn()`, tried again on connection-level failures (see the module's text).

    Args:
        fn: the request; called again from the start on each try (it must be idempotent).
        what, where: for the error (`cannot {what} {where}: ...`).
        root: the endpoint's identity (scheme://bucket): whether it answered before.
        deadline_s: a shorter deadline than the policy's (a quick check).
    """
    tries = _Attempts(root, deadline_s)
    while True:
        try:
            out = fn()
        except Exception as e:
            time.sleep(tries.failed(e, what, where))
            continue
        tries.succeeded()
        return out


async def acall(make: Callable[[], Awaitable[T]], *, what: str, where: str, root: str) -> T:
    """`call` for coroutines: `make()` builds a fresh one for each try."""
    tries = _Attempts(root)
    while True:
        try:
            out = await make()
        except Exception as e:
            await asyncio.sleep(tries.failed(e, what, where))
            continue
        tries.succeeded()
        return out


def retried(what: str) -> Callable:
    """Decorate an ObjectStorage method (first argument: a key) whose request may be sent
    again as it is: each call goes through `call`, named by the object's URL."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kw: Any) -> Any:
            where = self.where(args[0]) if args and isinstance(args[0], str) else self.url
            return call(lambda: fn(self, *args, **kw), what=what, where=where, root=root_of(self.url))

        return method

    return deco


def root_of(url: str) -> str:
    """`s3://bucket/a/b` -> `s3://bucket`: what 'the endpoint answered' is known for."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def note() -> str:
    """The progress bars' note: `N network retries` once there were any, else ''."""
    c = counts()
    n = sum(c[k] for k in LABELS)
    return f"{n} network retries" if n else ""


add_note(note)
