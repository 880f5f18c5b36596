"""docs/reliability.md states the rule, the threats and the limits; each limit it names is a
constant of the code with exactly the value the document gives."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
ROW = re.compile(r"^\| `(actstore\.[\w.]+)\.([A-Z_][A-Z0-9_]*)` \| (\d+) \|", re.M)


def test_the_rule_the_threats_and_the_limits_are_stated():
    for heading in ("## The rule", "## Threats", "## Limits as named constants", "## What is not covered"):
        assert f"\n{heading}\n" in DOC
    assert "**Any input actstore reads either reads exactly or raises actstore's own error**" in DOC


def test_every_named_limit_is_the_codes():
    rows = ROW.findall(DOC)
    assert len(rows) >= 10
    for module, name, value in rows:
        assert getattr(importlib.import_module(module), name) == int(value), f"{module}.{name}"
