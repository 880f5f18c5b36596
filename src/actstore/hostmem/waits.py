"""BoundedQueue: a bounded queue whose waits are woken by a condition, never by polling.

A `put` waits for room, a `get` for an item; both wake at once when the other side
acts, when the queue is stopped (`stop`: both sides give up) or failed (`fail(e)`: the
producers get `e` raised; the consumer still takes what is queued). `close` ends the
stream of items: `get` returns `ENDED` once the queued ones are taken.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

ENDED = object()  # what `get` returns once the queue is stopped, or closed and empty


class BoundedQueue:
    """Up to `maxsize` items (0: unbounded) between producer and consumer threads."""

    def __init__(self, maxsize: int = 0):
        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0. Got {maxsize!r}.")
        self.maxsize = maxsize
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self.stopped = False
        self.closed = False
        self.error: BaseException | None = None

    def put(self, item: Any) -> bool:
        """Queue `item`, waiting for room; False once stopped (the item is not queued).
        Raises the error given to `fail`."""
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self.stopped:
                    return False
                if not self.maxsize or len(self._items) < self.maxsize:
                    self._items.append(item)
                    self._cond.notify_all()
                    return True
                self._cond.wait()

    def get(self) -> Any:
        """The next item, waiting for one; ENDED once stopped, or closed with none left."""
        with self._cond:
            while True:
                if self.stopped:
                    return ENDED
                if self._items:
                    item = self._items.popleft()
                    self._cond.notify_all()
                    return item
                if self.closed:
                    return ENDED
                self._cond.wait()

    def close(self) -> None:
        """No more items: `get` returns ENDED once the queued ones are taken."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def stop(self) -> None:
        """Both sides give up now: waiting puts return False, gets ENDED."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Producers get `error` raised (at once, if waiting); the consumer goes on."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def clear(self) -> list[Any]:
        """Take every queued item (without waiting)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
