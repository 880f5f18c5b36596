"""`actstore finalize` and `actstore info`."""

from __future__ import annotations

import json

import click

from actstore.cli.params import STORE

from actstore.info import store_info, format_info
from actstore.manifest import finalize


def register(main: click.Group) -> None:
    main.add_command(finalize_cmd)
    main.add_command(info_cmd)


@click.command("finalize")
@click.argument("store", type=STORE)
@click.option("--allow-partial", is_flag=True, help="Also publish the committed prefix of shards whose writer never closed.")
def finalize_cmd(store: str, allow_partial: bool) -> None:
    """Merge the committed writer shards of STORE into its manifest.json.

    Run it once every writer has closed; it is safe to run again (the manifest is
    replaced atomically). Readers see only finalized shards.
    """
    m = finalize(store, allow_partial=allow_partial)
    click.echo(f"finalized {store}: {m.n_examples} examples in {len(m.shards)} shards")


@click.command("info")
@click.argument("store", type=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info_cmd(store: str, as_json: bool) -> None:
    """Describe STORE: examples, layers, segments, shapes, dtype, sizes, truncation, shards."""
    info = store_info(store)
    click.echo(json.dumps(info, indent=1) if as_json else format_info(info))
