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
from dataclasses import dataclass
from typing import Any

import numpy as np

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


# TransformerLens hook names: blocks.N.hook_resid_pre / hook_resid_post / hook_mlp_out / hook_attn_out.
TL_NAME = re.compile(r"^blocks\.(-?\d+)\.hook_(resid_pre|resid_post|mlp_out|attn_out)$")
TL_HOOKS = ("hook_resid_pre", "hook_resid_post", "hook_mlp_out", "hook_attn_out")
_MLP_CHILDREN = ("mlp", "feed_forward", "ffn", "mlp_block")
_ATTN_CHILDREN = ("self_attn", "attn", "attention", "self_attention")


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


def resolve_hooks(module: Any, layers: Sequence[int | str]) -> list[HookPoint]:
    """Turn layers into hook points. A layer is a block number (its output; negative counts
    from the end: -1 is the last block), a TransformerLens name (`blocks.8.hook_resid_post`,
    `hook_resid_pre`, `hook_mlp_out`, `hook_attn_out`) or a module path (`model.layers.6.mlp`).

    Each is stored under its block number (the first integer of a module path); when some
    has none or two share one, they are numbered 0..k-1 in the order given. The store keeps
    every name (attrs `hook_names` and `hooks`), and readers accept the names.
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

    points = []
    for x in items:
        if isinstance(x, int):
            bpath, mod, k = block(x, f"layer {x}")
            points.append((k, HookPoint(layer=k, path=f"{bpath}.{k}", module=mod, block=True, name=resid_post_name(k))))
            continue
        m = TL_NAME.match(x)
        if m is None:
            if x.startswith("blocks.") or x.startswith("hook_"):
                raise UnknownLayerError(
                    f"{x!r} is not a hook name this capture knows; use blocks.N.{'|'.join(TL_HOOKS)}, a block number, or a module path"
                )
            points.append(
                (_first_int(x), HookPoint(layer=-1, path=x, module=_get_module(module, x), block=False, name=x))
            )
            continue
        bpath, mod, k = block(int(m.group(1)), x)
        hook = m.group(2)
        name = f"blocks.{k}.hook_{hook}"
        if hook == "resid_post":
            points.append((k, HookPoint(layer=k, path=f"{bpath}.{k}", module=mod, block=True, name=name)))
        elif hook == "resid_pre":
            points.append((k, HookPoint(layer=k, path=f"{bpath}.{k}", module=mod, block=False, pre=True, name=name)))
        else:
            child = _child(mod, _MLP_CHILDREN if hook == "mlp_out" else _ATTN_CHILDREN, f"{bpath}.{k}", x)
            points.append(
                (
                    k,
                    HookPoint(
                        layer=k, path=f"{bpath}.{k}.{child}", module=mod.get_submodule(child), block=False, name=name
                    ),
                )
            )
    names = [hp.name for _, hp in points]
    if len(set(names)) != len(names):
        raise UnknownLayerError(f"layers must be distinct, got {list(layers)}")
    nums = [n for n, _ in points]
    if None in nums or len(set(nums)) != len(nums):
        nums = list(range(len(points)))
    return [
        HookPoint(layer=n, path=hp.path, module=hp.module, block=hp.block, pre=hp.pre, name=hp.name)
        for n, (_, hp) in zip(nums, points)
    ]


def _child(block_mod: Any, names: tuple[str, ...], path: str, what: str) -> str:
    children = [n for n, _ in block_mod.named_children()]
    for n in names:
        if n in children:
            return n
    raise UnknownLayerError(
        f"{what}: block {path} has no {' / '.join(names)} module (children: {children}); record a module path instead"
    )


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
