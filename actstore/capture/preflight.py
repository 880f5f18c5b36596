"""What `actstore write` checks before any model loads (in about a second, not after minutes).

The model's config (its config.json, or the embedded defaults' known shapes) gives its
modality and number of blocks without loading weights, so these fail at once, named:
a data kind the model cannot take, --generate on images, a block number or TransformerLens
name beyond the model's blocks, and a --resume whose layers, dtype or model differ from
the store's (a clear error, not a run that writes nothing). Module paths are checked when
the model loads (they need its modules).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actstore.capture.errors import CaptureError, UnknownLayerError
from actstore.capture.hooks import TL_HOOKS, TL_NAME

# (modality, blocks) of the embedded defaults (actstore/capture/embedded.py).
EMBEDDED_SHAPES = {"dinov2-s14": ("image", 12), "smollm2-135m": ("text", 30), "minilm-l6": ("text", 6)}
_VISION_KEYS = ("image_size", "patch_size", "num_channels")


def model_shape(model: str) -> tuple[str | None, int | None]:
    """(modality, number of blocks) read cheaply, or None where it cannot be known (a hub id)."""
    if model.startswith("embedded:"):
        return EMBEDDED_SHAPES.get(model.removeprefix("embedded:"), (None, None))
    cfg_file = Path(model).expanduser() / "config.json"
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


def check(o: Any, source: Any, store_cfg: Any | None) -> None:
    """Raise the error a run would meet later, from the options, the data and the store."""
    if "bos" in o.drop and source.kind == "image":
        raise CaptureError("--drop bos leaves out a tokenizer's BOS tokens; --data holds images (use --drop cls for a ViT's CLS token)")
    if "cls" in o.drop and source.kind != "image":
        raise CaptureError("--drop cls leaves out a ViT's CLS token (token 0); --data holds texts (use --drop bos)")
    if o.generate and source.kind == "image":
        raise CaptureError("--generate makes responses for prompts; --data holds images")
    modality, n_blocks = model_shape(o.model)
    if modality is not None:
        want = "image" if source.kind == "image" else "text"
        if modality != want:
            raise CaptureError(f"model {o.model} takes {modality} input but --data {source.name} holds {source.kind} examples")
    numbers = []
    for x in o.layers:
        m = TL_NAME.match(x) if isinstance(x, str) else None
        n = x if isinstance(x, int) else (int(m.group(1)) if m else None)
        if n is None:
            continue  # a module path: checked against the modules when the model loads
        if n_blocks is not None and not -n_blocks <= n < n_blocks:
            raise UnknownLayerError(
                f"{x if m else f'layer {x}'} does not exist: {o.model} has {n_blocks} blocks, so layers 0..{n_blocks - 1} "
                f"(or -{n_blocks}..-1) exist; names: blocks.N.{'|'.join(TL_HOOKS)}, or module paths"
            )
        numbers.append(n + n_blocks if n < 0 and n_blocks else n)
    if store_cfg is not None and o.resume:
        _check_resume(o, store_cfg, numbers if len(numbers) == len(o.layers) and all(isinstance(x, int) for x in o.layers) else None)


def _check_resume(o: Any, cfg: Any, layers: list[int] | None) -> None:
    where = f"--resume of {o.store}"
    if layers is not None and tuple(layers) != tuple(cfg.layers):
        raise CaptureError(f"{where}: the store holds layers {list(cfg.layers)}, not {layers}; resume with --layers {','.join(map(str, cfg.layers))}")
    if o.dtype != cfg.dtype:
        raise CaptureError(f"{where}: the store holds {cfg.dtype}, not {o.dtype}; resume with --dtype {cfg.dtype}")
    stored = cfg.model_id or ""
    if stored and not (stored == o.model or stored.startswith(o.model + " ")):
        raise CaptureError(f"{where}: the store was captured from {stored!r}, not {o.model!r}; resume with --model {stored.split(' (')[0]}")
