"""`actstore show`: draw one example's activations (a PNG over the image for a vision
transformer, an HTML page of coloured tokens for a text store)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

from actstore.cli.params import STORE


def register(main: click.Group) -> None:
    main.add_command(show_cmd)


def _require(command: str, modules: tuple[str, ...]) -> None:
    """Exit 1 with the install command when a package capture needs is missing (the core
    install, `pip install actstore`, has no torch)."""
    missing = [{"PIL": "pillow"}.get(m, m) for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        click.echo(
            f"actstore: error: `actstore {command}` needs {' and '.join(missing)}, not installed here: "
            "pip install 'actstore[capture]'",
            err=True,
        )
        sys.exit(1)


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
@click.option("--tokenizer", help="Text stores: a tokenizer folder or cached hub id instead of the recorded one.")
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="File to write (default exN-layerL.png, or .html for text stores).",
)
@click.option("--quiet", is_flag=True, help="Do not print the file's path.")
def show_cmd(
    store: str,
    ex: tuple[int, ...],
    layer: str,
    dim: int | None,
    sae: str | None,
    feature: int | None,
    tokenizer: str | None,
    out: str | None,
    quiet: bool,
) -> None:
    """Draw example EX at LAYER: for a vision transformer, per-patch norms (or a dimension /
    SAE latent) over the image, several examples on one colour scale (a PNG); for a text
    store, its tokens coloured by the norm, a dimension or an SAE latent (an HTML page).

    The image is re-read from the reference the store keeps (a file path, an embedded
    image or a datasets row); text is decoded with the tokenizer the store records.
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
        from actstore.features.sources import load_saelens

        encoder, feat = load_saelens(sae), feature
    if not st.config.attrs.get("image"):
        from actstore.features.show import text_html

        if len(ex) != 1:
            raise click.UsageError("a text store shows one example at a time: give one --ex")
        path = Path(out or f"ex{ex[0]}-layer{layer}.html")
        path.write_text(
            text_html(st, ex[0], layer, encoder=encoder, feature=feat, tokenizer=tokenizer), encoding="utf-8"
        )
    elif len(ex) > 1 or feat is not None:
        _require("show", ("PIL",))
        from actstore.features.show import images_png

        path = images_png(
            st, list(ex), layer, out or f"ex{'-'.join(map(str, ex))}-layer{layer}.png", encoder=encoder, feature=feat
        )
    else:
        _require("show", ("torch", "PIL"))
        from actstore.features.show_image import render

        path = render(store, ex[0], layer, out)
    if not quiet:
        click.echo(f"wrote {path}")
