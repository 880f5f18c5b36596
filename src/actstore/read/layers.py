"""The one layer parser: what every command and API accepts as a layer of a store.

A layer is a stored layer number (the model's block index), a negative number counting
from the last stored layer (-1: the last), or one of the names the capture kept
(TransformerLens hook names such as `blocks.8.hook_resid_post`, module paths such as
`model.layers.8`); a string of digits is a number. Anything else (a float, a bool) is
refused, never truncated to another layer; a misspelled name gets the closest names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from actstore.errors import LayerNotFoundError, LayerTypeError

_NUMBER = re.compile(r"[+-]?\d+")


def resolve_layer(value: Any, stored: Sequence[int], names: Mapping[str, int]) -> int:
    """The stored layer number `value` means (see the module docstring)."""
    stored = [int(x) for x in stored]
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, str):
        if value in names:
            return int(names[value])
        close = difflib.get_close_matches(value, list(names), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise LayerNotFoundError(
            f"no stored layer is named {value!r}{hint} This store holds layers {stored}"
            + (f", named {sorted(names)}" if names else " (it keeps no layer names: give a number)")
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise LayerTypeError(
            f"layer {value!r} is not a layer: give a stored layer number (an int), a negative number counting from "
            f"the last stored layer, or a name; this store holds layers {stored}"
        )
    n = int(value)
    if n in stored:
        return n
    if -len(stored) <= n < 0:
        return stored[n]
    counts = f" (-1 to -{len(stored)} count back from the last)" if len(stored) > 1 else " (-1 is the last)"
    raise LayerNotFoundError(f"layer {n} is not stored; this store holds layers {stored}{counts}")


def parse_layer_list(text: str) -> list[int | str]:
    """A command line's comma-separated layers: numbers (as ints) and names (as strings)."""
    return [int(x) if _NUMBER.fullmatch(x) else x for x in (p.strip() for p in text.split(",")) if x]


_NUMBER_IN_NAME = re.compile(r"(?:^|\.)(?:blocks|layers|layer|h)\.(\d+)(?:\.|$)")


def number_in_name(name: str) -> int | None:
    """The block number a layer name carries (`blocks.8.hook_resid_post`, `model.layers.8.mlp`,
    `transformer.h.8` -> 8), or None: how a new store numbers a layer given by name."""
    m = _NUMBER_IN_NAME.search(name)
    return int(m.group(1)) if m else None
