"""`actstore finalize` and `actstore info`."""

from __future__ import annotations

import json

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE
from actstore.read.info import format_info, store_info
from actstore.spoolstate import describe, read_state, spool_lines
from actstore.storage import open_storage
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
@G.quiet_json(quiet="Print nothing on success.", json="Print one JSON summary on stdout.")
def finalize_cmd(store: str, allow_partial: bool, as_json: bool, quiet: bool) -> None:
    """Merge the committed writer shards of STORE into its manifest.json.

    Run it once every writer has closed; it is safe to run again (the manifest is
    replaced atomically). Readers see only finalized shards.
    """
    m = finalize(store, allow_partial=allow_partial)
    spool = read_state(open_storage(store))  # a spool: what is kept, and the consumers still reading
    lagging = {n: k for n, k in spool.lags().items() if k} if spool is not None else {}
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
                    "spool": describe(spool) if spool is not None else None,
                }
            )
        )
    elif not quiet:
        click.echo(
            f"finalized {store}: {m.n_examples} examples in {len(m.shards)} shards"
            + (" (PARTIAL)" if m.partial else "")
        )
        if spool is not None:
            click.echo("\n".join(spool_lines(describe(spool))))
        if lagging:
            click.echo(
                "consumers still reading: "
                + ", ".join(f"{n} ({k} blocks to go)" for n, k in sorted(lagging.items()))
                + "; they continue until they have every block, and their blocks are removed as they acknowledge "
                "them (run `actstore spool gc` once they are done)"
            )


@click.command("info")
@click.argument("store", type=STORE)
@G.quiet_json(quiet="Print nothing: the exit code says whether the store opens.", json="Print machine-readable JSON.")
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
@click.option(
    "--examples", "n_texts", type=click.IntRange(0), default=0, help="Also print the first N examples' texts."
)
@click.option(
    "--tokenizer",
    help="With --examples: decode with this tokenizer (embedded:smollm2-135m, a cached hub id, a folder).",
)
def info_cmd(
    store: str,
    as_json: bool,
    quiet: bool,
    plots_dir: str | None,
    plot_examples: int,
    n_texts: int,
    tokenizer: str | None,
) -> None:
    """Describe STORE: examples, layers, segments, shapes, dtype, sizes, truncation, shards."""
    info = store_info(store)
    if n_texts:
        from actstore.features.views.show import example_texts
        from actstore.opener import open as open_store

        info["examples"], note = example_texts(open_store(store), n_texts, tokenizer=tokenizer)
        if note:
            info["examples_note"] = note
    if plots_dir:
        from actstore.features.views.plots import write_plots
        from actstore.opener import open as open_store

        info["plots"] = [str(p) for p in write_plots(open_store(store), plots_dir, max_examples=plot_examples)]
    if info["sink_warning"] and not quiet:
        G.warn(info["sink_warning"])
    if quiet:
        return
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    click.echo(format_info(info) + (f"\nplots: {plots_dir}/plots.html" if plots_dir else ""))
    if n_texts:
        click.echo(_texts(info["examples"], info.get("examples_note")))


def _texts(examples: list[dict], note: str | None) -> str:
    """The --examples lines: each example's key, then each segment's text (or text fields)."""
    lines = [f"first {len(examples)} examples:"] + ([f"  ({note})"] if note else [])
    for rec in examples:
        lines.append(f"  example {rec['example']}" + (f" ({rec['key']})" if "key" in rec else "") + ":")
        for name, text in (rec.get("segments") or rec.get("texts") or {}).items():
            text = str(text)
            lines.append(
                f"    {name}: {text[:400]!r}" + (f" ... ({len(text):,} characters)" if len(text) > 400 else "")
            )
    return "\n".join(lines)
