"""Click parameter types shared by the commands."""

from __future__ import annotations

import math

import click

from actstore.storage import is_url
from actstore.write.options import MAX_THREADS  # --workers, --threads, --writer-threads of one process


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


class Device(click.ParamType):
    """A --device: actstore.devices.parse_device's values, checked before the command runs
    (a usage error naming the value and the allowed ones). `visible=False` checks only the
    spelling: `write --runner ray` places models on the workers' devices, checked there."""

    name = "device"

    def __init__(self, *, auto: bool = False, visible: bool = True):
        self.auto, self.visible = auto, visible

    def convert(self, value, param, ctx):  # noqa: D102
        from actstore.devices import parse_device
        from actstore.errors import DeviceError

        try:
            return parse_device(value, name="--device", auto=self.auto, visible=self.visible)
        except DeviceError as e:
            hint = None if param is not None else "'--device'"  # (called by a command, after parsing)
            raise click.BadParameter(str(e).removeprefix("--device "), ctx, param, hint) from None


DEVICE = Device()
DEVICE_OR_AUTO = Device(auto=True)
DEVICE_SPELLING = Device(visible=False)


class FiniteFloat(click.ParamType):
    """A finite number in [low, high], or (low, high] with `open_low` (click's FLOAT takes
    inf and nan, which no option here means): a usage error naming the range otherwise."""

    name = "float"

    def __init__(self, low: float, high: float = math.inf, *, open_low: bool = False):
        self.low, self.high, self.open_low = low, high, open_low

    def convert(self, value, param, ctx):  # noqa: D102
        x = click.FLOAT.convert(value, param, ctx)
        if not (math.isfinite(x) and (self.low < x if self.open_low else self.low <= x) and x <= self.high):
            lo = f"({self.low:g}" if self.open_low else f"[{self.low:g}"
            hi = f"{self.high:g}]" if math.isfinite(self.high) else "inf)"
            self.fail(f"{value!r} is not a finite number in {lo}, {hi}", param, ctx)
        return x


INT64_MAX = 2**63 - 1


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
                    threads = param.name in ("workers", "threads", "writer_threads")
                    param.type = BoundedInt(MAX_THREADS if threads else INT64_MAX)
