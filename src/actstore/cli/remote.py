"""`actstore cp`: copy a store between a local folder and object storage (docs/remote.md)."""

from __future__ import annotations

import json

import click

from actstore.cli import grammar as G
from actstore.storage.retry import counts as network_counts


def register(main: click.Group) -> None:
    main.add_command(cp_cmd)


@click.command("cp")
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option(
    "--no-verify",
    is_flag=True,
    help="Read nothing back: skip comparing every copied object with the source and the final verify --deep.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="Objects copied at once (threads); memory holds at most this many objects.",
)
@G.quiet_json(quiet="No progress bar, no summary line.", json="Print the result as JSON instead of the summary line.")
def cp_cmd(src: str, dst: str, no_verify: bool, workers: int, quiet: bool, as_json: bool) -> None:
    """Copy the finalized store SRC to DST: local folders, file://, s3://, gs:// or az:// URLs.

    \b
      actstore cp out/vit.store s3://bucket/acts/vit.store
      actstore cp s3://bucket/acts/vit.store /scratch/vit.store

    DST is never a readable partial store: the data goes first and manifest.json last.
    Every copied object is read back and compared by crc32c (a local DST is then checked
    with `actstore verify --deep`). An interrupted copy resumes when rerun: what DST
    already holds is not copied again. A DST holding a different store is refused.
    Credentials and endpoints come from the usual environment (AWS_*, GOOGLE_*, AZURE_*).
    """
    from actstore.copy import copy_store
    from actstore.progress import bar as progress_bar

    with progress_bar(unit="B", unit_scale=True, unit_divisor=1024, desc="cp", leave=False, disable=quiet) as bar:

        def progress(n: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
                bar.refresh()
            bar.update(n)

        # errors (CopyError for I/O, StoreMismatchError, ...) are actstore's: one line, exit 1
        result = copy_store(src, dst, progress=progress, verify=not no_verify, workers=workers)
    if as_json:
        click.echo(json.dumps({**result.to_json(), "network": network_counts()}, indent=1))
    elif not quiet:
        click.echo(result.summary())
