"""Context around top examples, without model weights: token windows (text stores) decoded
with the store's tokenizer, packed windows mapped to documents, and per-patch activation
grids over the image a ViT saw.

The tokenizer is the one the store records: its `model_id` (a model folder, a hub id in the
local cache, or an embedded default), loaded as tokenizer files only (AutoTokenizer never
loads weights); `tokenizer=` overrides it with a folder or id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.errors import FeatureError, TokenizerNotFoundError
from actstore.features.encoders.encoder import Encoder
from actstore.features.views.windows import DEFAULT_WINDOW
from actstore.inputs.tokentext import TokenText
from actstore.read.api import Reader
from actstore.read.store import ActStore


def load_tokenizer(store: Reader, tokenizer: str | None = None) -> Any:
    """The tokenizer of a text store (or the one named), from its files only."""
    name = tokenizer or store.meta.get("model_id")
    if not name:
        raise TokenizerNotFoundError(
            f"{store.path} records no model id, so no tokenizer: pass --tokenizer FOLDER "
            "(a folder with tokenizer.json or the model's tokenizer files) or a hub id in the local cache"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerNotFoundError("decoding token ids needs transformers: pip install 'actstore[capture]'") from None
    try:
        if name.startswith("embedded:smollm2-135m"):
            from actstore.inputs.embedded import smollm2_tokenizer

            return smollm2_tokenizer()  # the GGUF's tokenizer metadata only
        if name.startswith("embedded:minilm-l6"):
            from actstore.inputs.embedded import minilm_folder

            return AutoTokenizer.from_pretrained(minilm_folder())
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, ImportError) as e:
        raise TokenizerNotFoundError(
            f"cannot load the tokenizer {name!r} that the store records ({str(e).splitlines()[0]}); "
            "pass --tokenizer FOLDER holding its tokenizer files"
        ) from None


TOKENIZER_FORMS = (
    "--tokenizer takes embedded:smollm2-135m (or embedded:minilm-l6), a hub id in the local cache, "
    "or a folder holding tokenizer files"
)


def tokenizer_or_note(store: Reader, tokenizer: str | None = None) -> tuple[Any, str | None]:
    """(the tokenizer, None), or (None, a one-line note) when the store records no tokenizer
    that loads: the views then show token ids. A `tokenizer` named explicitly must load."""
    if tokenizer:
        return load_tokenizer(store, tokenizer), None
    try:
        return load_tokenizer(store), None
    except TokenizerNotFoundError as e:
        reason = "records no model id" if not store.meta.get("model_id") else str(e).split(";")[0]
        return None, f"token ids shown: {reason}. To decode them, {TOKENIZER_FORMS}."


def text_windows(
    store: Reader,
    layer: int,
    encoder: Encoder,
    rows: dict[str, np.ndarray],
    tok: Any,
    *,
    window: tuple[int, int] = DEFAULT_WINDOW,
) -> list[dict[str, Any]]:
    """One record per row (feature, example, token, activation): the tokens around the
    position as display pieces (`tokens`, joining to the window's decoded text; `partial`:
    the tokens whose character shows on a later token) with each one's activation for that
    feature, which the pass left out, and, for packed stores, the document and position the
    row's token came from (actstore.features.views.windows computes them as arrays)."""
    from actstore.features.views.windows import text_windows as arrays
    from actstore.features.views.windows import window_pieces

    w = arrays(store, layer, encoder, rows["feature"], rows["example"], rows["token"], window=window)
    pieces = window_pieces(TokenText(tok), w)
    out = []
    for i in range(len(rows["example"])):
        inside = w.ids[i] >= 0
        first = int(np.argmax(inside))
        ids = w.ids[i][inside]
        rec = {
            "feature": int(rows["feature"][i]),
            "example": int(rows["example"][i]),
            "token": int(rows["token"][i]),
            "activation": float(rows["activation"][i]),
            "tokens": pieces[i].text,
            "partial": pieces[i].partial.tolist(),
            "ids": [int(t) for t in ids],
            "acts": [float(a) for a in w.acts[i][inside]],
            "center": w.before - first,
            "start": int(rows["token"][i]) - (w.before - first),
            "left_out": [bool(m) for m in w.off[i][inside]],
        }
        if w.doc[i] >= 0:
            rec["key"] = w.keys[w.doc[i]]
        if w.doc_token[i] >= 0:
            rec["doc_token"] = int(w.doc_token[i])
        out.append(rec)
    return out


def image_ref(store: Reader, ex: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the sample, its image reference) of ViT example `ex` (only an actstore store keeps
    references: ActStore.sample)."""
    if not isinstance(store, ActStore):
        raise FeatureError(
            f"{store.path} is a {type(store).__name__}, which keeps no image references: "
            "images need the actstore store the ViT activations were captured into"
        )
    sample = store.sample(ex)
    ref = sample.get("image")
    if not isinstance(ref, dict):
        raise FeatureError(f"example {ex} of {store.path} has no image reference (text field 'image')")
    return sample, ref


def ref_pixels(ref: dict[str, Any], size: int) -> np.ndarray:
    """The (size, size, 3) uint8 image the ViT saw for image reference `ref` (resized and
    centre-cropped as the capture did)."""
    from actstore.inputs.data import load_image
    from actstore.inputs.prepare import crop_pixels

    return crop_pixels(load_image(ref), size)


def image_pixels(store: Reader, ex: int, size: int) -> np.ndarray:
    """The (size, size, 3) uint8 image the ViT saw for example `ex`."""
    return ref_pixels(image_ref(store, ex)[1], size)
