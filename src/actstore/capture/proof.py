"""The proof a capture gives of what it records: each site checked on one batch against an
independent path through the model, before the first batch is stored.

For each block with a recorded site, one forward pass (with output_hidden_states where the
model takes it) reads all eight sites of that block (actstore.capture.sites), and checks:

    resid_post[N] == hidden_states[N + 1]             exactly (not the last block: HF models
                                                     normalise the last hidden state)
    resid_pre[N] == hidden_states[N]                  exactly
    resid_pre + attn_out == resid_mid                 (the residual add, recomputed)
    resid_mid + mlp_out == resid_post                 (resid_pre + attn_out + mlp_out with a
                                                     parallel residual: GPT-NeoX)
    o_proj(attn.z) == attn_out                        (through the post-norm or layer scale
                                                     where the block has one)
    down_proj(mlp.post) == mlp_out                    (idem)
    mlp_in == norm(resid_mid)                         (the MLP's pre-norm applied again)

and, for a batch whose rows have several lengths (an attention_mask with zeros), that each
padded row's real tokens equal that row run alone (padding does not leak into real tokens).
A failing check raises CaptureCheckError naming the site, the error and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actstore.capture import sites
from actstore.errors import CaptureError

# Largest error accepted, relative to the largest magnitude of the compared tensor, by dtype
# (a recomputed linear or norm may round differently from the fused path the model took).
_RTOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2, "float16": 2e-3}
_PAD_RTOL = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 5e-2, "float16": 5e-3}


class CaptureCheckError(CaptureError):
    """A recorded site is not what its name says (raised before anything is stored)."""


@dataclass(frozen=True)
class Check:
    """One check: `what` was compared, `error` the largest relative difference found."""

    site: str
    what: str
    error: float


def prove(forward: Any, hooks: Sequence[Any], inputs: dict[str, Any], points: Any = None) -> list[Check]:
    """Check every TransformerLens site among `hooks` on one batch (see the module docstring).

    Args:
        forward: the module record() calls.
        hooks: record()'s hook points (actstore.capture.hooks.resolve_hooks); module paths
            are not checked.
        inputs: the batch's forward keyword arguments (on the model's device).
        points: a TransformerBridge's hook points (actstore.capture.wrappers.hook_points).

    Returns:
        The checks made, in block order.

    Raises:
        CaptureCheckError: a check failed (the message names the site, the error and the fix).
    """
    from actstore.capture.hooks import resolve_hooks

    blocks = sorted({int(hp.name.split(".")[1]) for hp in hooks if sites.TL_NAME.match(hp.name)})
    if not blocks:
        return []
    every = []
    for k in blocks:
        for h in sites.SITE_HOOKS:
            try:
                every.extend(resolve_hooks(forward, [f"blocks.{k}.{h}"], points))
            except CaptureError:
                continue  # a site this block has not (resid_mid of a parallel block)
    inputs = _few_rows(inputs)
    acts, hidden = _run(forward, every, inputs)
    dtype = str(next(iter(acts.values())).dtype).removeprefix("torch.")
    checks: list[Check] = []
    for k in blocks:
        checks += _block_checks(forward, k, acts, hidden, _RTOL.get(dtype, 1e-5), points is None)
    checks += _padding_checks(forward, hooks, inputs, acts, _PAD_RTOL.get(dtype, 1e-4))
    return checks


def _run(forward: Any, hooks: Sequence[Any], inputs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One forward pass: {site name: tensor (B, T, width)} and the hidden_states (or None)."""
    import torch

    from actstore.capture.record_inputs import accepts

    acts: dict[str, Any] = {}
    handles = []
    for hp in hooks:

        def keep(t: Any, name: str = hp.name) -> None:
            if name not in acts and isinstance(t, torch.Tensor):
                acts[name] = t.detach().clone()

        if hp.pre:
            handles.append(
                hp.module.register_forward_pre_hook(
                    lambda m, a, kw, f=keep: f(a[0] if a else kw.get("hidden_states")), with_kwargs=True
                )
            )
        else:
            handles.append(hp.module.register_forward_hook(lambda m, a, out, f=keep: f(_first(out))))
    # HF models take output_hidden_states (transformers 5 through **kwargs, not a named parameter)
    hf = accepts(forward, "output_hidden_states") or hasattr(getattr(forward, "config", None), "output_hidden_states")
    extra = {"output_hidden_states": True} if hf else {}
    if accepts(forward, "use_cache"):
        extra["use_cache"] = False
    # the base model where there is one: the same blocks, no LM head (no vocabulary-wide logits)
    call = getattr(forward, "base_model", None) if hf else None
    try:
        with torch.inference_mode():
            out = (call if isinstance(call, torch.nn.Module) else forward)(**inputs, **extra)
    finally:
        for h in handles:
            h.remove()
    hidden = getattr(out, "hidden_states", None) if extra.get("output_hidden_states") else None
    return acts, hidden


_PROOF_ROWS = 4  # the rows of the first batch the checks run on (the longest and the shortest among them)
_ALONE_ROWS = 2  # the padded rows each run alone for the padding check


def _few_rows(inputs: dict[str, Any]) -> dict[str, Any]:
    """At most _PROOF_ROWS rows of a batch: the first two, the longest and the shortest (by its
    attention_mask), so the checks cost a small forward pass and still see rows of several lengths."""
    rows = [v.shape[0] for v in inputs.values() if hasattr(v, "shape") and len(v.shape) >= 1]
    if not rows or rows[0] <= _PROOF_ROWS or any(r != rows[0] for r in rows):
        return inputs
    mask = inputs.get("attention_mask")
    pick = {0, 1}
    if mask is not None and mask.dim() == 2:
        lengths = mask.sum(1)
        pick |= {int(lengths.argmax()), int(lengths.argmin())}
    pick = sorted(pick)[:_PROOF_ROWS]
    return {k: v[pick] if hasattr(v, "shape") and len(v.shape) >= 1 else v for k, v in inputs.items()}


def _first(out: Any) -> Any:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _block_checks(forward: Any, k: int, acts: dict[str, Any], hidden: Any, rtol: float, modules: bool) -> list[Check]:
    """The checks of block k among the sites read (see the module docstring)."""
    import torch

    a = {h: acts.get(f"blocks.{k}.{h}") for h in sites.SITE_HOOKS}
    out: list[Check] = []

    def check(site: str, what: str, got: Any, want: Any, exact: bool = False, also: tuple[str, ...] = ()) -> None:
        """site == what (computed as `want`); the check is listed under `site` and `also`."""
        if got is None or want is None:
            return
        name = f"blocks.{k}.{site}"
        if got.shape != want.shape:
            _fail(name, what, f"shape {tuple(got.shape)} is not {tuple(want.shape)}")
        scale = float(want.abs().max()) or 1.0
        err = float((got.float() - want.float()).abs().max()) / scale
        if (exact and not torch.equal(got, want)) or err > rtol:
            _fail(name, what, f"differs by {err:.3g} of its largest value (allowed: {0 if exact else rtol:g})")
        out.extend(Check(f"blocks.{k}.{s}", f"{site} = {what}", err) for s in (site, *also))

    if hidden is not None and k + 1 < len(hidden) - 1:
        check("hook_resid_post", f"hidden_states[{k + 1}]", a["hook_resid_post"], hidden[k + 1], exact=True)
    if hidden is not None:
        check("hook_resid_pre", f"hidden_states[{k}]", a["hook_resid_pre"], hidden[k], exact=True)
    if a["hook_resid_pre"] is not None and a["hook_attn_out"] is not None:
        summed = a["hook_resid_pre"] + a["hook_attn_out"]
        check(
            "hook_resid_mid",
            "resid_pre + attn_out",
            a["hook_resid_mid"],
            summed,
            also=("hook_resid_pre", "hook_attn_out"),
        )
    if a["hook_resid_mid"] is not None and a["hook_mlp_out"] is not None:
        summed = a["hook_resid_mid"] + a["hook_mlp_out"]
        check(
            "hook_resid_post",
            "resid_mid + mlp_out",
            a["hook_resid_post"],
            summed,
            also=("hook_resid_mid", "hook_mlp_out"),
        )
    elif a["hook_resid_pre"] is not None and a["hook_attn_out"] is not None and a["hook_mlp_out"] is not None:
        summed = a["hook_resid_pre"] + a["hook_attn_out"] + a["hook_mlp_out"]  # a parallel residual
        also = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")
        check("hook_resid_post", "resid_pre + attn_out + mlp_out", a["hook_resid_post"], summed, also=also)
    if modules:
        block = _block(forward, k)
        try:
            paths = _module_paths(block)
        except CaptureError:
            paths = []  # a block whose modules are not all found (BERT's post-norm layout): sums only
        with torch.inference_mode():
            for source, target, (what, chain) in paths:
                if a[source] is not None and a[target] is not None:
                    check(target, what, a[target], _apply(block, chain, a[source]), also=(source,))
    return out


def _module_paths(block: Any) -> list[tuple[str, str, tuple[str, list[str]]]]:
    """(site, the site it leads to, (description, module paths applied in turn)) of a block."""
    where = type(block).__name__
    z = sites.locate(block, "attn.hook_z", where).path
    post = sites.locate(block, "mlp.hook_post", where).path
    attn_out = sites.locate(block, "hook_attn_out", where).path
    mlp_out = sites.locate(block, "hook_mlp_out", where).path
    mlp_in = sites.locate(block, "hook_mlp_in", where).path
    z_path = [z] + ([attn_out] if not attn_out.endswith(z.split(".")[0]) else [])
    post_path = [post] + ([mlp_out] if not mlp_out.startswith(mlp_in) else [])
    out = [
        ("attn.hook_z", "hook_attn_out", (_nest(z_path, "attn.hook_z"), z_path)),
        ("mlp.hook_post", "hook_mlp_out", (_nest(post_path, "mlp.hook_post"), post_path)),
    ]
    try:
        norm = sites.locate(block, "hook_resid_mid", where)
    except CaptureError:
        return out  # no resid_mid (a parallel residual)
    if norm.path != mlp_in:  # the MLP's pre-norm (OLMo-2 has none: mlp_in is resid_mid)
        out.append(("hook_resid_mid", "hook_mlp_in", (f"{norm.path}(resid_mid)", [norm.path])))
    return out


def _nest(chain: list[str], x: str) -> str:
    """`b(a(x))` for the modules [a, b] applied in turn."""
    for p in chain:
        x = f"{p}({x})"
    return x


def _apply(block: Any, paths: list[str], x: Any) -> Any:
    for p in paths:
        x = _first(block.get_submodule(p)(x))
    return x


def _block(forward: Any, k: int) -> Any:
    from actstore.capture.hooks import find_blocks

    return find_blocks(forward)[1][k]


def _padding_checks(forward: Any, hooks: Sequence[Any], inputs: dict[str, Any], acts: dict[str, Any], rtol: float):
    """Each padded row's real tokens, run alone, equal the batch's (no padding leaks in)."""
    mask = inputs.get("attention_mask")
    if mask is None or mask.dim() != 2 or bool(mask.all()):
        return []
    out = []
    names = [hp for hp in hooks if hp.name in acts]
    padded = [row for row in range(mask.shape[0]) if not bool(mask[row].all())]
    for row in padded[:_ALONE_ROWS]:
        keep = mask[row].bool()
        alone = {
            k: (v[row : row + 1][:, keep] if v.dim() == 2 and v.shape[:2] == mask.shape else v)
            for k, v in inputs.items()
        }
        solo, _ = _run(forward, names, alone)
        for hp in names:
            got, want = acts[hp.name][row][keep], solo[hp.name][0]
            scale = float(want.abs().max()) or 1.0
            err = float((got.float() - want.float()).abs().max()) / scale
            if err > rtol:
                _fail(
                    hp.name,
                    f"row {row}'s real tokens alone",
                    f"differs by {err:.3g} of its largest value: padding leaks into real tokens "
                    "(pass the attention_mask the model needs, or pad on the side the model expects)",
                )
            out.append(Check(hp.name, f"row {row}'s real tokens = row {row} run alone (no padding leaks in)", err))
    return out


def _fail(site: str, what: str, error: str) -> None:
    raise CaptureCheckError(
        f"capture check failed before anything was stored: {site} is not {what}: {error}. "
        "The site resolves to the wrong tensor for this model; record it by module path "
        "(--layers model.layers.N....) or report the architecture"
    )


def summary(checks: Sequence[Check]) -> dict[str, Any]:
    """The attrs record of the checks: {"checks": {site: [what was checked, ...]}, "max_error": ...}."""
    by_site: dict[str, list[str]] = {}
    for c in checks:
        if c.what not in by_site.setdefault(c.site, []):
            by_site[c.site].append(c.what)
    return {"checks": by_site, "max_error": max((c.error for c in checks), default=0.0)}


LAYER_CONVENTION = (
    "TransformerLens: blocks.N is transformer block N (0-based); blocks.N.hook_resid_post = the "
    "output of block N = HF output_hidden_states[N + 1] (hidden_states[0] is the embeddings)"
)


def before_capture(model: Any, lm: Any, hooks: Sequence[Any], batches: Any, points: Any, attrs: dict[str, Any]) -> Any:
    """Prove the recorded sites on the first of `batches` (before anything is stored) and
    write what was checked into attrs["capture"]["sites"]; returns the batches to record (the
    first one put back). Nothing is checked (and nothing added) without a TransformerLens site.

    Raises:
        CaptureCheckError: a check failed.
    """
    import itertools

    from actstore.capture.record_inputs import as_batch, device_of
    from actstore.capture.wrappers import tool_version

    if not any(sites.TL_NAME.match(hp.name) for hp in hooks):
        return batches
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        return ()
    batch = as_batch(first, lm.forward, device_of(lm.forward))
    checks = prove(lm.forward, hooks, dict(batch.inputs), points) if not batch.args else []
    record = {
        "tool": tool_version(model),
        "layer_convention": LAYER_CONVENTION,
        "widths": {hp.name: hp.width for hp in hooks if hp.width},
        "checked_on": "the first batch, before it was stored",
        **summary([c for c in checks if c.site in {hp.name for hp in hooks}]),
    }
    attrs["capture"] = {**(attrs.get("capture") or {}), "sites": record}
    return itertools.chain([first], it)
