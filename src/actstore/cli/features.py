"""`actstore features` (top activations and statistics of many directions, one pass) and
`actstore view` (a static site of its output)."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from actstore.cli import grammar as G
from actstore.cli.params import DEVICE_OR_AUTO, STORE


def register(main: click.Group) -> None:
    main.add_command(features_cmd)
    main.add_command(view_cmd)
    main.add_command(export_neuronpedia_cmd)
    main.add_command(export_delphi_cmd)


@click.command("features")
@click.argument("store", type=STORE)
@click.option("--layer", required=True, help="A stored layer number or name (e.g. blocks.8.hook_resid_post).")
@G.encoder_options
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
    type=DEVICE_OR_AUTO,
    default="auto",
    show_default=True,
    help="Where the pass runs: cpu (torch encode, compiled update), cuda or cuda:N (encode, top-k and statistics "
    "on the GPU), or auto (torch on the CPU when installed, else numpy).",
)
@click.option(
    "--model",
    help="With --sae: the model the store was captured from (as `write --model` takes it); meta.json then also "
    "holds the CE loss recovered with the SAE spliced in (SAELens's ce_loss_score).",
)
@click.option(
    "--ce-tokens",
    type=click.IntRange(1),
    default=4096,
    show_default=True,
    help="With --model: the pass's tokens the CE loss covers (the store's first examples, whole).",
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
    model,
    ce_tokens,
    out,
    overwrite,
    quiet,
    as_json,
) -> None:
    """Top activations, statistics and interval samples of many directions over LAYER of STORE.

    One sequential pass over the layer's real tokens (never padding); memory grows with
    features x top-k, not with tokens. Name one direction source. Then `actstore view OUT --out SITE`.
    With --sae, meta.json also holds the SAE's reconstruction quality over the pass's tokens.
    """
    from actstore.features.run import run_features

    G.refuse_existing(out, overwrite)
    downstream = None
    if model:
        from functools import partial

        from actstore.capture.splice import ce_loss_recovered
        from actstore.features.topk.quality import reconstruct_tensor

        on = device if device.startswith("cuda") else "cpu"
        downstream = partial(
            ce_loss_recovered,
            model=model,
            n_tokens=ce_tokens,
            reconstruct=reconstruct_tensor,
            device=on,
            progress=not quiet,
        )
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
        downstream=downstream,
    )
    if as_json:
        G.echo_json(
            {"path": str(out), "features": meta["n_features"], "tokens": meta["n_tokens"]}
            | ({"quality": meta["quality"]} if "quality" in meta else {})
        )
    elif not quiet:
        click.echo(f"wrote {meta['n_features']} features over {meta['n_tokens']} tokens to {out}")
        if "quality" in meta:
            click.echo(_quality_line(meta["quality"]))


def _quality_line(q: dict) -> str:
    """The SAE's figures in one line."""
    if not q["n_tokens"]:
        return "reconstruction: the pass read no tokens"
    fve = "n/a" if q["fve"] is None else f"{q['fve']:.4f}"
    line = (
        f"reconstruction over {q['n_tokens']} tokens: variance explained {fve}, MSE {q['mse']:.4g}, "
        f"L0 {q['l0']:.2f}, dead {q['dead']} and dense {q['dense']} of {q['n_latents']} latents"
    )
    if "ce_loss_score" in q:
        score = "n/a" if q["ce_loss_score"] is None else f"{q['ce_loss_score']:.4f}"
        line += f"; CE loss recovered {score} over {q['ce_tokens']} tokens"
    return line


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


TOKENIZER_HELP = (
    "Decode token ids with this tokenizer instead of the one the store records: embedded:smollm2-135m, "
    "a hub id in the local cache, or a folder with tokenizer files. Without one, token ids are shown."
)
UNEMBEDDING_HELP = (
    "W_U for logit tables of decoder directions: auto (from the model the store records, its final norm "
    "folded in), a .npy (d_model, vocab), a safetensors file holding lm_head.weight, or a model folder."
)
STORE_CHANGE_HELP = "Warn, instead of refusing, when the store changed since the pass (its manifest checksum)."


@click.command("view")
@click.argument("src")
@G.out_option("The site folder to write (open OUT/index.html).", type=click.Path(file_okay=False))
@G.overwrite_option("Replace the site in OUT, swapped in whole when done (only a folder `view` wrote).")
@click.option("--store", "store_path", help="The store (default: the one SRC/meta.json names).")
@click.option("--tokenizer", help=TOKENIZER_HELP)
@click.option("--unembedding", help=UNEMBEDDING_HELP)
@click.option(
    "--neighbours",
    type=click.IntRange(0, 100),
    default=10,
    show_default=True,
    help="Decoder-cosine neighbours a feature.",
)
@click.option("--allow-store-change", is_flag=True, help=STORE_CHANGE_HELP)
@click.option(
    "--thumb-size",
    type=int,
    default=224,
    show_default=True,
    help="ViT stores: the side in pixels of each image's thumbnail (written once; the pages draw the heatmaps).",
)
@G.quiet_json(quiet="No progress bar; nothing printed on success.", old_progress=True)
def view_cmd(
    src, out, overwrite, store_path, tokenizer, unembedding, neighbours, allow_store_change, thumb_size, quiet, as_json
) -> None:
    """A static site of the output of `actstore features` SRC for dictionaries of 100k+ latents:
    an index of every feature (virtual scrolling, search, sort, the density histogram) and a
    page per feature, reading per-feature data files. No server or internet needed."""
    from actstore.features.views.site import build_site

    G.refuse_existing(out, overwrite)
    store = None
    if store_path:
        from actstore.opener import open as open_store

        store = open_store(store_path)
    index = build_site(
        src,
        out,
        store=store,
        tokenizer=tokenizer,
        unembedding=unembedding,
        neighbours=neighbours,
        overwrite=overwrite,
        on_store_change="warn" if allow_store_change else "refuse",
        thumb_size=thumb_size,
        progress=not quiet,
    )
    if as_json:
        G.echo_json({"path": str(index)})
    elif not quiet:
        click.echo(f"wrote {index}")


@click.command("export-neuronpedia")
@click.argument("src")
@G.out_option(
    "Folder for SAEDashboard 0.8.0's JSON (batch-<n>.json) and Neuronpedia's import layout "
    "(<model>/<layer>-<set>/{features,activations}/batch-<n>.jsonl.gz).",
    type=click.Path(file_okay=False),
)
@G.overwrite_option("Replace an earlier export in OUT, swapped in whole when done.")
@click.option("--store", "store_path", help="The store (default: the one SRC/meta.json names).")
@click.option("--tokenizer", help=TOKENIZER_HELP)
@click.option("--unembedding", help=UNEMBEDDING_HELP)
@click.option("--model-id", help="Neuronpedia's model id (default: from the store's).")
@click.option("--sae-set", default="actstore", show_default=True, help="Neuronpedia's source set name.")
@click.option(
    "--creator-id",
    default="clkht01d40000jv08hvalcvly",
    show_default=True,
    help="Neuronpedia user id the rows name (the default is the user a self-hosted Neuronpedia seeds).",
)
@click.option("--allow-store-change", is_flag=True, help=STORE_CHANGE_HELP)
@G.quiet_json()
def export_neuronpedia_cmd(
    src,
    out,
    overwrite,
    store_path,
    tokenizer,
    unembedding,
    model_id,
    sae_set,
    creator_id,
    allow_store_change,
    quiet,
    as_json,
) -> None:
    """Feature dashboards for Neuronpedia (its import layout) and SAEDashboard (its JSON), from
    the output of `actstore features` SRC."""
    from actstore.features.exports.dashboards import export_neuronpedia

    G.refuse_existing(out, overwrite)
    store = None
    if store_path:
        from actstore.opener import open as open_store

        store = open_store(store_path)
    folder = export_neuronpedia(
        src,
        out,
        store=store,
        tokenizer=tokenizer,
        unembedding=unembedding,
        model_id=model_id,
        sae_set=sae_set,
        creator_id=creator_id,
        overwrite=overwrite,
        on_store_change="warn" if allow_store_change else "refuse",
    )
    files = sorted(Path(out).glob("batch-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if as_json:
        G.echo_json({"path": str(out), "files": [str(f) for f in files], "neuronpedia": str(folder)})
    elif not quiet:
        click.echo(f"wrote {folder} (Neuronpedia's layout) and {len(files)} batch files to {out} (SAEDashboard's JSON)")


@click.command("export-delphi")
@click.argument("store", type=STORE)
@click.option("--layer", required=True, help="A stored layer number or name (e.g. blocks.8.hook_resid_post).")
@G.encoder_options
@click.option("--hookpoint", help="The cache's module folder name (default layers.<layer>).")
@click.option("--n-splits", type=click.IntRange(1), default=5, show_default=True, help="Latent ranges, one file each.")
@G.special_option()
@click.option(
    "--device",
    type=DEVICE_OR_AUTO,
    default="auto",
    show_default=True,
    help="Where the encode runs: cpu, cuda, cuda:N or auto.",
)
@G.out_option("The cache folder: OUT/<hookpoint>/<start>_<end>.safetensors.", type=click.Path(file_okay=False))
@G.overwrite_option("Replace an earlier cache in OUT, swapped in whole when done.")
@G.quiet_json(quiet="No progress bar; nothing printed on success.")
def export_delphi_cmd(
    store,
    layer,
    neurons,
    sae,
    saev,
    dictionary,
    directions,
    bias,
    hookpoint,
    n_splits,
    special,
    device,
    out,
    overwrite,
    quiet,
    as_json,
) -> None:
    """Every non-zero activation of a dictionary over LAYER of STORE as delphi's latent cache
    (what delphi's LatentDataset reads to sample and explain latents)."""
    from actstore.features.encoders import sources
    from actstore.features.exports.delphi import export_delphi
    from actstore.opener import open as open_store

    G.refuse_existing(out, overwrite)
    st = open_store(store)
    enc = sources.load(
        neurons_d_model=int(st.d_model) if neurons else None,
        sae=sae,
        saev=saev,
        dictionary=dictionary,
        directions=directions,
        bias=bias,
    )
    folder = export_delphi(
        st,
        int(st.layer_number(layer)),
        enc,
        out,
        hookpoint=hookpoint,
        n_splits=n_splits,
        keep_special=special == "keep",
        device=device,
        overwrite=overwrite,
        progress=not quiet,
    )
    if as_json:
        G.echo_json({"path": str(folder)})
    elif not quiet:
        click.echo(f"wrote {folder}")
