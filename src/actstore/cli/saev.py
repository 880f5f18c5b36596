"""`actstore export-saev`, `verify-saev`, `import-saev` and `link-run` (see docs/export.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE
from actstore.layout import saevspec as P
from actstore.read.layers import parse_layer_list
from actstore.storage.retry import counts as network_counts


def register(main: click.Group) -> None:
    main.add_command(export_cmd)
    main.add_command(verify_cmd)
    main.add_command(import_cmd)
    main.add_command(link_run_cmd)


def _names(value: str | None) -> list[str] | None:
    return None if value is None else [x for x in value.replace(",", " ").split() if x]


@click.command("export-saev")
@click.argument("store", type=STORE)
@G.out_option(
    "DUMP_TO: the folder the <HASH> directory goes into (default: $SAEV_SCRATCH/saev/shards).",
    positional="DUMP_TO",
    required=False,
    type=click.Path(file_okay=False),
)
@click.option(
    "--protocol",
    type=click.Choice(["auto", *P.PROTOCOLS]),
    default="auto",
    show_default=True,
    help="2.1: what saev's current loaders read (needs DUMP_TO ending in saev/shards). 2.0: the seed protocol exactly. "
    "auto: 2.1 where saev can read it (DUMP_TO .../saev/shards, the default), else 2.0.",
)
@click.option(
    "--layers",
    help="Layers to export: numbers, -1 for the last stored, or names, e.g. 6,11 or blocks.6.hook_resid_post (default: all stored).",
)
@click.option("--segments", help="Segments making up the token axis, e.g. prompt,response (default: all).")
@click.option(
    "--cls",
    "cls_mode",
    type=click.Choice(["keep", "drop", "none"]),
    help="Token 0 is CLS and exported (keep), is CLS and left out (drop), or there is no CLS (none). "
    "Default: the store's attrs['cls_token'].",
)
@click.option("--family", help="Model family saev knows (2.0: clip, siglip, dinov2). Default: the store's metadata.")
@click.option("--ckpt", help="Model identifier. Default: the store's attrs['ckpt'] or model_id.")
@click.option("--dataset", type=click.Path(), help="Root folder of the original data set. Default: attrs['dataset'].")
@click.option(
    "--data",
    help="Dataset description: a JSON object with __class__ (2.0) or a string (2.1). Default: attrs['data'] or a description of the store.",
)
@click.option(
    "--patches-per-shard",
    type=int,
    default=None,
    help=f"Token budget per shard (2.1: max_tokens_per_shard); examples per shard = budget // (T * layers). "
    f"Default: at most {P.DEFAULT_BUDGET:,}, fitted to the data so that the files hold data, not zero padding.",
)
@click.option("--pixel-agg", type=click.Choice(P.PIXEL_AGGS), help="Protocol 2.1 only (default majority).")
@click.option(
    "--labels/--no-labels",
    default=None,
    help="Write labels.bin from the store's per-token labels (default: when stored).",
)
@G.overwrite_option(
    "Rebuild and replace an existing <HASH> directory (without it, one that verifies is returned as it is, "
    "one that does not is refused)."
)
@click.option("--workers", type=int, default=2, show_default=True, help="Reader/converter threads.")
@click.option("--no-fsync", is_flag=True, help="Do not flush files to disk before publishing (scratch use only).")
@G.quiet_json(
    quiet="No progress bar, no summary line: only the directory is printed.",
    json="Print one JSON summary on stdout instead of the directory.",
)
@click.option(
    "--tokens-per-example",
    type=int,
    default=None,
    help="Stores with padded (text) segments: real tokens packed this many to an exported example (default 1).",
)
@G.special_option(
    help="Text stores whose labels mark token kinds: keep (also export BOS, special and chat-template tokens) or "
    "drop them (the default, as the loaders do; every --pack/--chunk window starts with a BOS).",
    aliases=(("--keep-special", "keep"),),
)
def export_cmd(
    store,
    out,
    protocol,
    layers,
    segments,
    cls_mode,
    family,
    ckpt,
    dataset,
    data,
    patches_per_shard,
    pixel_agg,
    labels,
    overwrite,
    workers,
    no_fsync,
    quiet,
    as_json,
    tokens_per_example,
    special,
) -> None:
    """Export STORE as saev shards in DUMP_TO/<HASH> (--out DUMP_TO; default $SAEV_SCRATCH/saev/shards).

    Float32 shards in the store's example order; the directory is built beside its target
    and renamed into place when complete. The directory is named by the hash of its inputs:
    rerunning with the same inputs returns the existing directory after verifying it
    (nothing is replaced). Prints the directory.
    """
    from actstore.saev import export_saev

    dump_to = out
    if dataset is None:
        dataset = _embedded_dataset(store, dump_to)
    res = export_saev(
        store,
        dump_to,
        protocol=protocol,
        layers=None if layers is None else parse_layer_list(layers),
        segments=_names(segments),
        cls=cls_mode,
        family=family,
        ckpt=ckpt,
        dataset=dataset,
        data=data,
        patches_per_shard=patches_per_shard,
        pixel_agg=pixel_agg,
        labels=labels,
        overwrite=overwrite,
        workers=workers,
        fsync=not no_fsync,
        progress=not quiet,
        tokens_per_example=tokens_per_example,
        keep_special=special == "keep",
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "path": str(res.path),
                    "hash": res.hash,
                    "protocol": res.protocol,
                    "examples": res.n_examples,
                    "shards": res.n_shards,
                    "reused": res.reused,
                    "network": network_counts(),
                }
            )
        )
        return
    if not quiet:
        what = "exists, verified" if res.reused else "exported"
        click.echo(f"{what}: {res.n_examples} examples in {res.n_shards} shards (protocol {res.protocol})", err=True)
    click.echo(str(res.path))  # the answer, even with --quiet: dir=$(actstore export-saev ... --quiet)


def _embedded_dataset(store, dump_to) -> str | None:
    """For a store captured from embedded images: the folder DUMP_TO/embedded-images,
    written with those images, as the dataset saev links to; else None (the store's own)."""
    from actstore.read.api import as_reader
    from actstore.saev.export import default_dump_to

    st = as_reader(store)
    st = getattr(st, "first", st)  # a family: its members were captured from the same data
    if not str(st.config.attrs.get("dataset", "")).startswith("embedded:images"):
        return None
    from actstore.inputs.embedded_files import write_embedded_images

    return str(write_embedded_images(Path(dump_to or default_dump_to()) / "embedded-images"))


@click.command("verify-saev")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--values", is_flag=True, help="Also read every activation and check it is finite (reads everything).")
@G.quiet_json(
    quiet="Print nothing: the exit code says whether the directory is sound.", json="Print the problems as a JSON list."
)
def verify_cmd(directory, values, as_json, quiet) -> None:
    """Check a saev shard DIRECTORY against every rule of its protocol; list each violation.

    Exit status 0 when it verifies, 1 otherwise.
    """
    from actstore.saev import verify_saev

    report = verify_saev(directory, values=values, progress=values and not quiet)
    if quiet:
        pass
    elif as_json:
        click.echo(
            json.dumps({"path": str(report.path), "protocol": report.protocol, "problems": report.problems}, indent=1)
        )
    elif report.ok:
        g = report.geometry
        click.echo(f"ok: protocol {report.protocol}, {g.n_examples} examples in {g.n_shards} shards")
    else:
        for p in report.problems:
            click.echo(p)
        click.echo(f"{len(report.problems)} problem(s) in {directory}", err=True)
    if not report.ok:
        sys.exit(1)


@click.command("import-saev")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("store", type=click.Path(file_okay=False))
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Stored dtype of the new store.",
)
@G.overwrite_option("Replace the store's shard 0 if it exists (not a finalized one).")
@G.quiet_json(quiet="No progress bar, no summary.")
def import_cmd(directory, store, dtype, overwrite, quiet, as_json) -> None:
    """Convert the saev shard DIRECTORY into a new actstore STORE (finalized)."""
    from actstore.saev import import_saev

    st = import_saev(directory, store, dtype=dtype, overwrite=overwrite, progress=not quiet)
    if as_json:
        G.echo_json({"store": str(store), "examples": len(st)})
    elif not quiet:
        click.echo(f"imported {len(st)} examples into {store}")


@click.command("link-run")
@G.required_argument("run", "RUN")
@G.alias("--run", of="run", use="RUN as the first argument")
@click.option(
    "--train-shards", required=True, help="A saev <HASH> directory, or a bare hash under $SAEV_SCRATCH/saev/shards."
)
@click.option("--val-shards", help="The same for validation.")
@click.option(
    "--dataset",
    type=click.Path(exists=True, file_okay=False),
    help="Training data set root (default: from the shards' metadata).",
)
@click.option("--val-dataset", type=click.Path(exists=True, file_okay=False), help="Validation data set root.")
@G.quiet_json(quiet="Do not print the run directory.", json='Print {"path": RUN_DIR} on stdout.')
def link_run_cmd(run, train_shards, val_shards, dataset, val_dataset, quiet, as_json) -> None:
    """Create the run directory RUN (<runs_root>/<run_id>, or a bare run id under
    $SAEV_NFS/saev/runs): checkpoint/, inference/ and links/ to the shards and data sets."""
    from actstore.saev import link_run

    run_dir = link_run(run, train_shards=train_shards, val_shards=val_shards, dataset=dataset, val_dataset=val_dataset)
    if as_json:
        G.echo_json({"path": str(run_dir)})
    elif not quiet:
        click.echo(str(run_dir))
