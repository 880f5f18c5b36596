"""Where each TransformerLens site of a block lives in an HF transformers model, and its width.

A site is one of eight points of transformer block N, named as TransformerLens names them:

    blocks.N.hook_resid_pre    the block's input (the residual stream before it)
    blocks.N.hook_attn_out     what attention adds to the residual (after Gemma/OLMo-2's post-norm,
                               DINOv2's layer scale)
    blocks.N.hook_resid_mid    resid_pre + attn_out: the residual between attention and the MLP's norm
    blocks.N.hook_mlp_in       the MLP's input (normalised: the output of the MLP's pre-norm)
    blocks.N.mlp.hook_post     the MLP's hidden activations, the input of its down projection
                               (act(gate) * up for gated MLPs), width d_mlp
    blocks.N.hook_mlp_out      what the MLP adds to the residual (after Gemma/OLMo-2's post-norm)
    blocks.N.hook_resid_post   the block's output = resid_mid + mlp_out = hidden_states[N + 1]
    blocks.N.attn.hook_z       each head's output before the output projection, the heads side by
                               side (n_heads * d_head), the input of o_proj

Each resolves to a module of the block and whether its input or its output is recorded
(`locate`), found from the block's child names (its width: actstore.capture.hooks.site_width), so Llama/Mistral, Qwen2/3, Gemma 2/3, Phi-3,
OLMo-2, GPT-2, GPT-NeoX, ViT, DINOv2, CLIP and SigLIP blocks all resolve. A GPT-NeoX block with
a parallel residual (`use_parallel_residual`) adds attention and MLP to the residual together:
it has no resid_mid, and asking for it is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from actstore.errors import UnknownLayerError

# The site names after `blocks.N.`, in the order they occur in a block.
SITE_HOOKS = (
    "hook_resid_pre",
    "hook_attn_out",
    "attn.hook_z",
    "hook_resid_mid",
    "hook_mlp_in",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)
TL_NAME = re.compile(r"^blocks\.(-?\d+)\.(" + "|".join(re.escape(h) for h in SITE_HOOKS) + r")$")

_ATTN = ("self_attn", "attn", "attention", "self_attention")
_MLP = ("mlp", "feed_forward", "ffn", "mlp_block")
_O_PROJ = ("o_proj", "out_proj", "c_proj", "dense", "output.dense")
_DOWN_PROJ = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2")
# The pre-MLP norm, whose input is resid_mid (Gemma's pre_feedforward_layernorm first: in Gemma
# post_attention_layernorm normalises the attention output instead).
_MLP_NORM = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "layernorm_after", "norm2", "layer_norm2")
_POST_MLP_NORM = "post_feedforward_layernorm"  # present in Gemma 2/3 and OLMo-2 blocks


@dataclass(frozen=True)
class Spot:
    """Where a site is read: `path` is a module path inside the block ("" the block itself);
    `pre` reads the module's input instead of its output; `width` is "d_model", "z" or "d_mlp"."""

    path: str
    pre: bool
    width: str


def locate(block: Any, hook: str, where: str) -> Spot:
    """The spot of site `hook` (one of SITE_HOOKS) in `block`; `where` names it in errors.

    Raises:
        UnknownLayerError: the block has no module for this site (named with its children).
    """
    kids = [n for n, _ in block.named_children()]
    if hook == "hook_resid_pre":
        return Spot("", True, "d_model")
    if hook == "hook_resid_post":
        return Spot("", False, "d_model")
    post_norms = _POST_MLP_NORM in kids  # Gemma 2/3, OLMo-2: attention and MLP outputs are normalised
    attn = _child(block, kids, _ATTN, where)
    if hook == "hook_attn_out":
        if post_norms and "post_attention_layernorm" in kids:
            return Spot("post_attention_layernorm", False, "d_model")
        return Spot("layer_scale1" if "layer_scale1" in kids else attn, False, "d_model")
    if hook == "attn.hook_z":
        return Spot(f"{attn}.{_child(block.get_submodule(attn), None, _O_PROJ, where)}", True, "z")
    mlp = _child(block, kids, _MLP, where)
    if hook == "hook_mlp_out":
        if post_norms:
            return Spot(_POST_MLP_NORM, False, "d_model")
        return Spot("layer_scale2" if "layer_scale2" in kids else mlp, False, "d_model")
    if hook == "hook_mlp_in":
        return Spot(mlp, True, "d_model")
    if hook == "mlp.hook_post":
        return Spot(f"{mlp}.{_child(block.get_submodule(mlp), None, _DOWN_PROJ, where)}", True, "d_mlp")
    if hook == "hook_resid_mid":
        if getattr(block, "use_parallel_residual", False):
            raise UnknownLayerError(
                f"{where}: this {type(block).__name__} adds attention and MLP to the residual in parallel "
                "(use_parallel_residual), so there is no residual between them; record hook_resid_pre "
                "(the MLP's input before its norm) or hook_mlp_in instead"
            )
        if post_norms and "pre_feedforward_layernorm" not in kids:
            return Spot(mlp, True, "d_model")  # OLMo-2: no pre-MLP norm, the MLP reads resid_mid itself
        return Spot(_child(block, kids, _MLP_NORM, where), True, "d_model")
    raise UnknownLayerError(f"{where}: unknown site {hook!r}; sites are blocks.N.{'|'.join(SITE_HOOKS)}")


def _child(mod: Any, kids: list[str] | None, names: tuple[str, ...], where: str) -> str:
    """The first of `names` that is a submodule path of `mod`."""
    for n in names:
        try:
            mod.get_submodule(n)
        except AttributeError:
            continue
        return n
    kids = kids if kids is not None else [n for n, _ in mod.named_children()]
    raise UnknownLayerError(
        f"{where}: {type(mod).__name__} has no {' / '.join(names)} module (children: {kids}); "
        "record a module path instead"
    )


def module_width(mod: Any, pre: bool) -> int | None:
    """The width of a linear-like module's input (`pre`) or output: nn.Linear's in/out_features,
    GPT-2's Conv1D weight (in, out); None for other modules."""
    if hasattr(mod, "in_features") and hasattr(mod, "out_features"):
        return int(mod.in_features if pre else mod.out_features)
    if type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None:
        return int(mod.weight.shape[0 if pre else 1])
    return None


def d_model_of(block_list: Any) -> int | None:
    """The residual width of a block list: the output width of block 0's attention projection."""
    block = block_list[0]
    for n in _ATTN:
        try:
            attn = block.get_submodule(n)
        except AttributeError:
            continue
        for o in _O_PROJ:
            try:
                w = module_width(attn.get_submodule(o), pre=False)
            except AttributeError:
                continue
            if w:
                return w
    return None
