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
@click.option(
    "--allow-partial",
    is_flag=True,
    help="Publish what is committed though shards or ranks are unfinished (recorded as partial).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@click.option("--quiet", is_flag=True, help="Print nothing on success.")
def finalize_cmd(store: str, allow_partial: bool, as_json: bool, quiet: bool) -> None:
    """Merge the committed writer shards of STORE into its manifest.json.

    Run it once every writer has closed; it is safe to run again (the manifest is
    replaced atomically). Readers see only finalized shards.
    """
    m = finalize(store, allow_partial=allow_partial)
    if as_json:
        partial = (
            {"missing_ranks": list(m.partial.missing_ranks), "incomplete_shards": list(m.partial.incomplete_shards)}
            if m.partial
            else None
        )
        click.echo(
            json.dumps(
                {
                    "store": str(store),
                    "examples": m.n_examples,
                    "shards": [s.shard for s in m.shards],
                    "world_size": m.world_size,
                    "partial": partial,
                }
            )
        )
    elif not quiet:
        click.echo(
            f"finalized {store}: {m.n_examples} examples in {len(m.shards)} shards"
            + (" (PARTIAL)" if m.partial else "")
        )


@click.command("info")
@click.argument("store", type=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--quiet", is_flag=True, help="Print nothing: the exit code says whether the store opens.")
@click.option(
    "--plots",
    "plots_dir",
    type=click.Path(file_okay=False),
    help="Also write plots (token norms per layer, norm by position) as SVG into this folder.",
)
@click.option(
    "--plot-examples",
    type=int,
    default=1000,
    show_default=True,
    help="Examples read for --plots, spread evenly over the store.",
)
def info_cmd(store: str, as_json: bool, quiet: bool, plots_dir: str | None, plot_examples: int) -> None:
    """Describe STORE: examples, layers, segments, shapes, dtype, sizes, truncation, shards."""
    info = store_info(store)
    if plots_dir:
        from actstore.features.plots import write_plots
        from actstore.opener import open as open_store

        info["plots"] = [str(p) for p in write_plots(open_store(store), plots_dir, max_examples=plot_examples)]
    if quiet:
        return
    click.echo(
        json.dumps(info, indent=1)
        if as_json
        else format_info(info) + (f"\nplots: {plots_dir}/plots.html" if plots_dir else "")
    )
