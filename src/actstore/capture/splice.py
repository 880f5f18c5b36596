"""The CE loss recovered by an SAE spliced into the model, as SAELens defines it
(sae_lens/evals.py, get_recons_loss and get_downstream_reconstruction_metrics):

    ce_loss_score = (ce_with_ablation - ce_with_sae) / (ce_with_ablation - ce_without_sae)

over the store's first examples (in store order, whole) until `n_tokens` of the feature
pass's tokens are covered, each run as stored (its token ids, as one sequence):

- without_sae: the model as it is;
- with_sae: the hooked layer's output replaced by the SAE's reconstruction at the pass's
  tokens (the others keep their activations: SAELens's mask of `exclude_special_tokens`);
- with_ablation: the layer's output zeroed at every position (SAELens's zero ablation).

Each is the next-token cross entropy averaged over the positions whose input token is one
of the pass's tokens and that have a next token (SAELens's mask[:, :-1]). Before any of it,
the model must reproduce the stored activations of the layer: the SAE is judged on the
model whose activations it encodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from actstore.errors import CaptureError
from actstore.layout import spec
from actstore.progress import updater
from actstore.read.interface import Reader
from actstore.read.masks import leaves_out_special

MATCH_TOLERANCE = 0.05  # the largest relative L2 difference between stored and recomputed activations


def ce_loss_recovered(
    store: Reader,
    layer: int,
    encoder: Any,
    *,
    model: str,
    n_tokens: int,
    reconstruct: Callable[[Any, Any], Any],
    keep_special: bool = False,
    segments: Sequence[str] | None = None,
    device: str = "cpu",
    progress: bool | Callable[[int], Any] = False,
) -> dict[str, Any]:
    """The CE figures of `encoder` spliced into `model` at the store's `layer` (see the module).

    Args:
        store: the Reader of the feature pass (with token ids).
        layer: the stored layer number the SAE encodes.
        encoder: the SAE; reconstruct(encoder, x (n, d) tensor) -> its reconstruction.
        model: what `actstore write --model` takes (embedded:..., a folder, a hub id).
        n_tokens: the pass's tokens to cover (whole examples, in store order).
        keep_special, segments: the pass's token choice (actstore features).
        device: where the model runs.
        progress: True for a bar (the pass's tokens covered), or a callable taking them.
    """
    import torch

    from actstore.capture.hooks import resolve_hooks
    from actstore.inputs.models import load_model

    if n_tokens < 1:
        raise CaptureError(f"--ce-tokens must be >= 1. Got {n_tokens}.")
    unknown = sorted(set(segments or ()) - set(store.segments))
    if unknown:
        raise CaptureError(f"segments {unknown} are not in this store; it has segments {list(store.segments)}")
    if store.token_ids(0) is None:
        raise CaptureError(
            f"{store.path} keeps no token ids: the CE loss needs the stored token ids to rerun the model"
        )
    lm = load_model(model, device=device)
    if not lm.is_decoder:
        raise CaptureError(f"--model {model} is no causal language model: the CE loss needs next-token logits")
    hp = resolve_hooks(lm.forward, [_hook_name(store, layer)])[0]
    labels = (  # read once: the pass's default mask (token label 0), per segment
        {seg: np.asarray(store.field(seg + spec.TOKEN_LABELS_SUFFIX)) for seg in store.segments}
        if leaves_out_special(store) and not keep_special
        else None
    )
    bar = updater(progress, n_tokens, "CE loss", "tok")
    sums = {"without_sae": 0.0, "with_sae": 0.0, "with_ablation": 0.0}
    n_scored = n_covered = n_examples = 0
    worst = 0.0
    for ex in range(len(store)):
        if n_covered >= n_tokens:
            break
        ids = torch.as_tensor(np.asarray(store.token_ids(ex), np.int64), device=lm.device)[None]
        kept = _kept(store, ex, labels, segments)
        n_covered += int(kept.sum())
        if bar is not None:
            bar(int(kept.sum()))
        n_examples += 1
        keep_t = torch.as_tensor(kept, device=lm.device)
        stored = torch.as_tensor(np.asarray(store[ex, layer], np.float32), device=lm.device)
        scored = keep_t[:-1]
        n_scored += int(scored.sum())
        for name in sums:
            logits, acts = _run(lm, hp, ids, name, keep_t, lambda x: reconstruct(encoder, x))
            if name == "without_sae" and kept.any():
                a = acts[0, keep_t].float()
                worst = max(worst, float((a - stored[keep_t]).norm() / stored[keep_t].norm().clamp_min(1e-12)))
                if worst > MATCH_TOLERANCE:
                    raise CaptureError(
                        f"--model {model} does not reproduce layer {layer} of {store.path} (example {ex}: relative "
                        f"difference {worst:.3g} > {MATCH_TOLERANCE}): pass the model the store was captured with"
                    )
            ce = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")
            sums[name] += float(ce[scored].sum(dtype=torch.float64))
    if not n_scored:
        raise CaptureError(f"the first {n_examples} examples of {store.path} hold no token to score the CE loss on")
    ce = {k: v / n_scored for k, v in sums.items()}
    denom = ce["with_ablation"] - ce["without_sae"]
    return {
        "ce_loss_score": (ce["with_ablation"] - ce["with_sae"]) / denom if denom else None,
        "ce_loss_without_sae": ce["without_sae"],
        "ce_loss_with_sae": ce["with_sae"],
        "ce_loss_with_ablation": ce["with_ablation"],
        "ce_tokens": n_scored,
        "ce_examples": n_examples,
        "ce_model": model,
        "ce_hook": hp.name or hp.path,
        "ce_activation_difference": worst,
    }


def _hook_name(store: Reader, layer: int) -> Any:
    """The name the store recorded for `layer` (TransformerLens-style, else its module
    path), or the layer number (the output of block `layer`)."""
    attrs = store.config.attrs if hasattr(store, "config") else {}
    for key in ("hook_names", "hooks"):
        table = attrs.get(key)
        if isinstance(table, dict) and isinstance(table.get(str(layer)), str):
            return table[str(layer)]
    return int(layer)


def _kept(store: Reader, ex: int, labels: dict[str, np.ndarray] | None, segments: Sequence[str] | None) -> np.ndarray:
    """The pass's tokens among the positions of store[ex, layer] (segments in store order;
    labels: per segment the token labels, None when the pass keeps every token)."""
    parts = []
    for seg, n in store.lengths(ex).items():
        keep = np.full(n, segments is None or seg in segments)
        if labels is not None:
            keep &= labels[seg][ex, :n] == 0
        parts.append(keep)
    return np.concatenate(parts) if parts else np.zeros(0, bool)


def _run(lm: Any, hp: Any, ids: Any, how: str, keep: Any, recon: Callable[[Any], Any]) -> tuple[Any, Any]:
    """One forward of `ids`: its logits and the hooked layer's activations (as computed,
    before any change); how: without_sae, with_sae or with_ablation."""
    import torch

    seen: list[Any] = []

    def change(h: Any) -> Any:
        seen.append(h.detach())
        if how == "with_ablation":
            return torch.zeros_like(h)
        if how == "with_sae":
            new = h.clone()
            new[0, keep] = recon(h[0, keep]).to(h.dtype)
            return new
        return h

    if hp.pre:

        def pre_hook(_mod: Any, args: Any, kwargs: Any) -> Any:
            if args:
                return (change(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}

        handle = hp.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    else:

        def hook(_mod: Any, _args: Any, out: Any) -> Any:
            if isinstance(out, torch.Tensor):
                return change(out)
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                return (change(out[0]), *out[1:])
            raise CaptureError(f"module {hp.path} returned {type(out).__name__}: the SAE cannot be spliced there")

        handle = hp.module.register_forward_hook(hook)
    try:
        with torch.inference_mode():
            logits = lm.model(input_ids=ids).logits
    finally:
        handle.remove()
    return logits, seen[0]
