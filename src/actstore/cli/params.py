"""Click parameter types shared by the commands."""

from __future__ import annotations

import click

from actstore.storage import is_url


class StoreLocation(click.ParamType):
    """A store: a local folder (checked like click.Path) or an object-store URL
    (s3://, gs://, az://), passed on as given."""

    name = "store"

    def __init__(self, *, exists: bool = False):
        self.exists = exists
        self._path = click.Path(exists=exists, file_okay=False)

    def convert(self, value, param, ctx):  # noqa: D102
        text = str(value)
        if is_url(text):
            return text
        return self._path.convert(text, param, ctx)


STORE = StoreLocation(exists=True)
NEW_STORE = StoreLocation(exists=False)


INT64_MAX = 2**63 - 1
MAX_THREADS = 256  # --workers / --threads of one process: beyond this a value is a typo


class BoundedInt(click.types.IntParamType):
    """click's INTEGER, bounded: a value beyond int64 (or, for a thread count, beyond
    MAX_THREADS) is a usage error naming the option, not an OverflowError or a hang."""

    def __init__(self, maximum: int = INT64_MAX):
        self.maximum = maximum

    def convert(self, value, param, ctx):  # noqa: D102
        n = super().convert(value, param, ctx)
        if not -INT64_MAX - 1 <= n <= self.maximum:
            name = param.opts[0] if param is not None and param.opts else "the value"
            at_most = f" (at most {self.maximum})" if self.maximum != INT64_MAX else ""
            self.fail(f"{name}: {n} is too large{at_most}", param, ctx)
        return n


def bound_integers(group: click.Group) -> None:
    """Give every plain integer option of every command of `group` a BoundedInt type."""
    from actstore.layout import spec

    for command in group.commands.values():
        for param in command.params:
            if type(param.type) is click.types.IntParamType:
                if command.name == "write" and param.name == "workers":  # writers (Ray actors too), not threads
                    param.type = BoundedInt(spec.MAX_WORLD_SIZE)
                else:
                    param.type = BoundedInt(MAX_THREADS if param.name in ("workers", "threads") else INT64_MAX)
