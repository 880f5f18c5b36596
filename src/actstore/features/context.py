"""Context around top examples, without model weights: token windows (text stores) decoded
with the store's tokenizer, packed windows mapped to documents, and per-patch activation
grids over the image a ViT saw.

The tokenizer is the one the store records: its `model_id` (a model folder, a hub id in the
local cache, or an embedded default), loaded as tokenizer files only (AutoTokenizer never
loads weights); `tokenizer=` overrides it with a folder or id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from actstore.features.encoders import Encoder
from actstore.errors import FeatureError, TokenizerNotFoundError
from actstore.read.api import Reader
from actstore.read.store import ActStore

DEFAULT_WINDOW = (12, 4)  # tokens shown before and after the top token


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
            from actstore.inputs.embedded import SMOLLM2_GGUF, smollm2_folder

            return AutoTokenizer.from_pretrained(
                smollm2_folder(), gguf_file=SMOLLM2_GGUF
            )  # the GGUF's tokenizer metadata only
        if name.startswith("embedded:minilm-l6"):
            from actstore.inputs.embedded import minilm_folder

            return AutoTokenizer.from_pretrained(minilm_folder())
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, ImportError) as e:
        raise TokenizerNotFoundError(
            f"cannot load the tokenizer {name!r} that the store records ({str(e).splitlines()[0]}); "
            "pass --tokenizer FOLDER holding its tokenizer files"
        ) from None


def token_texts(tok: Any, ids: np.ndarray) -> list[str]:
    """Each id decoded alone (what it adds to the text)."""
    return [tok.decode([int(i)]) for i in ids]


def _origins(store: Reader, ex: int) -> np.ndarray | None:
    """Each stored token's (document, position) for a packed actstore store; None otherwise
    (only an ActStore keeps the `runs` text field that maps them)."""
    try:
        from actstore.inputs.packing import RUNS_TEXT, token_origins
    except ImportError:
        return None
    if not isinstance(store, ActStore) or RUNS_TEXT not in store.config.texts:
        return None
    return token_origins(store, ex)


def _label_fields(store: Reader) -> dict[str, np.ndarray] | None:
    """Each segment's token labels (N, T_max) when the pass's default mask applies to the store."""
    from actstore.layout import spec
    from actstore.read.masks import leaves_out_special

    if not leaves_out_special(store):
        return None
    return {s: np.asarray(store.field(s + spec.TOKEN_LABELS_SUFFIX)) for s in store.segments}


def _left_out(store: Reader, labels: dict[str, np.ndarray] | None, ex: int, n: int) -> np.ndarray:
    """Which of example ex's stored tokens the default mask leaves out (label != 0)."""
    if labels is None:
        return np.zeros(n, bool)
    lengths = store.lengths(ex)
    return np.concatenate([labels[s][ex, : lengths[s]] != 0 for s in store.segments])


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
    position with each one's activation for that feature, and, for packed stores, the
    document and position each shown token came from. Each example is read and encoded once."""
    if not store.config.token_ids:
        raise FeatureError(f"{store.path} keeps no token ids: text context needs a store captured with token_ids")
    out: list[dict[str, Any]] = [{} for _ in range(len(rows["example"]))]
    labels = _label_fields(store)
    order = np.argsort(rows["example"], kind="stable")
    exs = rows["example"][order]
    bounds = np.flatnonzero(np.diff(exs)) + 1
    for grp in np.split(order, bounds):
        if not len(grp):
            continue
        ex = int(rows["example"][grp[0]])
        feats = np.unique(rows["feature"][grp])
        acts = encoder.encode(np.asarray(store[ex, layer], np.float32), feats)  # (T, len(feats))
        ids = store.token_ids(ex)
        texts = token_texts(tok, ids)
        origins = _origins(store, ex)
        left_out = _left_out(store, labels, ex, len(ids))
        for i in grp:
            t, f = int(rows["token"][i]), int(np.searchsorted(feats, rows["feature"][i]))
            lo, hi = max(0, t - window[0]), min(len(texts), t + window[1] + 1)
            rec = {
                "feature": int(rows["feature"][i]),
                "example": ex,
                "token": t,
                "activation": float(rows["activation"][i]),
                "tokens": texts[lo:hi],
                "acts": [float(a) for a in acts[lo:hi, f]],
                "center": t - lo,
                "start": lo,
                "left_out": [bool(m) for m in left_out[lo:hi]],
            }
            if origins is not None and len(origins) > t:
                rec["document"], rec["doc_token"] = (int(v) for v in origins[t])
            out[i] = rec
    return out


def patch_grid(store: Reader, layer: int, encoder: Encoder, feature: int, ex: int) -> tuple[np.ndarray, dict[str, Any]]:
    """(grid_h, grid_w) activations of one feature over the patches of ViT example `ex`, and
    the store's image attrs (size, grid, prefix_tokens)."""
    im = store.config.attrs.get("image")
    if not im:
        raise FeatureError(f"{store.path} holds no image activations (no 'image' attrs)")
    gh, gw = im["grid"]
    prefix = int(im["prefix_tokens"])
    acts = encoder.encode(np.asarray(store[ex, layer], np.float32), np.asarray([feature]))[:, 0]
    if len(acts) != prefix + gh * gw:
        raise FeatureError(f"example {ex} has {len(acts)} tokens; the attrs promise {prefix} + {gh}x{gw} patches")
    return acts[prefix:].reshape(gh, gw), im


def image_pixels(store: Reader, ex: int, size: int) -> np.ndarray:
    """The (size, size, 3) uint8 image the ViT saw for example `ex` (from its sample's reference,
    which only an actstore store keeps: ActStore.sample)."""
    from actstore.inputs.data import load_image
    from actstore.inputs.prepare import crop_pixels

    if not isinstance(store, ActStore):
        raise FeatureError(
            f"{store.path} is a {type(store).__name__}, which keeps no image references: "
            "images need the actstore store the ViT activations were captured into"
        )
    ref = store.sample(ex).get("image")
    if not isinstance(ref, dict):
        raise FeatureError(f"example {ex} of {store.path} has no image reference (text field 'image')")
    return crop_pixels(load_image(ref), size)


def logit_table(
    direction: np.ndarray, unembed: np.ndarray, tok: Any, n: int = 10
) -> dict[str, list[tuple[str, float]]]:
    """The tokens whose logits a decoder direction raises and lowers most: direction @ W_U,
    with W_U (d_model, vocab)."""
    if unembed.shape[0] != direction.shape[0]:
        raise FeatureError(f"the unembedding is {unembed.shape}; it must be (d_model={direction.shape[0]}, vocab)")
    logits = direction.astype(np.float32) @ unembed
    top = np.argsort(-logits, kind="stable")[:n]
    bottom = np.argsort(logits, kind="stable")[:n]
    return {
        "positive": [(tok.decode([int(i)]), float(logits[i])) for i in top],
        "negative": [(tok.decode([int(i)]), float(logits[i])) for i in bottom],
    }


def load_unembedding(path: str, d_model: int) -> np.ndarray:
    """W_U (d_model, vocab) from a .npy or a safetensors file (`lm_head.weight`, or the tied
    `model.embed_tokens.weight` / `embed_tokens.weight` / `wte.weight`, stored (vocab, d_model))."""
    from pathlib import Path

    p = Path(path)
    if p.suffix == ".npy":
        W = np.load(p, allow_pickle=False)
    else:
        from safetensors.numpy import load_file

        try:
            t = load_file(str(p))
        except Exception as e:  # safetensors' own errors
            raise FeatureError(f"{p} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
        names: Sequence[str] = (
            "lm_head.weight",
            "model.embed_tokens.weight",
            "embed_tokens.weight",
            "transformer.wte.weight",
            "wte.weight",
            "W_U",
        )
        key = next((k for k in names if k in t), None)
        if key is None:
            raise FeatureError(f"{p} holds no unembedding; expected one of {list(names)}")
        W = t[key]
    W = np.asarray(W, np.float32)
    if W.ndim == 2 and W.shape[0] != d_model and W.shape[1] == d_model:
        W = W.T  # (vocab, d_model) as HF stores it
    if W.ndim != 2 or W.shape[0] != d_model:
        raise FeatureError(
            f"the unembedding in {p} is {W.shape}; it must be (d_model={d_model}, vocab) or (vocab, d_model)"
        )
    return W
