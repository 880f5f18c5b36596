"""Click options generated from an options value's fields (actstore.optionspec): each
option's default is its field's and its help is the field's OptionSpec.help, so neither is
written again here. A generated click option remembers its field (`param.field`), which
tests/test_cli_options.py reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, fields
from typing import Any

import click

from actstore.cli.params import DEVICE_SPELLING, FiniteFloat
from actstore.cli.sections import section_option
from actstore.optionspec import OptionSpec, spec_of

_TYPES = {"int": int, "float": float, "str": str}


class IntOrAuto(click.ParamType):
    """A positive int, or the word "auto" (the field's automatic choice)."""

    name = "integer|auto"

    def convert(self, value, param, ctx):  # noqa: D102
        if value == "auto":
            return value
        return click.INT.convert(value, param, ctx)


def field_options(cls: type, names: Sequence[str], **attrs: dict[str, Any]) -> Callable:
    """Decorator: a click option for each field of `cls` named in `names`, listed in --help
    in that order; `attrs[name]` adds click attributes to one (e.g. a callback)."""
    by_name = {f.name: f for f in fields(cls)}

    def deco(f: Callable) -> Callable:
        for name in reversed(names):  # click lists the decorator applied last first
            f = field_option(by_name[name], **attrs.get(name, {}))(f)
        return f

    return deco


def field_option(f: Field, **attrs: Any) -> Callable:
    """Decorator: the click option of field `f` (parameter name: the field's)."""
    spec = spec_of(f)
    if spec is None:
        raise ValueError(f"field {f.name} has no OptionSpec (actstore.optionspec.option): it is no option")
    if f.default is MISSING:
        raise ValueError(f"field {f.name} has no default: an option's default is its field's")
    dashed = f.name.replace("_", "-")
    kw: dict[str, Any] = {"help": spec.help, "hidden": spec.hidden}
    if isinstance(f.default, bool):
        kw.update(is_flag=True, default=f.default)
        if f.default:  # on by default: a flag that turns it off
            kw["flag_value"] = False
        flag = spec.flag or ("--no-" if f.default else "--") + dashed
    else:
        flag = spec.flag or "--" + dashed
        kw.update(type=_param_type(f, spec), show_default=spec.show_default, multiple=spec.multiple)
        if spec.required:
            kw["required"] = True
        else:
            kw["default"] = to_option(spec, f.default)
        if spec.scale != 1 or any(isinstance(c, int) for c in spec.choices):
            kw["callback"] = lambda _ctx, _param, value: to_field(spec, value)
    kw.update(attrs)
    decorator = section_option(spec.section or "Options", flag, f.name, **kw)

    def deco(fn: Callable) -> Callable:
        fn = decorator(fn)
        fn.__click_params__[-1].field = f
        return fn

    return deco


def to_option(spec: OptionSpec, value: Any) -> Any:
    """A field's value as its option gives it (bytes -> MB, 3 -> "3")."""
    if value is None or isinstance(value, tuple):
        return value
    if spec.scale != 1:
        return value / spec.scale
    return str(value) if spec.choices and isinstance(value, int) else value


def to_field(spec: OptionSpec, value: Any) -> Any:
    """An option's value as its field holds it (MB -> bytes, at least 1; "3" -> 3)."""
    if value is None:
        return value
    if spec.scale != 1:
        return max(1, int(value * spec.scale))
    ints = {str(c): c for c in spec.choices if isinstance(c, int)}
    return ints.get(value, value) if ints else value


def _param_type(f: Field, spec: OptionSpec) -> Any:
    if spec.kind == "device":
        return DEVICE_SPELLING
    if spec.kind == "int_or_auto":
        return IntOrAuto()
    if spec.kind == "layers":
        return str
    if spec.choices:
        return click.Choice([str(c) for c in spec.choices])
    base = float if spec.scale != 1 else _TYPES[str(f.type).split("|")[0].strip()]  # (a scaled int: bytes in MB)
    if spec.low is not None or spec.high is not None:
        if base is int:
            return click.IntRange(spec.low, spec.high)
        high = math.inf if spec.high is None else spec.high
        return FiniteFloat(spec.low if spec.low is not None else -math.inf, high, open_low=spec.open_low)
    return base
