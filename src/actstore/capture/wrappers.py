"""Models as the interpretability tools hold them: nnsight's LanguageModel, TransformerLens's
TransformerBridge, resolved to the HF module record() calls and the modules its hooks read.

- nnsight `LanguageModel` / `TransformersModel` / `NNsight` wraps an HF module without changing
  it: record() calls and hooks the wrapped module (`._module` from nnsight 0.8, `._model`
  before), and the site names resolve as for that module.
- TransformerLens `TransformerBridge` inserts its own components (with HookPoints) into the
  HF module tree it wraps: record() calls that HF model (`.original_model`) and reads each site
  from the bridge's HookPoint of the same tensor (`BRIDGE_POINTS`). TransformerLens's own
  `hook_mlp_in` is resid_mid (before ln2); actstore's is the normalised MLP input, so it reads
  `ln2.hook_out`.

Both give the tensors the HF module gives (tests/test_capture_wrappers.py compares stores).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actstore.errors import UnknownLayerError

# actstore's site (after blocks.N.) -> the TransformerBridge hook point holding that tensor.
BRIDGE_POINTS = {
    "hook_resid_pre": "hook_resid_pre",
    "hook_attn_out": "hook_attn_out",
    "attn.hook_z": "attn.o.hook_in",  # o_proj's input: the heads side by side (n_heads * d_head)
    "hook_resid_mid": "hook_resid_mid",
    "hook_mlp_in": "ln2.hook_out",
    "mlp.hook_post": "mlp.out.hook_in",  # the down projection's input (act(gate) * up)
    "hook_mlp_out": "hook_mlp_out",
    "hook_resid_post": "hook_resid_post",
}


def tool_of(model: Any) -> str:
    """Which tool holds `model`: "nnsight", "transformer_lens" (a TransformerBridge) or "transformers"."""
    mod = type(model).__module__.split(".")[0]
    if mod == "nnsight" and _nnsight_module(model) is not None:
        return "nnsight"
    if mod == "transformer_lens" and "original_model" in getattr(model, "__dict__", {}):
        return "transformer_lens"
    if mod == "transformer_lens":
        raise UnknownLayerError(
            f"record() takes a TransformerLens TransformerBridge, not a {type(model).__name__} "
            "(whose weights are converted, not the HF module's); boot one with "
            "TransformerBridge.boot_transformers(name_or_folder)"
        )
    return "transformers"


def unwrap(model: Any) -> Any:
    """The HF module a wrapper holds (the module itself when it is not a wrapper)."""
    tool = tool_of(model)
    if tool == "nnsight":
        return _nnsight_module(model)
    if tool == "transformer_lens":
        return model.__dict__["original_model"]
    return model


def _nnsight_module(model: Any) -> Any:
    """The torch module an nnsight model wraps: `_module` (nnsight 0.8), `_model` (before)."""
    import torch

    for name in ("_module", "_model"):
        inner = getattr(model, name, None)
        if isinstance(inner, torch.nn.Module):
            return inner
    return None


def hook_points(model: Any) -> Callable[[int, str], tuple[str, Any, int]] | None:
    """For a TransformerBridge: a function (block, site) -> (hook name, HookPoint module, width)
    reading the site from the bridge's own hook points; None for other models."""
    if tool_of(model) != "transformer_lens":
        return None
    hooks = model.hook_dict
    cfg = model.cfg
    widths = {"attn.hook_z": cfg.n_heads * cfg.d_head, "mlp.hook_post": cfg.d_mlp}

    def point(k: int, site: str) -> tuple[str, Any, int]:
        name = f"blocks.{k}.{BRIDGE_POINTS[site]}"
        if name not in hooks:
            raise UnknownLayerError(
                f"blocks.{k}.{site}: this TransformerBridge has no hook point {name}; record another site"
            )
        return name, hooks[name], widths.get(site, cfg.d_model)

    return point


def tool_version(model: Any) -> str:
    """`tool version` of the package that holds `model` (e.g. "transformers 5.24.0")."""
    from importlib.metadata import PackageNotFoundError, version

    tool = tool_of(model)
    dist = {"transformer_lens": "transformer-lens"}.get(tool, tool)
    try:
        return f"{tool} {version(dist)}"
    except PackageNotFoundError:
        return tool
