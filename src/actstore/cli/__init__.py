"""The `actstore` command: a thin click group; each feature module registers its commands.

A module `actstore/cli/<name>.py` listed in COMMAND_MODULES defines `register(main)`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from actstore._version import __version__
from actstore.errors import ActstoreError

COMMAND_MODULES = (
    "core",
    "capture",
    "saev",
    "saelens",
    "integrity",
    "loaders",
    "bench",
    "remote",
    "importers",
    "features",
    "views",
)


class _Group(click.Group):
    """Maps actstore's errors to a one-line message and exit code 1 (no traceback)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (ActstoreError, OSError, ValueError) as e:  # bad input or a failing disk: one line, no traceback
            from actstore.cli.wording import cli_words

            sub = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            click.echo(f"actstore: error: {cli_words(str(e), sub)}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="actstore")
def main() -> None:
    """actstore: capture, store, read and export transformer activations.

    A store is a folder: manifest.json plus one Zarr group per writer under shards/.
    Typical flow: `actstore write` (or ShardWriter in your own loop), `actstore finalize`,
    `actstore info`, then read with actstore.ActStore or export with `actstore export-saev`.
    """


for _name in COMMAND_MODULES:
    if importlib.util.find_spec(f"actstore.cli.{_name}") is not None:
        importlib.import_module(f"actstore.cli.{_name}").register(main)

from actstore.cli.params import bound_integers  # noqa: E402 - after every command is registered

bound_integers(main)
