"""A counter on the non-finite screen (tests of the writer's two doors): every path of
actstore.dtypes.convert and count_nonfinite goes through these two functions."""

from __future__ import annotations

from actstore import dtypes


def count_screens(monkeypatch) -> list[int]:
    """Count the calls of the screen from now on (in calls[0]); monkeypatch.undo() stops it."""
    calls = [0]
    for name in ("count_nonfinite_16", "_count_nonfinite"):
        real = getattr(dtypes, name)

        def counted(x, _real=real):
            calls[0] += 1
            return _real(x)

        monkeypatch.setattr(dtypes, name, counted)
    return calls
