"""What `actstore write` checks before any model loads (well under two seconds, not after minutes).

The model's config (its config.json, or the embedded defaults' known shapes) gives its
modality and number of blocks without loading weights or importing torch, so these fail at
once, named: --generate on an image model, a block number, TransformerLens name or block
module path beyond the model's blocks, and a --resume whose layers, dtype, model or packing
differ from the store's (a clear error, not a run that writes nothing). Once the data is
open (it must parse), a data kind the model cannot take fails too. Module paths outside the
block list are checked when the model loads (they need its modules).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from actstore.capture.hooks import BLOCK_PATHS, TL_HOOKS, TL_NAME, resid_post_name
from actstore.errors import CaptureError, UnknownLayerError
from actstore.storage.regular import describe

# (modality, blocks) of the embedded defaults (actstore/inputs/embedded.py).
EMBEDDED_SHAPES = {"dinov2-s14": ("image", 12), "smollm2-135m": ("text", 30), "minilm-l6": ("text", 6)}
_VISION_KEYS = ("image_size", "patch_size", "num_channels")
# A module path inside block N of a known block list: model.layers.9.mlp -> block 9.
_BLOCK_PATH = re.compile(
    r"^(?P<list>" + "|".join(re.escape(p) for p in sorted(BLOCK_PATHS, key=len, reverse=True)) + r")\.(?P<n>\d+)(\.|$)"
)


def model_shape(model: str) -> tuple[str | None, int | None]:
    """(modality, number of blocks) read cheaply, or None where it cannot be known (a hub id)."""
    if model.startswith("embedded:"):
        return EMBEDDED_SHAPES.get(model.removeprefix("embedded:"), (None, None))
    cfg_file = Path(model).expanduser() / "config.json"
    try:
        mode = os.stat(cfg_file).st_mode  # a model folder may link to its files (the hub's cache does)
    except OSError:
        return None, None  # not a local folder (a hub id), or no config: load_model will say
    if not stat.S_ISREG(mode):
        raise CaptureError(
            f"{cfg_file} is {describe(mode)}, not a file: a model folder holds its config.json as a "
            "regular file (pass a saved model folder, a hub id or embedded:...)"
        )
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None  # not a local folder (a hub id), or no config: load_model will say
    if not isinstance(cfg, dict):
        return None, None
    if isinstance(cfg.get("vision_config"), dict):
        return "image", _blocks(cfg["vision_config"])
    if all(k in cfg for k in _VISION_KEYS[:2]) and "vocab_size" not in cfg:
        return "image", _blocks(cfg)
    return ("text" if "vocab_size" in cfg else None), _blocks(cfg)


def _blocks(cfg: dict[str, Any]) -> int | None:
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(cfg.get(k), int):
            return cfg[k]
    return None


def check_model(o: Any, store_cfg: Any | None) -> str | None:
    """Checks from the options, the model's config and the store (before the data is read);
    the model's modality ("image", "text" or None when its config does not say), for check_data."""
    modality, n_blocks = model_shape(o.model)
    if o.generate and modality == "image":
        raise CaptureError(f"--generate makes responses for prompts; {o.model} is an image model")
    if (o.pack or o.chunk) and modality == "image":
        raise CaptureError(f"--pack and --chunk take a language model; {o.model} is an image model")
    for x in o.layers:
        _check_hook_name(x, n_blocks)
        n, what = _block_of(x, paths=modality == "text")  # (a two-tower model's paths may be in either tower)
        if n is not None and n_blocks is not None and not -n_blocks <= n < n_blocks:
            raise UnknownLayerError(
                f"{what} does not exist: {o.model} has {n_blocks} blocks, so layers 0..{n_blocks - 1} "
                f"(or -{n_blocks}..-1) exist; names: blocks.N.{'|'.join(TL_HOOKS)}, or module paths"
            )
    if store_cfg is not None and o.resume:
        _check_resume(o, store_cfg, n_blocks)
    return modality


def check_data(o: Any, source: Any, modality: str | None) -> None:
    """Checks that need the data's kind (the data has parsed); `modality` from check_model."""
    if "bos" in o.drop and source.kind == "image":
        raise CaptureError(
            "--drop bos leaves out a tokenizer's BOS tokens; --data holds images (use --drop cls for a ViT's CLS token)"
        )
    if "cls" in o.drop and source.kind != "image":
        raise CaptureError("--drop cls leaves out a ViT's CLS token (token 0); --data holds texts (use --drop bos)")
    if o.generate and source.kind == "image":
        raise CaptureError("--generate makes responses for prompts; --data holds images")
    if o.generate and source.given_response is not None:
        raise CaptureError(
            f"--generate makes each prompt's response, but {source.given_response[1]} gives one: "
            'leave out --generate to capture the given responses, or remove the "response" fields to generate them'
        )
    if modality is not None:
        want = "image" if source.kind == "image" else "text"
        if modality != want:
            raise CaptureError(
                f"model {o.model} takes {modality} input but --data {source.name} holds {source.kind} examples"
            )


def _check_hook_name(x: int | str, n_blocks: int | None) -> None:
    """A name that looks like a TransformerLens hook but is none: refused with the closest names."""
    if not isinstance(x, str) or TL_NAME.match(x) or not x.startswith(("blocks.", "hook_")):
        return
    import difflib

    m = re.match(r"^blocks\.(-?\d+)\.", x)
    blocks = [int(m.group(1))] if m else range(n_blocks or 1)
    close = difflib.get_close_matches(x, [f"blocks.{n}.{h}" for n in blocks for h in TL_HOOKS], n=2, cutoff=0.5)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise UnknownLayerError(
        f"{x!r} is not a hook name this capture knows; use blocks.N.{'|'.join(TL_HOOKS)}, a block number, or a module path{hint}"
    )


def _block_of(x: int | str, paths: bool) -> tuple[int | None, str]:
    """The block number a layer names (None for a module path outside the block lists, or
    any module path unless `paths`)."""
    if isinstance(x, int):
        return x, f"layer {x}"
    m = TL_NAME.match(x)
    if m:
        return int(m.group(1)), x
    m = _BLOCK_PATH.match(x) if paths else None
    return (int(m.group("n")), x) if m else (None, x)


def _check_resume(o: Any, cfg: Any, n_blocks: int | None) -> None:
    where = f"--resume of {o.store}"
    if o.dtype != cfg.dtype:
        raise CaptureError(f"{where}: the store holds {cfg.dtype}, not {o.dtype}; resume with --dtype {cfg.dtype}")
    model = cfg.model_id or ""
    if model and not (model == o.model or model.startswith(o.model + " ")):
        raise CaptureError(
            f"{where}: the store was captured from {model!r}, not {o.model!r}; resume with --model {model.split(' (')[0]}"
        )
    stored = _stored_names(cfg)
    if len(o.layers) != len(cfg.layers) or not all(
        _same_layer(x, names, n_blocks) for x, names in zip(o.layers, stored)
    ):
        held = [n if names[0] == resid_post_name(n) else names[0] for n, names in zip(cfg.layers, stored)]
        raise CaptureError(
            f"{where}: the store holds layers {held}, not {list(o.layers)}; resume with --layers {','.join(map(str, held))}"
        )
    packing = cfg.attrs.get("packing") if isinstance(cfg.attrs.get("packing"), dict) else None
    mode = "pack" if o.pack else "chunk" if o.chunk else None
    if packing is not None and (packing.get("mode"), packing.get("context")) != (mode, o.context):
        raise CaptureError(
            f"{where}: the store holds a corpus captured with --{packing.get('mode')} --context {packing.get('context')}; "
            "resume with the same options"
        )
    if packing is None and mode is not None:
        raise CaptureError(f"{where}: the store was not captured with --pack or --chunk; resume without them")


def _stored_names(cfg: Any) -> list[list[str]]:
    """Per stored layer, the names the capture kept for it (hook name first, then module path)."""
    out = []
    for n in cfg.layers:
        names = [
            t[str(n)]
            for t in (cfg.attrs.get("hook_names"), cfg.attrs.get("hooks"))
            if isinstance(t, dict) and isinstance(t.get(str(n)), str)
        ]
        out.append(names or [resid_post_name(n)])
    return out


def _same_layer(x: int | str, names: list[str], n_blocks: int | None) -> bool:
    """Whether --layers item `x` asks for the stored layer known by `names`."""
    if isinstance(x, int):
        if x < 0:
            if n_blocks is None:
                return True  # cannot be known before the model loads; the writer compares the layers
            x += n_blocks
        return resid_post_name(x) in names
    m = TL_NAME.match(x)
    if m and int(m.group(1)) < 0:
        if n_blocks is None:
            return True
        x = f"blocks.{int(m.group(1)) + n_blocks}.{m.group(2)}"
    return x in names
