"""`actstore show`: draw one example's activations (a PNG over the image for a vision
transformer, an HTML page of coloured tokens for a text store)."""

from __future__ import annotations

from pathlib import Path

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE


def register(main: click.Group) -> None:
    main.add_command(show_cmd)


@click.command("show")
@click.argument("store", type=STORE)
@click.option(
    "--ex",
    type=int,
    required=True,
    multiple=True,
    help="Example index (repeat for several ViT examples on one colour scale).",
)
@click.option(
    "--layer",
    required=True,
    help="Stored layer: a number, -1 for the last stored layer, or a name (blocks.8.hook_resid_post, a module path).",
)
@click.option("--dim", type=int, help="Colour by this stored dimension (default: the token norm).")
@click.option(
    "--sae",
    type=click.Path(exists=True),
    help="With --feature: an SAELens checkpoint folder whose latent colours the tokens.",
)
@click.option("--feature", type=int, help="With --sae: the latent to show.")
@click.option(
    "--tokenizer",
    help="Text stores: decode with this tokenizer instead of the recorded one: embedded:smollm2-135m, a hub id in "
    "the local cache, or a folder with tokenizer files (without one, token ids are shown).",
)
@G.out_option(
    "File to write (default exN-layerL.png, or .html for text stores).", required=False, type=click.Path(dir_okay=False)
)
@G.overwrite_option("Replace an existing file (default: refuse it).")
@G.quiet_json(quiet="Do not print the file's path.", json='Print {"path": FILE} on stdout.')
def show_cmd(
    store: str,
    ex: tuple[int, ...],
    layer: str,
    dim: int | None,
    sae: str | None,
    feature: int | None,
    tokenizer: str | None,
    out: str | None,
    overwrite: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Draw example EX at LAYER: for a vision transformer, per-patch norms (or a dimension /
    SAE latent) over the image, several examples on one colour scale (a PNG); for a text
    store, its tokens coloured by the norm, a dimension or an SAE latent (an HTML page).

    The image is re-read from the reference the store keeps (a file path, an embedded
    image or a datasets row); text is decoded with the tokenizer the store records. The
    output records the store state it was drawn from (the manifest's sha256: PNG text
    chunks, HTML meta tags); a store that changed while it was read writes nothing.
    """
    from actstore.opener import open as open_store

    if (sae is None) != (feature is None):
        raise click.UsageError("--sae and --feature go together")
    if dim is not None and sae is not None:
        raise click.UsageError("give --dim or --sae/--feature, not both")
    st = open_store(store)
    layer = st.layer_number(layer)  # a number, -1 or a name (actstore.read.layers)
    encoder, feat = None, dim
    if sae is not None:
        from actstore.features.encoders.sources import load_saelens

        encoder, feat = load_saelens(sae), feature
    text = not st.config.attrs.get("image")
    if text and len(ex) != 1:
        raise click.UsageError("a text store shows one example at a time: give one --ex")
    path = Path(out or f"ex{'-'.join(map(str, ex))}-layer{layer}.{'html' if text else 'png'}")
    G.refuse_existing(path, overwrite)
    if text:
        from actstore.features.views.show import text_html

        html = text_html(st, ex[0], layer, encoder=encoder, feature=feat, tokenizer=tokenizer)
        from actstore.storage.files import atomic_write_bytes

        atomic_write_bytes(path, html.encode("utf-8"))
    elif len(ex) > 1 or feat is not None:
        G.require_extras("show", ("PIL",))
        from actstore.features.views.show import images_png

        path = images_png(st, list(ex), layer, path, encoder=encoder, feature=feat)
    else:
        G.require_extras("show", ("torch", "PIL"))
        from actstore.features.views.show_png import render
        from actstore.read.store import ActStore

        # Drawn from the store opened above, whose state the picture records.
        path = render(st if isinstance(st, ActStore) else store, ex[0], layer, path)
    if as_json:
        G.echo_json({"path": str(path), "manifest_sha256": getattr(st, "manifest_sha256", None)})
    elif not quiet:
        click.echo(f"wrote {path}")
