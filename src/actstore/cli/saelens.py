"""`actstore export-saelens`: a layer as the cached-activations dataset SAELens trains from."""

from __future__ import annotations

import json

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE
from actstore.storage.retry import counts as network_counts


def register(main: click.Group) -> None:
    main.add_command(export_saelens_cmd)


@click.command("export-saelens")
@click.argument("store", type=STORE)
@G.out_option(
    "The folder to write (a datasets save_to_disk folder).", positional="OUT", type=click.Path(file_okay=False)
)
@G.overwrite_option("Replace an earlier export in OUT (default: refuse a folder that is not empty).")
@click.option(
    "--layer",
    required=True,
    help="The layer to export: a stored layer number or name (blocks.8.hook_resid_post, a module path).",
)
@click.option(
    "--hook-name",
    default=None,
    help="Column name = SAELens's hook_name (default: the name the capture kept: blocks.N.hook_resid_post, or the module path of a module-path layer).",
)
@click.option(
    "--context-size", type=int, default=128, show_default=True, help="Tokens per row (SAELens's context_size)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the token-level shuffle.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16"]),
    default="float32",
    show_default=True,
    help="Column dtype (float16: exact for float16 stores, half the disk).",
)
@G.special_option(
    help="Tokens labelled special or chat template, such as the BOS that starts every --pack/--chunk window: keep "
    "them, or drop them (the default for a text store whose labels mark token kinds).",
    aliases=(("--skip-special", "drop"), ("--keep-special", "keep")),
)
@G.quiet_json(
    quiet="No progress bar, no config printed.", json="Print one JSON summary (with the SAELens config) on stdout."
)
def export_saelens_cmd(
    store: str,
    out: str,
    overwrite: bool,
    layer: str,
    hook_name: str | None,
    context_size: int,
    seed: int,
    dtype: str,
    special: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write LAYER of STORE to OUT (--out) as the dataset SAELens trains from with use_cached_activations.

    Real tokens only (no padding; for a text store whose labels mark token kinds, no special
    or chat-template tokens unless --special keep), shuffled at token level with SEED, packed into rows of
    CONTEXT_SIZE tokens, with token ids. Prints the SAELens config to use (also written to
    OUT/saelens_config.json).
    """
    from actstore.saelens import export_saelens

    res = export_saelens(
        store,
        out,
        layer=layer,
        hook_name=hook_name,
        context_size=context_size,
        seed=seed,
        dtype=dtype,
        skip_special=None if special is None else special == "drop",
        overwrite=overwrite,
        progress=not quiet,
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "path": str(res.path),
                    "hook_name": res.hook_name,
                    "rows": res.n_rows,
                    "tokens": res.n_tokens,
                    "config": res.config,
                    "network": network_counts(),
                }
            )
        )
    elif not quiet:
        click.echo(
            f"exported {res.n_tokens:,} tokens of {res.hook_name} in {res.n_rows} rows of {res.context_size} to {res.path}"
        )
        click.echo("SAELens config (LanguageModelSAERunnerConfig fields; also in saelens_config.json):")
        click.echo(json.dumps(res.config, indent=2))
