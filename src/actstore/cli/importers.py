"""`actstore import-activault` and `import-saelens`: other tools' caches -> a store (docs/import.md)."""

from __future__ import annotations

import click

from actstore.cli import grammar as G
from actstore.cli.fields import field_options
from actstore.write.options import LayoutOptions

# --zarr-format as `actstore write` offers it: the writer's field, its default and help (one spelling).
ZARR_FORMAT = field_options(LayoutOptions, ("zarr_format",))


def register(main: click.Group) -> None:
    main.add_command(import_activault_cmd)
    main.add_command(import_saelens_cmd)
    main.add_command(import_dictionary_learning_cmd)


def _common(f):
    f = click.option(
        "--workers", type=int, default=2, show_default=True, help="Source files imported at once (one writer each)."
    )(f)
    f = ZARR_FORMAT(f)
    f = click.option(
        "--layer",
        default=None,
        callback=_layer_number,
        help="The store's layer: a number, or a name whose number it takes (blocks.8.hook_resid_post -> 8). "
        "Default: the number in the hook's name.",
    )(f)
    f = click.option(
        "--commit-mb",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="Commit each shard every this many MiB of activations (default 256): a kill loses at most one "
        "commit, and a rerun continues from the last; lower it for parts smaller than one commit.",
    )(f)
    return G.quiet_json(quiet="No progress bar, no summary.")(f)


def _commit_bytes(commit_mb: float | None) -> int | None:
    return None if commit_mb is None else max(1, int(commit_mb * 2**20))


def _layer_number(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """--layer of a new store: a number, or a name that carries one (actstore.read.layers)."""
    from actstore.read.layers import number_in_name

    if value is None:
        return None
    text = value.strip()
    if text.lstrip("+-").isdigit():
        return int(text)
    number = number_in_name(text)
    if number is None:
        raise click.BadParameter(f"{value!r} is neither a layer number nor a name that holds one (blocks.8....)")
    return number


def _report(rep, quiet: bool, as_json: bool) -> None:
    if as_json:
        G.echo_json(rep)
    elif not quiet:
        click.echo(rep.summary())


@click.command("import-activault")
@click.argument("src")
@click.argument("store")
@click.option("--hook-name", default=None, callback=G.resolve, help="The hook folder's name, when SRC is a run folder.")
@G.alias("--hook", of="hook_name", use="--hook-name", type=str, default=None)
@_common
def import_activault_cmd(
    src: str,
    store: str,
    hook_name: str | None,
    workers: int,
    zarr_format: int,
    layer: int | None,
    commit_mb: float | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Import one hook of an Activault run into STORE: SRC is the hook's folder {run}/{hook}
    (local or s3://...), or the run folder with --hook-name NAME.

    Each .saved.pt megabatch becomes one writer shard: sequences -> examples, input ids ->
    token ids, values in the source's dtype. Files are checked against metadata.json before
    they are read and loaded with torch.load(weights_only=True). Run again after a kill: it
    continues where it stopped.
    """
    from actstore.importers import import_activault

    rep = import_activault(
        src,
        store,
        hook=hook_name,
        layer=layer,
        workers=workers,
        zarr_format=zarr_format,
        commit_bytes=_commit_bytes(commit_mb),
        progress=not quiet,
    )
    _report(rep, quiet, as_json)


@click.command("import-saelens")
@click.argument("src")
@click.argument("store")
@click.option("--hook-name", default=None, help="The activation column to import (default: the folder's only one).")
@_common
def import_saelens_cmd(
    src: str,
    store: str,
    hook_name: str | None,
    workers: int,
    zarr_format: int,
    layer: int | None,
    commit_mb: float | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Import a SAELens cached-activations dataset (a datasets save_to_disk folder, local or
    an object-store URL; also what `actstore export-saelens` writes) into STORE.

    Each row becomes one example of context_size tokens with its token ids; the values keep
    the column's dtype. Run again after a kill: it continues where it stopped.
    """
    from actstore.importers import import_saelens

    rep = import_saelens(
        src,
        store,
        hook_name=hook_name,
        layer=layer,
        workers=workers,
        zarr_format=zarr_format,
        commit_bytes=_commit_bytes(commit_mb),
        progress=not quiet,
    )
    _report(rep, quiet, as_json)


@click.command("import-dictionary-learning")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("store")
@click.option(
    "--tokens-per-example", type=int, default=None, help="Tokens per example (default: the cache's context_len)."
)
@_common
def import_dictionary_learning_cmd(
    src: str,
    store: str,
    tokens_per_example: int | None,
    workers: int,
    zarr_format: int,
    layer: int | None,
    commit_mb: float | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Import one submodule of a dictionary_learning activation cache (SRC: the folder
    {store_dir}/{submodule}_{io} with config.json and shard_N.memmap/.meta) into STORE.

    Tokens are kept in file order, cut into examples of --tokens-per-example tokens
    (float32, exact; the cache keeps no token ids). Every shard present is imported,
    including the last one, which the cache's config.json does not count.
    """
    from actstore.importers import import_dictionary_learning

    rep = import_dictionary_learning(
        src,
        store,
        tokens_per_example=tokens_per_example,
        layer=layer,
        workers=workers,
        zarr_format=zarr_format,
        commit_bytes=_commit_bytes(commit_mb),
        progress=not quiet,
    )
    _report(rep, quiet, as_json)
