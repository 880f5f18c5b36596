"""What every read, verify and info of a damaged or hostile store must do, as helpers shared
by the hostile-input tests and the mutation property tests: give exactly the original
values or raise the project's own error (actstore.errors), within a time limit per call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from watchdog import within

import actstore
from actstore.errors import ActstoreError


def everything(path: Path | str) -> dict[str, Any]:
    """Every value a reader can give of a finalized store (or a saev directory): each
    (example, layer) in both its read paths, padded segments, lengths, per-sample fields,
    texts, statistics, token ids."""
    st = actstore.open(path)
    out: dict[str, Any] = {"n": len(st), "layers": list(st.layers)}
    for ex in range(len(st)):
        for layer in st.layers:
            out[f"x{ex},{layer}"] = np.array(st[ex, layer])
            for seg in st.segments:
                out[f"p{ex},{layer},{seg}"] = np.array(st.segment(seg).padded(ex, layer))
        out[f"len{ex}"] = st.lengths(ex)
    out["slab"] = np.array(st[:, st.layers[0]]) if all(_fixed(st)) else None
    if isinstance(st, actstore.ActStore):
        cfg = st.config
        for name in ["sample_key", *cfg.fields, *(s + "_len" for s in st.segments)]:
            out[f"f:{name}"] = np.array(st.field(name))
        if cfg.token_labels:
            for s in st.segments:
                out[f"f:{s}_token_labels"] = np.array(st.field(s + "_token_labels"))
        for name in cfg.texts:
            out[f"t:{name}"] = list(st.texts(name))
        stats = st.stats()
        out["stats"] = None if stats is None else stats.summary()
        out["ids"] = [st.token_ids(ex) for ex in range(len(st))] if cfg.token_ids else None
    elif st.config.token_labels:  # a saev directory with labels.bin
        out["f:labels"] = np.array(st.field("tokens_token_labels"))
    return out


def _fixed(st: Any) -> list[bool]:
    cfg = st.config
    return [s.fixed for s in cfg.segments]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `everything` results hold exactly the same values (NaN equal to NaN)."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (
                isinstance(x, np.ndarray)
                and isinstance(y, np.ndarray)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and np.array_equal(
                    x.view(np.uint8) if x.dtype.kind == "f" else x, y.view(np.uint8) if y.dtype.kind == "f" else y
                )
            ):
                return False
        elif k == "stats":
            if repr(x) != repr(y):
                return False
        elif k == "ids":
            if (x is None) != (y is None) or (x is not None and not all(np.array_equal(p, q) for p, q in zip(x, y))):
                return False
        elif x != y:
            return False
    return True


def outcome(fn, *args, limit: float = 5.0, what: str = "", **kw) -> tuple[str, Any]:
    """("ok", result) or ("error", the ActstoreError); any other exception, or a call running
    past `limit` seconds, fails the test (re-raised)."""
    with within(limit, what or getattr(fn, "__name__", "call")):
        try:
            return "ok", fn(*args, **kw)
        except ActstoreError as e:
            assert str(e), f"{what}: an actstore error without a message"
            return "error", e


def run_cli(*args: str, limit: float = 5.0) -> tuple[int, str]:
    """(exit code, output) of the actstore CLI run in-process: exit 0, 1 with a message
    (`actstore: error: ...`, or verify's report) or 2 with click's usage error (docs/cli.md);
    a traceback (any other exception) or a hang fails."""
    from actstore.cli import main

    with within(limit, f"actstore {' '.join(args)}"):
        r = CliRunner().invoke(main, list(args), catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"actstore {' '.join(args)} raised {r.exception!r}") from r.exception
    assert r.exit_code in (0, 1, 2), (r.exit_code, r.output)
    if r.exit_code == 2:  # a usage error: click's message naming the argument
        assert "Error: " in r.output, r.output
    if r.exit_code == 1:  # a one-line error, or a report (verify) that says what is wrong
        assert r.output.strip() and "Traceback" not in r.output, r.output
    return r.exit_code, r.output
