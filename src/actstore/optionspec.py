"""Options as dataclass fields that carry their own help: each default and help spelled once.

`option(default, help, ...)` is a dataclass field whose metadata holds what a command line
needs to offer it; actstore.cli.fields builds the click option from it, so the option's
default is the field's and its help is written here, beside the field:

    batch_size: int = option(8, "Examples per forward pass.", section="The model", show_default=True)

A field made with plain `field()` (or a bare default) has no command-line option.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field
from typing import Any, TypedDict, Unpack

META = "actstore.option"  # the key of a field's metadata that holds its OptionSpec


@dataclass(frozen=True, kw_only=True)
class OptionSpec:
    """How a command line offers one field (the default is the field's own).

    Attributes:
        help: the --help text.
        section: the heading the option is listed under (actstore.cli.sections).
        flag: the option's name; None: `--` + the field's name with dashes. A bool field
            whose default is True is offered as a flag that turns it off (`--no-stats`).
        choices: the allowed values (a click Choice; int choices are parsed back to int).
        kind: a value type the CLI knows by name: "device" (a --device spelling),
            "layers" (numbers, ranges and names), "int_or_auto" (an int or "auto").
        low, high, open_low: the allowed range of a number (low excluded with open_low).
        scale: the field counts units of 1/scale of the option's (--commit-mb: bytes = MB * 2**20).
        show_default: show the default in --help (True), a word for it, or not (False).
        required: the command line must give it (the field's default serves Python callers).
        hidden: left out of --help (a deprecated spelling).
        multiple: the option may repeat; the field holds a tuple.
    """

    help: str
    section: str | None = None
    flag: str | None = None
    choices: tuple[Any, ...] = ()
    kind: str | None = None
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    scale: int = 1
    show_default: bool | str = False
    required: bool = False
    hidden: bool = False
    multiple: bool = False


class SpecKeywords(TypedDict, total=False):
    """OptionSpec's attributes but `help`, as option()'s keywords."""

    section: str | None
    flag: str | None
    choices: tuple[Any, ...]
    kind: str | None
    low: float | None
    high: float | None
    open_low: bool
    scale: int
    show_default: bool | str
    required: bool
    hidden: bool
    multiple: bool


def option(default: Any, help: str, **cli: Unpack[SpecKeywords]) -> Any:
    """A dataclass field with `default` and a command-line option (OptionSpec's attributes)."""
    return field(default=default, metadata={META: OptionSpec(help=help, **cli)})


def spec_of(f: Field) -> OptionSpec | None:
    """The OptionSpec of a dataclass field; None for a field with no command-line option."""
    return f.metadata.get(META)


# -- the checks every options value makes ---------------------------------------------------


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_positive(
    value: Any, names: tuple[str, ...], n: Any, error: type[Exception], *, optional: bool = False
) -> None:
    """Each field of `names` on `value` is a positive int (or None, with `optional`);
    `n` spells a field's name as the caller did (`--batch-size` or `batch_size`)."""
    for name in names:
        v = getattr(value, name)
        if (v is not None or not optional) and (not is_int(v) or v < 1):
            raise error(f"{n(name)} must be a positive int. Got {v!r}.")
