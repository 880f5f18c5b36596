"""Library messages in the command line's words: where a message names a Python argument
(`overwrite=True (--overwrite)`, `pass dataset (--dataset)`, `resume=True`), the CLI prints
the flag the user can type, and only the flag."""

from __future__ import annotations

import re

import click

_ARG_THEN_FLAG = re.compile(r"\b[a-z_]+=[^\s()]+ \(`?(--[a-z][\w-]*(?: [A-Z]+)?)`?\)")
_PASS_ARG_FLAG = re.compile(r"\bpass ([a-z_]+) \((--[a-z][\w-]*)\)")
_BOOL_ARG = re.compile(r"\b([a-z_]+)=True\b")


def cli_words(message: str, command: click.Command | None) -> str:
    """`message` with Python arguments replaced by the flags of `command` that set them."""
    message = _ARG_THEN_FLAG.sub(r"\1", message)
    message = _PASS_ARG_FLAG.sub(r"pass \2", message)
    flags = {o for p in (command.params if command else []) for o in getattr(p, "opts", [])}

    def flag(m: re.Match) -> str:
        f = "--" + m.group(1).replace("_", "-")
        return f if f in flags else m.group(0)

    return _BOOL_ARG.sub(flag, message)
