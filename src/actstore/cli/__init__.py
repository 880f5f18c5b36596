"""The `actstore` command: a thin click group; each feature module registers its commands.

A module `actstore/cli/<name>.py` listed in COMMAND_MODULES defines `register(main)`. Every
command follows the grammar of actstore/cli/grammar.py; `--help` lists the commands by
SECTIONS.
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
    "spool",
)

# The top-level help's sections, in order. A command not named here goes by its name's
# prefix (export-*, import-*, verify*); tests/test_cli_grammar.py fails on one left over.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Capture": ("write", "finalize"),
    "Inspect": ("info", "spool"),
    "Views": ("show", "features", "view"),
    "Exports": ("export-saev", "export-saelens", "export-pkl", "export-neuronpedia", "link-run", "cp"),
    "Imports": ("import-saev", "import-pkl", "import-activault", "import-saelens", "import-dictionary-learning"),
    "Integrity": ("verify", "verify-saev"),
    "Developer tools": ("bench",),
}
_PREFIXES = {"export-": "Exports", "import-": "Imports", "verify": "Integrity"}
OTHER = "Other"


def section_of(name: str) -> str:
    """The help section of command `name` (OTHER when neither SECTIONS nor its prefix places it)."""
    for section, names in SECTIONS.items():
        if name in names:
            return section
    return next((s for p, s in _PREFIXES.items() if name.startswith(p)), OTHER)


class _Group(click.Group):
    """Maps actstore's errors to a one-line message and exit code 1 (no traceback), names
    every missing option at once, and lists the commands by section."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and not ctx.resilient_parsing:
            from actstore.cli.grammar import check_missing

            check_missing(cmd, name, rest, ctx)
        return name, cmd, rest

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = [n for n in self.list_commands(ctx) if not self.get_command(ctx, n).hidden]
        order = [n for section in SECTIONS.values() for n in section]
        names.sort(key=lambda n: (order.index(n) if n in order else len(order), n))
        limit = formatter.width - 6 - max(map(len, names), default=0)
        for section in [*SECTIONS, OTHER]:
            rows = [(n, self.get_command(ctx, n).get_short_help_str(limit)) for n in names if section_of(n) == section]
            if rows:
                with formatter.section(section):
                    formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:  # an optional package: one line naming the extra that installs it
            from actstore.cli.grammar import missing_module

            said = missing_module(ctx.invoked_subcommand, e)
            if said is None:
                raise
            click.echo(f"actstore: error: {said}", err=True)
            sys.exit(1)
        except (ActstoreError, OSError, ValueError) as e:  # bad input or a failing disk: one line, no traceback
            from actstore.cli.wording import cli_words

            sub = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            said = "; ".join([str(e), *getattr(e, "__notes__", ())])  # a note: what a failed write left
            click.echo(f"actstore: error: {cli_words(said, sub)}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="actstore")
def main() -> None:
    """actstore: capture, store, read, view and export transformer activations.

    A store is a folder (or an object-store URL): manifest.json plus one Zarr group per
    writer under shards/. Typical flow: `actstore write` (or ShardWriter in your own loop;
    finalized unless --no-finalize), `actstore info`, then `actstore features` and
    `actstore view` to look at features, read with actstore.open, or export with
    `actstore export-saev` / `export-saelens`.

    Every command takes --quiet and --json; one that derives files names them with
    --out/-o and refuses an existing output unless --overwrite (docs/cli.md).
    """


for _name in COMMAND_MODULES:
    if importlib.util.find_spec(f"actstore.cli.{_name}") is not None:
        importlib.import_module(f"actstore.cli.{_name}").register(main)

from actstore.cli.grammar import guard_extras  # noqa: E402 - after every command is registered
from actstore.cli.params import bound_integers  # noqa: E402

bound_integers(main)
guard_extras(main)
