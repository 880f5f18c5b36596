"""`actstore features` (top activations and statistics of many directions, one pass) and
`actstore view` (a static site of its output)."""

from __future__ import annotations

import shlex

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE


def register(main: click.Group) -> None:
    main.add_command(features_cmd)
    main.add_command(view_cmd)
    main.add_command(export_neuronpedia_cmd)


@click.command("features")
@click.argument("store", type=STORE)
@click.option("--layer", required=True, help="A stored layer number or name (e.g. blocks.8.hook_resid_post).")
@click.option("--neurons", is_flag=True, help="Directions: the stored dimensions themselves.")
@click.option(
    "--sae",
    type=click.Path(exists=True),
    help="Directions: an SAELens checkpoint folder (cfg.json + sae_weights.safetensors).",
)
@click.option("--saev", type=click.Path(exists=True), help="Directions: a saev checkpoint file.")
@click.option(
    "--dictionary",
    type=click.Path(exists=True),
    help="Directions: a dictionary_learning trainer folder (ae.pt + config.json).",
)
@click.option(
    "--directions",
    type=click.Path(exists=True),
    help="Directions: a (d_model, F) matrix, .npy or .safetensors (probes).",
)
@click.option("--bias", type=click.Path(exists=True), help="With --directions: an (F,) bias .npy.")
@click.option("--features", help="Feature ids and ranges, e.g. 0-4095,5000 (default all).")
@click.option("--top-k", type=int, default=20, show_default=True, help="Top activations kept per feature.")
@click.option(
    "--segments", help="Comma-separated segments to read (default all); token positions stay those of store[ex, layer]."
)
@G.special_option(aliases=(("--keep-special", "keep"),))
@click.option(
    "--intervals", type=int, default=5, show_default=True, help="Equal-width intervals of each feature's max to sample."
)
@click.option("--per-interval", type=int, default=5, show_default=True, help="Samples per interval.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option(
    "--sign",
    type=click.Choice(["positive", "negative", "both"]),
    default="positive",
    show_default=True,
    help="Which tail: the top-k positive values, the bottom-k negative values (neurons, probes), or both.",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Where the pass runs: cpu (torch encode, compiled update), cuda or cuda:N (encode, top-k and statistics "
    "on the GPU), or auto (torch on the CPU when installed, else numpy).",
)
@G.out_option("Output folder or URL (s3://...): top.parquet, features.parquet, intervals.parquet, meta.json.")
@G.overwrite_option("Replace the output of an earlier pass in OUT (default: refuse it).")
@G.quiet_json(quiet="No progress bar; nothing printed on success.", old_progress=True)
def features_cmd(
    store,
    layer,
    neurons,
    sae,
    saev,
    dictionary,
    directions,
    bias,
    features,
    top_k,
    segments,
    special,
    intervals,
    per_interval,
    seed,
    sign,
    device,
    out,
    overwrite,
    quiet,
    as_json,
) -> None:
    """Top activations, statistics and interval samples of many directions over LAYER of STORE.

    One sequential pass over the layer's real tokens (never padding); memory grows with
    features x top-k, not with tokens. Name one direction source. Then `actstore view OUT --out SITE`.
    """
    from actstore.features.run import run_features

    G.refuse_existing(out, overwrite)
    meta = run_features(
        store,
        layer,
        out,
        neurons=neurons,
        sae=sae,
        saev=saev,
        dictionary=dictionary,
        directions=directions,
        bias=bias,
        features=features,
        top_k=top_k,
        segments=segments.split(",") if segments else None,
        keep_special=special == "keep",
        n_intervals=intervals,
        per_interval=per_interval,
        seed=seed,
        sign=sign,
        device=device,
        progress=not quiet,
        command=_command(click.get_current_context()),
    )
    if as_json:
        G.echo_json({"path": str(out), "features": meta["n_features"], "tokens": meta["n_tokens"]})
    elif not quiet:
        click.echo(f"wrote {meta['n_features']} features over {meta['n_tokens']} tokens to {out}")


_NOT_IN_COMMAND = ("quiet", "as_json", "overwrite")  # how to print, not what the pass computes


def _command(ctx: click.Context) -> str:
    """The command line that gives these options (for meta.json), defaults left out."""
    parts = ["actstore", ctx.info_name or "features"]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.name in _NOT_IN_COMMAND or not p.expose_value:
            continue
        if isinstance(p, click.Argument):
            parts.append(str(v))
        elif getattr(p, "is_flag", False) and not getattr(p, "secondary_opts", None):
            parts += [p.opts[0]] if v else []
        elif v is not None and v != p.default:
            parts += [p.opts[0], str(v)]
    return " ".join(shlex.quote(x) for x in parts)


@click.command("view")
@click.argument("src")
@G.out_option("The site folder to write (open OUT/index.html).", type=click.Path(file_okay=False))
@G.overwrite_option("Replace the site in OUT (default: refuse a folder that is not empty).")
@click.option("--store", "store_path", help="The store (default: the one SRC/meta.json names).")
@click.option("--tokenizer", help="A tokenizer folder or cached hub id, instead of the one the store records.")
@click.option(
    "--unembedding",
    type=click.Path(exists=True),
    help="W_U (.npy or safetensors with lm_head.weight): logit tables of decoder directions.",
)
@G.quiet_json(quiet="No progress bar; nothing printed on success.", old_progress=True)
def view_cmd(src, out, overwrite, store_path, tokenizer, unembedding, quiet, as_json) -> None:
    """A static site of the output of `actstore features` SRC: an index sortable by max and
    density with a search box, and a page per feature. No server or internet needed."""
    from actstore.features.site import build_site

    G.refuse_existing(out, overwrite)
    store = None
    if store_path:
        from actstore.opener import open as open_store

        store = open_store(store_path)
    index = build_site(src, out, store=store, tokenizer=tokenizer, unembedding=unembedding, progress=not quiet)
    if as_json:
        G.echo_json({"path": str(index)})
    elif not quiet:
        click.echo(f"wrote {index}")


@click.command("export-neuronpedia")
@click.argument("src")
@G.out_option("Folder for batch-<n>.json (SAEDashboard 0.8.0's Neuronpedia format).", type=click.Path(file_okay=False))
@G.overwrite_option("Replace an earlier export in OUT (default: refuse a folder that is not empty).")
@click.option("--store", "store_path", help="The store (default: the one SRC/meta.json names).")
@click.option("--tokenizer", help="A tokenizer folder or cached hub id, instead of the one the store records.")
@click.option(
    "--unembedding",
    type=click.Path(exists=True),
    help="W_U (.npy or safetensors): logit tables and histograms of the decoder directions.",
)
@click.option("--model-id", help="Neuronpedia's model id (default: the store's).")
@click.option("--sae-set", default="actstore", show_default=True, help="Neuronpedia's SAE set name.")
@G.quiet_json()
def export_neuronpedia_cmd(
    src, out, overwrite, store_path, tokenizer, unembedding, model_id, sae_set, quiet, as_json
) -> None:
    """Feature dashboards as SAEDashboard's Neuronpedia JSON, from the output of `actstore features` SRC."""
    from actstore.features.export import export_neuronpedia

    G.refuse_existing(out, overwrite)
    store = None
    if store_path:
        from actstore.opener import open as open_store

        store = open_store(store_path)
    files = export_neuronpedia(
        src, out, store=store, tokenizer=tokenizer, unembedding=unembedding, model_id=model_id, sae_set=sae_set
    )
    if as_json:
        G.echo_json({"path": str(out), "files": [str(f) for f in files]})
    elif not quiet:
        click.echo(f"wrote {len(files)} batch files to {out}")
