"""`actstore write STORE`: capture a model's activations over a dataset into a new store.

Every option is a field of one CaptureOptions (actstore.capture.options), generated from the
field (its default and help: actstore.cli.fields) and handed to actstore.capture.write;
`write --help` lists them in sections. Old spellings
(--engine, --drop) still work for one release, with a warning (actstore.cli.grammar).
"""

from __future__ import annotations

import click

from actstore.capture.options import FIELDS, RUNNERS, CaptureOptions
from actstore.cli import grammar as G
from actstore.cli.fields import field_options
from actstore.cli.params import DEVICE, NEW_STORE
from actstore.cli.sections import SectionedCommand, section_option
from actstore.inputs.options import TEXTS
from actstore.read.layers import parse_layer_list

# The options of `write`, in the order --help lists them (each field's default and help are
# its own: actstore.capture.options); --no-system comes between the two groups.
OPTIONS = (
    *("model", "data", "layers", "dtype", "special", "drop", "stats", "on_overflow"),
    *("device", "model_dtype", "batch_size", "max_examples", "text_field", "encoding", "errors"),
    *("p_max", "r_max", "p_quantile", "r_quantile", "separator", "bos", "chat_template", "system"),
)
MORE_OPTIONS = (
    *("generate", "temperature", "top_p", "seed", "pack", "chunk", "context", "window_bos"),
    *("zarr_format", "shard_examples", "commit_bytes", "fsync", "queue_size", "writer_threads", "writer_nice"),
    *("workers", "runner", "cpus_per_worker", "gpus_per_worker", "ray_address", "rank", "world_size"),
    *("resume", "spool", "finalize"),
)


def register(main: click.Group) -> None:
    main.add_command(write_cmd)


def parse_layers(value: str) -> tuple[int | str, ...]:
    """--layers: numbers, ranges (0-11) and names (actstore.read.layers), in order."""
    out: list[int | str] = []
    for x in parse_layer_list(value):
        if isinstance(x, str) and "-" in x and all(p.isdigit() for p in x.split("-", 1)):
            a, b = (int(p) for p in x.split("-", 1))
            out.extend(range(a, b + 1))
        else:
            out.append(x)
    return tuple(out)


@click.command("write", cls=SectionedCommand)
@click.argument("store", type=NEW_STORE)
@field_options(CaptureOptions, OPTIONS, model={"multiple": True})  # --model A --model B: a family of models
@section_option(
    TEXTS,
    "--no-system",
    is_flag=True,
    help="With --chat-template: an empty system turn, so that the template adds no default system prompt.",
)
@field_options(CaptureOptions, MORE_OPTIONS, runner={"callback": G.resolve})
@G.alias("--engine", of="runner", use="--runner", type=click.Choice(list(RUNNERS)))
@G.quiet_json(quiet="No progress bar.", json="Print one JSON summary on stdout instead of the summary line.")
def write_cmd(store: str, **kw) -> None:
    """Capture a model's activations over a dataset into STORE.

    Records the output of each chosen transformer block (the residual stream) for every
    example, in data order, as (example, layer, token, d_model) activations; keeps
    running statistics; finalizes the store. The main job on the embedded ViT:

        actstore write out/vit.store --model embedded:dinov2-s14 --data embedded:images --layers 6,11
    """
    import os

    G.require_extras("write", ("torch", "transformers"))
    # torch's OpenMP threads otherwise spin at every barrier while the writer thread works,
    # burning the cores the model needs (measured: 11 % more CPU on 2 cores). Takes effect
    # only if torch is not imported yet; an OMP_WAIT_POLICY already set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from actstore.capture import family, run

    models = kw["model"]
    o = options(store, kw)
    several = len(models) > 1 or family.may_differ(o.layers)  # several models or widths: a family
    s = family.write_models(o, models, run.write) if several else run.write(o)
    if s.get("sink_warning"):
        G.warn(s["sink_warning"])
    if kw["as_json"]:
        import json

        click.echo(json.dumps(s))
        return
    rate = s["written"] / s["capture_seconds"] if s["capture_seconds"] else 0.0
    click.echo(
        f"wrote {s['written']} examples ({s['tokens']:,} tokens per layer, {s['bytes'] / 2**20:.1f} MiB) to {store} "
        f"in {s['seconds']:.1f} s ({s['capture_seconds']:.1f} s capturing, {rate:.1f} examples/s); "
        f"{s['examples']} examples in shard(s) {s['shards']}"
        + ("; finalized" if s["finalized"] else f"; run `actstore finalize {store}` once every writer is done")
    )
    if s.get("mask_line"):
        click.echo(s["mask_line"])
    if s["truncated_tokens"]:
        pct = 100 * s["truncated_tokens"] / s["source_tokens"]
        click.echo(
            f"truncated: {s['truncated_tokens']:,} of the data's {s['source_tokens']:,} tokens ({pct:.1f}%) exceeded the "
            "token budgets (--p-max/--r-max) and were not stored; --pack or --chunk store every token"
        )


def options(store: str, kw: dict) -> CaptureOptions:
    """The CaptureOptions of a `write` command line (old spellings mapped, with a warning)."""
    if kw["drop"]:  # (not an alias: --drop bos leaves out the BOS tokens alone, for this release)
        G.deprecated("--drop", "--special drop (which leaves out every special and template token)")
    if kw["system"] is not None and kw["no_system"]:
        raise click.UsageError("give --system TEXT or --no-system, not both")
    if kw["runner"] == "local":
        DEVICE.convert(kw["device"], None, None)  # a CUDA device torch sees here (Ray workers check theirs)
    given = {k: v for k, v in kw.items() if k in FIELDS}
    given.update(
        store=store,
        layers=parse_layers(kw["layers"]),
        drop=tuple(kw["drop"]),
        system="" if kw["no_system"] else kw["system"],
        progress=not kw["quiet"],
        model=kw["model"][0]
        if isinstance(kw["model"], tuple)
        else kw["model"],  # (more --model: a family, the first's job)
    )
    return CaptureOptions(**given)
