"""`actstore verify`, `actstore import-pkl` and `actstore export-pkl` (see docs/reliability.md)."""

from __future__ import annotations

import json
import sys

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE
from actstore.layout import spec
from actstore.legacy.safe_pickle import MAX_OBJECTS
from actstore.storage.retry import counts as network_counts


def register(main: click.Group) -> None:
    main.add_command(verify_cmd)
    main.add_command(import_pkl_cmd)
    main.add_command(export_pkl_cmd)


def _bar(total: int | None, unit: str, quiet: bool, desc: str):
    """A progress bar on stderr (periodic lines when it is not a terminal), or a stand-in when quiet."""
    from actstore.progress import bar

    return bar(total=total, unit=unit, unit_scale=True, desc=desc, disable=quiet, leave=False)


@click.command("verify")
@click.argument("store", type=STORE)
@click.option(
    "--deep",
    is_flag=True,
    help="Also read every published chunk and recompute its crc32c (reads the whole store). Plain reads do not "
    "(a flipped bit in a chunk reads back as it is); ActStore(path, verify='reads') checks every read instead.",
)
@G.quiet_json(quiet="No progress bar; print nothing unless there is a problem.", json="Print the report as JSON.")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too (unpublished shards, stray or temporary files).")
def verify_cmd(store: str, deep: bool, as_json: bool, strict: bool, quiet: bool) -> None:
    """Check STORE's integrity; exit 1 and print a table of problems when it is damaged.

    Fast mode (default) checks metadata against itself and every chunk file's presence and
    size. --deep also recomputes checksums and names each damaged (example, layer) and its
    file. Warnings (a shard not yet finalized, leftover temporary files) do not fail unless
    --strict. An export-saelens folder (OUT, with saelens_config.json) is checked against
    what its export recorded: data files, sizes, sha256 checksums and rows.
    """
    from actstore.errors import ActstoreError
    from actstore.saelens.check import is_saelens_folder
    from actstore.storage import is_url
    from actstore.verify import verify_store
    from actstore.write.finalize import load_manifest

    if not is_url(store) and is_saelens_folder(store):
        _verify_saelens(store, as_json, quiet)
        return

    total = None
    if deep:
        try:  # the bar's total: activation bytes published (a damaged manifest just has no total)
            total = sum(s.nbytes for s in load_manifest(store).shards)
        except ActstoreError:
            total = None
    with _bar(total, "B", quiet, "verify --deep" if deep else "verify") as bar:
        report = verify_store(store, deep=deep, progress=bar.update)
    failed = not report.ok or (strict and report.problems)
    if as_json:
        click.echo(json.dumps({**report.to_json(), "network": network_counts()}, indent=1))
    elif not quiet or failed:
        click.echo(report.summary())
        if report.problems:
            click.echo(report.table())
    if failed:
        sys.exit(1)


def _verify_saelens(path: str, as_json: bool, quiet: bool) -> None:
    """`actstore verify OUT` of an export-saelens folder: every problem listed, exit 1."""
    from actstore.saelens.check import verify_saelens_folder

    report = verify_saelens_folder(path, raise_on_error=False)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    elif not quiet or not report.ok:
        click.echo(report.summary())
        for p in report.problems:
            click.echo(f"  {p}")
    if not report.ok:
        sys.exit(1)


@click.command("import-pkl")
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.argument("store", type=click.Path(file_okay=False))
@click.option(
    "--dtype",
    type=click.Choice(list(spec.ACT_DTYPES)),
    default=spec.DEFAULT_DTYPE,
    show_default=True,
    help="Stored dtype (legacy activations are float32; float16 halves the size).",
)
@click.option("--tokens", type=int, help="T_max when metadata.json has no extraction_config.max_seq_length.")
@click.option(
    "--max-shard-bytes",
    type=click.IntRange(min=1),
    help="Refuse a shard whose pickle decompresses to more bytes (default: from its metadata).",
)
@click.option(
    "--max-objects",
    type=click.IntRange(min=1),
    default=MAX_OBJECTS,
    show_default=True,
    help="Refuse a shard whose pickle builds more objects.",
)
@G.quiet_json(quiet="No progress bar, no summary.")
def import_pkl_cmd(
    source: str,
    store: str,
    dtype: str,
    tokens: int | None,
    max_shard_bytes: int | None,
    max_objects: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Import the legacy pkl.gz directory SOURCE (metadata.json + shard_NNNN.pkl.gz) into STORE.

    Shard pickles are loaded by a restricted unpickler that admits only numpy array
    reconstruction, after their sha256 checksums match metadata.json. Layers, sample_idx,
    text_preview and metadata map into the store (see docs/reliability.md); the store is
    finalized. A rerun after an interruption continues where it stopped.
    """
    from actstore.legacy import import_pkl

    with _bar(None, "ex", quiet, "import-pkl") as bar:
        report = import_pkl(
            source,
            store,
            dtype=dtype,
            tokens=tokens,
            max_shard_bytes=max_shard_bytes,
            max_objects=max_objects,
            progress=bar.update,
        )
    if as_json:
        G.echo_json({**G.report_fields(report), "network": network_counts()})
    elif not quiet:
        click.echo(report.summary())


@click.command("export-pkl")
@click.argument("store", type=STORE)
@G.out_option(
    "The folder to write (metadata.json + shard_NNNN.pkl.gz).", positional="OUT", type=click.Path(file_okay=False)
)
@click.option("--examples-per-shard", type=int, default=100, show_default=True, help="Records per shard file.")
@click.option("--no-compress", is_flag=True, help="Write .pkl instead of .pkl.gz.")
@G.overwrite_option("Replace a finished export in OUT (default: refuse it).")
@G.quiet_json(
    quiet="No progress bar, no summary line.", json="Print one JSON summary on stdout instead of the summary line."
)
def export_pkl_cmd(
    store: str, out: str, examples_per_shard: int, no_compress: bool, overwrite: bool, quiet: bool, as_json: bool
) -> None:
    """Write STORE in the legacy pkl.gz format (metadata.json + shard_NNNN.pkl.gz) into OUT (--out).

    For tools that still read that format. Activations are float32 [T_i, D] per (example,
    layer); metadata.json lists sha256 checksums and is written last.
    """
    from actstore.legacy import export_pkl

    with _bar(None, "ex", quiet, "export-pkl") as bar:
        report = export_pkl(
            store,
            out,
            examples_per_shard=examples_per_shard,
            compress=not no_compress,
            overwrite=overwrite,
            progress=bar.update,
        )
    if as_json:
        G.echo_json({**G.report_fields(report), "network": network_counts()})
    elif not quiet:
        click.echo(report.summary())
