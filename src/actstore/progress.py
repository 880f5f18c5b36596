"""Progress bars that suit where they go: a live tqdm bar on a terminal, plain periodic lines
(one every PIPE_INTERVAL seconds, with rate and ETA, the first after PIPE_INTERVAL seconds)
when stderr is a pipe or a log file, so a job log is not flooded with carriage-return updates."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

PIPE_INTERVAL = 10.0  # seconds between lines when stderr is not a terminal

_notes: list[Callable[[], str]] = []  # what lower layers add to every bar (e.g. network retries)


def add_note(fn: Callable[[], str]) -> None:
    """Show `fn()` after every bar's counts (when not empty), refreshed as the bar moves."""
    if fn not in _notes:
        _notes.append(fn)


def notes() -> str:
    return ", ".join(s for s in (fn() for fn in _notes) if s)


def say(line: str) -> None:
    """One line on stderr before a command's bar (what it reads, e.g. its token mask)."""
    print(line, file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """One `actstore: warning: ...` line on stderr (the commands' warnings, library or CLI)."""
    say(f"actstore: warning: {message}")


class _Lines:
    """A stream for tqdm that turns its carriage-return redraws into whole lines."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip("\n")
        if s.strip():
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(**kw: Any) -> Any:
    """A tqdm bar (same arguments) on stderr: live on a terminal, periodic lines otherwise."""
    stream = kw.pop("file", None) or sys.stderr
    if not getattr(stream, "isatty", lambda: False)():
        kw["mininterval"] = max(kw.get("mininterval", 0.1), PIPE_INTERVAL)
        kw.setdefault("delay", PIPE_INTERVAL)  # work shorter than that prints nothing
        kw["maxinterval"] = max(kw.get("maxinterval", 10.0), PIPE_INTERVAL)
        kw.pop("dynamic_ncols", None)
        kw.setdefault("ncols", 100)
        kw["ascii"] = True
        stream = _Lines(stream)
    return _bar_class()(file=stream, **kw)


def updater(progress: Any, total: int, desc: str, unit: str) -> Callable[[int], Any] | None:
    """What a long function with a `progress` argument calls as it goes: `progress` itself
    when it is a callable, a new bar's `update` when it is true, else None."""
    if callable(progress):
        return progress
    return bar(total=total, desc=desc, unit=unit).update if progress else None


_BAR = None


def _bar_class() -> type:
    """tqdm whose postfix carries `notes()` (built on first use: tqdm imports slowly)."""
    global _BAR
    if _BAR is None:
        from tqdm import tqdm

        class Bar(tqdm):
            _note = ""  # notes() when last shown
            _own = ""  # what the bar's owner set as postfix

            def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
                self._own = str(s)
                self._show(refresh)

            def update(self, n: float = 1) -> bool | None:
                note = notes()
                if note != self._note:
                    self._note = note
                    self._show(False)
                return super().update(n)

            def _show(self, refresh: bool) -> None:
                tqdm.set_postfix_str(self, ", ".join(x for x in (self._own, self._note) if x), refresh=refresh)

        _BAR = Bar
    return _BAR
