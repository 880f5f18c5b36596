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

from actstore.capture.errors import CaptureError, NoBlocksError, UnknownLayerError

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
    """Turn layer numbers (block outputs) or module paths into hook points.

    A module path is stored under the first integer component of its path (the block
    index for `model.layers.6.mlp`); when some path has none or two share one, the paths
    are numbered 0..k-1 in the order given.
    """
    items = [int(x) if isinstance(x, (int, np.integer)) else x for x in layers]  # str: always a module path
    if not items:
        raise UnknownLayerError("no layers to record; pass layer numbers such as --layers 6,11")
    ints = [x for x in items if isinstance(x, int)]
    paths = [x.strip() for x in items if isinstance(x, str)]
    if ints and paths:
        raise UnknownLayerError(f"give either layer numbers or module paths, not both: {list(layers)}")
    if len(set(map(str, items))) != len(items):
        raise UnknownLayerError(f"layers must be distinct, got {list(layers)}")
    if ints:
        bpath, blocks = find_blocks(module)
        n = len(blocks)
        bad = [x for x in ints if not 0 <= x < n]
        if bad:
            raise UnknownLayerError(
                f"layer {bad[0]} does not exist: {type(module).__name__} has {n} blocks at {bpath}, "
                f"so layers 0..{n - 1} exist"
            )
        return [HookPoint(layer=x, path=f"{bpath}.{x}", module=blocks[x], block=True) for x in ints]
    mods = [_get_module(module, p) for p in paths]
    nums = [_first_int(p) for p in paths]
    if None in nums or len(set(nums)) != len(nums):
        nums = list(range(len(paths)))
    return [HookPoint(layer=k, path=p, module=m, block=False) for k, p, m in zip(nums, paths, mods)]


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
        f"no module {path!r} in {type(module).__name__}; "
        f"{parent or 'the model'} has children {children}"
    )


def _first_int(path: str) -> int | None:
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


class _StopForward(Exception):
    """Raised by the last hook to end the forward pass early (caught by Capture.run)."""


class Capture:
    """Registers forward hooks on `hooks`; `run(**inputs)` returns {layer: tensor (B, T, D)}.

    Tensors stay on the model's device unless `to_host` is set, in which case each is
    copied with non_blocking=True into pinned host memory as soon as its module fires;
    `run` then also returns a CUDA event to wait on before reading them.

    Args:
        module: the module whose forward is called.
        hooks: from resolve_hooks(module, layers).
        stop_early: end the forward pass once every hook has fired.
        to_host: copy outputs to host memory asynchronously (for CUDA models).
        half: round CPU outputs to float16 in the hook (vectorised, ~0.3 ms per million
            values), halving what the writer thread copies; an output whose rounding is
            not finite (overflow, NaN) is kept as is for the writer to count or refuse.
    """

    def __init__(
        self, module: Any, hooks: Sequence[HookPoint], *, stop_early: bool = True, to_host: bool = False, half: bool = False
    ):
        self.module = module
        self.hooks = list(hooks)
        self.stop_early = stop_early
        self.to_host = to_host
        self.half = half
        self._out: dict[int, Any] = {}
        self._active = False
        self._handles: list[Any] = []

    def __enter__(self) -> Capture:
        for hp in self.hooks:
            self._handles.append(hp.module.register_forward_hook(self._make_hook(hp)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, hp: HookPoint):
        import torch

        def hook(_mod: Any, _args: Any, out: Any) -> None:
            if not self._active:
                return  # a forward outside run() (e.g. generating the response)
            if hp.layer in self._out:
                return  # a module that runs twice per forward: keep its first output
            src = _first_tensor(out)
            if src is None:
                raise CaptureError(f"module {hp.path} returned {type(out).__name__}, not a tensor; record another module")
            t = src.detach()
            if self.half and t.device.type == "cpu" and t.dtype != torch.float16:
                h = t.to(torch.float16)  # a new tensor: later in-place changes cannot reach it
                if bool(torch.isfinite(h).all()):
                    t = h
            if not hp.block and t.data_ptr() == src.data_ptr():
                t = t.clone()  # an arbitrary module's output may be changed in place later
            if self.to_host and t.device.type != "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)  # device-to-host copy overlaps the next blocks
                t = host
            self._out[hp.layer] = t
            if self.stop_early and len(self._out) == len(self.hooks):
                raise _StopForward

        return hook

    def run(self, inputs: dict[str, Any], args: tuple[Any, ...] = ()) -> tuple[dict[int, Any], Any]:
        """One forward pass; returns ({layer: (B, T, D) tensor}, CUDA event or None)."""
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
            event = None
            if self.to_host and torch.cuda.is_available():
                event = torch.cuda.Event()
                event.record()
        missing = [hp.path for hp in self.hooks if hp.layer not in self._out]
        if missing:
            raise CaptureError(f"modules {missing} never ran in the forward pass; record modules on the path of this input")
        out = self._out
        self._out = {}
        shapes = {tuple(t.shape) for t in out.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3:
            desc = {hp.path: tuple(out[hp.layer].shape) for hp in self.hooks}
            raise CaptureError(f"recorded outputs must all be (batch, tokens, d_model) of one width; got {desc}")
        return out, event


def _first_tensor(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None
