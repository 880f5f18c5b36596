"""`actstore finalize` and `actstore info`."""

from __future__ import annotations

import json

import click

from actstore.cli.params import STORE

from actstore.read.info import store_info, format_info
from actstore.write.finalize import finalize


def register(main: click.Group) -> None:
    main.add_command(finalize_cmd)
    main.add_command(info_cmd)


@click.command("finalize")
@click.argument("store", type=STORE)
@click.option("--allow-partial", is_flag=True, help="Publish what is committed though shards or ranks are unfinished (recorded as partial).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@click.option("--quiet", is_flag=True, help="Print nothing on success.")
def finalize_cmd(store: str, allow_partial: bool, as_json: bool, quiet: bool) -> None:
    """Merge the committed writer shards of STORE into its manifest.json.

    Run it once every writer has closed; it is safe to run again (the manifest is
    replaced atomically). Readers see only finalized shards.
    """
    m = finalize(store, allow_partial=allow_partial)
    if as_json:
        partial = {"missing_ranks": list(m.partial.missing_ranks), "incomplete_shards": list(m.partial.incomplete_shards)} if m.partial else None
        click.echo(json.dumps({"store": str(store), "examples": m.n_examples, "shards": [s.shard for s in m.shards],
                               "world_size": m.world_size, "partial": partial}))
    elif not quiet:
        click.echo(f"finalized {store}: {m.n_examples} examples in {len(m.shards)} shards" + (" (PARTIAL)" if m.partial else ""))


@click.command("info")
@click.argument("store", type=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--quiet", is_flag=True, help="Print nothing: the exit code says whether the store opens.")
def info_cmd(store: str, as_json: bool, quiet: bool) -> None:
    """Describe STORE: examples, layers, segments, shapes, dtype, sizes, truncation, shards."""
    info = store_info(store)
    if quiet:
        return
    click.echo(json.dumps(info, indent=1) if as_json else format_info(info))
