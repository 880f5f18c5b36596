"""Forward hooks that record the residual stream (the output of transformer block N).

A layer number is a block index, as saev uses it: layer N is the output of block N, which
is `output_hidden_states[N + 1]` (hidden_states[0] is the embeddings). A hook point can
also name any module path (e.g. `model.layers.6.mlp`). The forward pass stops as soon as
every hook point has fired, by raising a private exception from the last hook, so no
compute is spent past the last recorded layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from actstore.capture import sites
from actstore.errors import CaptureError, NoBlocksError, UnknownLayerError

# Where HF transformers models keep their blocks, relative to the module we call.
# Decoder LLMs (Llama, Qwen, Gemma, Mistral), GPT-2, BERT/ViT/DINOv2, CLIP/SigLIP towers.
BLOCK_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "layers",
    "transformer.h",
    "h",
    "gpt_neox.layers",
    "model.decoder.layers",
    "bert.encoder.layer",
    "roberta.encoder.layer",
    "dinov2.encoder.layer",
    "vit.encoder.layer",
    "encoder.layer",
    "vision_model.encoder.layers",
    "encoder.layers",
    "text_model.encoder.layers",
)
_BLOCK_CLASS = re.compile(r"(Layer|Block)$")


@dataclass(frozen=True)
class HookPoint:
    """One recorded module: `layer` is the number stored, `path` the module path."""

    layer: int
    path: str
    module: Any
    block: bool  # a whole transformer block (its output is never modified in place)
    pre: bool = False  # record the module's input (hook_resid_pre), not its output
    name: str = ""  # the name the store keeps for it (TransformerLens-style or the module path)
    width: int | None = None  # the recorded width, when known before the forward pass (sites.site_width)


# TransformerLens site names (blocks.N.hook_resid_pre, ..., blocks.N.attn.hook_z): actstore.capture.sites.
TL_NAME = sites.TL_NAME
TL_HOOKS = sites.SITE_HOOKS


def resid_post_name(n: int) -> str:
    return f"blocks.{n}.hook_resid_post"


def find_blocks(module: Any) -> tuple[str, Any]:
    """The (path, ModuleList) of a model's transformer blocks.

    Raises:
        NoBlocksError: no known block list and no unambiguous list of *Layer/*Block modules.
    """
    import torch.nn as nn

    for path in BLOCK_PATHS:
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            return path, sub
    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            kinds = {type(c).__name__ for c in sub}
            if len(kinds) == 1 and _BLOCK_CLASS.search(next(iter(kinds))):
                found.append((name, sub))
    if len(found) == 1:
        return found[0]
    what = type(module).__name__
    if found:
        raise NoBlocksError(
            f"{what} has several block lists ({', '.join(n for n, _ in found)}); "
            "name the modules to record by path, e.g. --layers " + f"{found[0][0]}.0"
        )
    raise NoBlocksError(
        f"{what} has no recognised transformer blocks (looked for a ModuleList at "
        f"{', '.join(BLOCK_PATHS[:6])}, ... or a list of *Layer/*Block modules); "
        "record modules by path instead, e.g. --layers encoder.3"
    )


def resolve_hooks(module: Any, layers: Sequence[int | str], points: Any = None) -> list[HookPoint]:
    """Turn layers into hook points. A layer is a block number (its output; negative counts
    from the end: -1 is the last block), a TransformerLens site name (`blocks.8.hook_resid_post`,
    `hook_resid_pre`, `hook_resid_mid`, `hook_attn_out`, `hook_mlp_in`, `hook_mlp_out`,
    `attn.hook_z`, `mlp.hook_post`: actstore.capture.sites) or a module path (`model.layers.6.mlp`).

    Each is stored under its block number (the first integer of a module path); when some
    has none or two share one, they are numbered 0..k-1 in the order given. The store keeps
    every name (attrs `hook_names` and `hooks`), and readers accept the names. `points`
    (actstore.capture.wrappers.hook_points: a TransformerBridge's) reads the sites from a
    tool's own hook points instead of the HF modules.
    """
    items = [int(x) if isinstance(x, (int, np.integer)) else str(x).strip() for x in layers]  # a str is a name or path
    if not items:
        raise UnknownLayerError("no layers to record; pass layer numbers such as --layers 6,11")
    blocks: list[Any] = []

    def block(n: int, what: str) -> tuple[str, Any, int]:
        if not blocks:
            blocks.extend(find_blocks(module))
        bpath, mods = blocks
        k = n + len(mods) if n < 0 else n
        if not 0 <= k < len(mods):
            raise UnknownLayerError(
                f"{what} does not exist: {type(module).__name__} has {len(mods)} blocks at {bpath}, so layers 0..{len(mods) - 1} "
                f"(or -{len(mods)}..-1) exist; names: blocks.N.{'|'.join(TL_HOOKS)}, or module paths"
            )
        return bpath, mods[k], k

    found = []
    for x in items:
        if isinstance(x, int):
            bpath, mod, k = block(x, f"layer {x}")
            found.append((k, _site(mod, f"{bpath}.{k}", k, "hook_resid_post", blocks[1], f"layer {x}", points)))
            continue
        m = TL_NAME.match(x)
        if m is None:
            if x.startswith("blocks.") or x.startswith("hook_"):
                raise UnknownLayerError(
                    f"{x!r} is not a hook name this capture knows; use blocks.N.{'|'.join(TL_HOOKS)}, a block number, or a module path"
                )
            found.append((_first_int(x), _path_point(module, x)))
            continue
        bpath, mod, k = block(int(m.group(1)), x)
        found.append((k, _site(mod, f"{bpath}.{k}", k, m.group(2), blocks[1], x, points)))
    names = [hp.name for _, hp in found]
    if len(set(names)) != len(names):
        raise UnknownLayerError(f"layers must be distinct, got {list(layers)}")
    nums = [n for n, _ in found]
    if None in nums or len(set(nums)) != len(nums):
        nums = list(range(len(found)))
    return [replace(hp, layer=n) for n, (_, hp) in zip(nums, found)]


def site_width(model: Any, site: str) -> int:
    """The width (last dimension) of a site as record() stores it: d_model for the residual
    sites, n_heads * d_head for attn.hook_z, d_mlp for mlp.hook_post.

    Args:
        model: an HF module, a LoadedModel, or a wrapper record() takes (nnsight, TransformerLens).
        site: a TransformerLens site name (`blocks.3.mlp.hook_post`), a block number or a
            module path (a module path's width is known only for linear modules).

    Raises:
        UnknownLayerError: the site does not exist in this model, or its width cannot be known
            without running it (a module path to a non-linear module).
    """
    from actstore.capture.wrappers import hook_points, unwrap

    lm = getattr(model, "forward", None) if type(model).__name__ == "LoadedModel" else None
    (hp,) = resolve_hooks(lm or unwrap(model), [site], hook_points(model))
    if hp.width:
        return hp.width
    raise UnknownLayerError(
        f"the width of {site!r} ({type(hp.module).__name__}) is known only once it runs; "
        "record a TransformerLens site name or a linear module"
    )


def _site(block_mod: Any, bpath: str, k: int, hook: str, block_list: Any, what: str, points: Any) -> HookPoint:
    """The hook point of TransformerLens site `hook` of block `k` (actstore.capture.sites)."""
    name = f"blocks.{k}.{hook}"
    if points is not None:  # a tool's own hook point (its output is the site's tensor)
        path, mod, width = points(k, hook)
        return HookPoint(layer=k, path=path, module=mod, block=False, name=name, width=width)
    spot = sites.locate(block_mod, hook, what)
    mod = block_mod.get_submodule(spot.path) if spot.path else block_mod
    if spot.width == "d_model":
        width = sites.d_model_of(block_list)
    else:
        width = sites.module_width(mod, pre=True)
    return HookPoint(
        layer=k,
        path=f"{bpath}.{spot.path}" if spot.path else bpath,
        module=mod,
        block=not spot.path and not spot.pre,
        pre=spot.pre,
        name=name,
        width=width,
    )


def _path_point(module: Any, path: str) -> HookPoint:
    """A module path's hook point (its output; the width known for linear modules)."""
    mod = _get_module(module, path)
    return HookPoint(layer=-1, path=path, module=mod, block=False, name=path, width=sites.module_width(mod, pre=False))


def _get_module(module: Any, path: str) -> Any:
    try:
        return module.get_submodule(path)
    except AttributeError:
        pass
    parent, _, _ = path.rpartition(".")
    while parent:
        try:
            sub = module.get_submodule(parent)
            break
        except AttributeError:
            parent = parent.rpartition(".")[0]
    else:
        sub = module
    children = [n for n, _ in sub.named_children()][:20]
    raise UnknownLayerError(
        f"no module {path!r} in {type(module).__name__}; {parent or 'the model'} has children {children}"
    )


def _first_int(path: str) -> int | None:
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


class _StopForward(Exception):
    """Raised by the last hook to end the forward pass early (caught by Capture.run)."""


class Capture:
    """Registers forward hooks on `hooks`; `run(inputs)` returns {layer: tensor (B, T, D)}.

    Args:
        module: the module whose forward is called.
        hooks: from resolve_hooks(module, layers).
        stop_early: end the forward pass once every hook has fired.
        on_output: called as on_output(layer, tensor) as each hooked module fires, on the forward
            thread (record() passes its device stage, actstore.capture.stage).
    """

    def __init__(self, module: Any, hooks: Sequence[HookPoint], *, stop_early: bool = True, on_output: Any = None):
        self.module = module
        self.hooks = list(hooks)
        self.stop_early = stop_early
        self.on_output = on_output
        self._out: dict[int, Any] = {}
        self._active = False
        self._handles: list[Any] = []

    def __enter__(self) -> Capture:
        for hp in self.hooks:
            hook = self._make_hook(hp)
            if hp.pre:  # the block's input: hidden_states, positional or keyword
                self._handles.append(
                    hp.module.register_forward_pre_hook(
                        lambda mod, args, kwargs, h=hook: h(
                            mod, args, args[0] if args else kwargs.get("hidden_states")
                        ),
                        with_kwargs=True,
                    )
                )
            else:
                self._handles.append(hp.module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, hp: HookPoint):
        def hook(_mod: Any, _args: Any, out: Any) -> None:
            if not self._active:
                return  # a forward outside run() (e.g. generating the response)
            if hp.layer in self._out:
                return  # a module that runs twice per forward: keep its first output
            src = _first_tensor(out)
            if src is None:
                raise CaptureError(
                    f"module {hp.path} returned {type(out).__name__}, not a tensor; record another module"
                )
            t = src.detach()
            if self.on_output is not None:
                self.on_output(hp.layer, t)  # the device stage takes it now (copied before anyone changes it)
            elif not hp.block:
                t = t.clone()  # an arbitrary module's output may be changed in place later
            self._out[hp.layer] = t
            if self.stop_early and len(self._out) == len(self.hooks):
                raise _StopForward

        return hook

    def run(self, inputs: dict[str, Any], args: tuple[Any, ...] = ()) -> dict[int, Any]:
        """One forward pass; returns {layer: (B, T, D) tensor}."""
        import torch

        self._out = {}
        self._active = True
        with torch.inference_mode():
            try:
                self.module(*args, **inputs)
            except _StopForward:
                pass
            finally:
                self._active = False
        missing = [hp.path for hp in self.hooks if hp.layer not in self._out]
        if missing:
            raise CaptureError(
                f"modules {missing} never ran in the forward pass; record modules on the path of this input"
            )
        out = self._out
        self._out = {}
        shapes = {tuple(t.shape) for t in out.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3:
            desc = {hp.path: tuple(out[hp.layer].shape) for hp in self.hooks}
            raise CaptureError(f"recorded outputs must all be (batch, tokens, d_model) of one width; got {desc}")
        return out


def _first_tensor(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None
