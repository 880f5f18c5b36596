"""Claims of the docs that a code block cannot check, checked against the code: the
signatures docs/api.md spells out."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import actstore

ROOT = Path(__file__).resolve().parents[1]


def _spelled(fn) -> str:
    """`fn`'s parameters as the docs spell them: name=default, `*` before keyword-only ones."""
    out, star = [], False
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # (self)
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


@pytest.mark.parametrize("name,fn", [("append", actstore.ShardWriter.append)])
def test_api_doc_spells_the_signature(name, fn):
    text = (ROOT / "docs" / "api.md").read_text()
    m = re.search(rf"`{name}\((.*?)\) ->", text, re.S)
    assert m, f"docs/api.md has no `{name}(...) ->` signature"
    assert " ".join(m.group(1).split()) == _spelled(fn)
