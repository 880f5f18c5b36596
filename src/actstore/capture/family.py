"""record() of several widths or several models: one aligned family (docs/format.md, section 9).

The sites of each model are grouped by width (measured on the first batch); each (model,
width) group is one member store, recorded by the ordinary record() from the same batches,
so example i and its tokens are the same in every member. Models must share a tokenizer.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from actstore.capture.hooks import Capture, HookPoint, resolve_hooks
from actstore.capture.record_inputs import accepts, as_batch, device_of
from actstore.errors import CaptureError
from actstore.inputs.models import LoadedModel, wrap_module
from actstore.layout.family import Family, Member
from actstore.read.family import member_location
from actstore.write.family import create_family

# Sites that are d_model wide in every decoder (the residual stream and what adds to it):
# a capture of these alone is one store, with no width measured.
D_MODEL_SITE = re.compile(r"^blocks\.-?\d+\.hook_(resid_pre|resid_mid|resid_post|mlp_in|mlp_out|attn_out)$")


def may_differ(layers: Sequence[Any]) -> bool:
    """Whether the sites `layers` names may be of several widths (a module path, or a site
    that is not d_model wide): then their widths are measured before anything is written."""
    return any(not isinstance(x, int) and not D_MODEL_SITE.match(str(x)) for x in layers)


def record_family(
    models: Sequence[Any],
    batches: Sequence[Any],
    store: str | os.PathLike,
    layers: Sequence[int | str],
    record_one: Callable[..., Any],
    *,
    model_id: str | None = None,
    resume: bool = False,
    record_options: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Record `layers` of every model in `models` over `batches` into a family at `store`.

    Args:
        models: torch modules or LoadedModels sharing one tokenizer.
        batches: a sequence of batches (each member reads all of them once).
        store: the family root (a new folder).
        layers: the sites, as record() takes them; each model records all of them.
        record_one: record() of one model into one store.
        model_id: the first model's id (the others' come from their modules).
        resume: continue a family whose record names the same members.
        record_options: the rest of record()'s arguments, for every member.

    Returns:
        The RecordResults of every member, in the family record's order.
    """
    if not batches:
        raise CaptureError("a family capture needs at least one batch")
    lms = [
        m if isinstance(m, LoadedModel) else wrap_module(m, model_id=model_id if i == 0 else None)
        for i, m in enumerate(models)
    ]
    check_same_tokenizer(lms)
    family = Family(tuple(members_of(lms, batches[0], layers)))
    storage = create_family(store, family, resume=resume)
    results = []
    for m in family.members:
        results.append(
            record_one(
                lms[m.model],
                batches,
                member_location(storage, m),
                layers=list(m.sites),
                model_id=m.model_id,
                resume=resume,
                **(record_options or {}),
            )
        )
    return results


def members_of(lms: Sequence[LoadedModel], first: Any, layers: Sequence[int | str]) -> list[Member]:
    """One member per (model, width): the sites of each model grouped by the width of their
    output on batch `first`, in the order the sites are given."""
    members = []
    for i, lm in enumerate(lms):
        groups: dict[int, list[str]] = {}
        for hp in resolve_hooks(lm.forward, layers):
            groups.setdefault(site_width(lm, hp, first), []).append(hp.name)
        for width, sites in groups.items():
            name = f"d{width}" if len(lms) == 1 else f"m{i}-d{width}"
            members.append(Member(name=name, model=i, model_id=lm.model_id, sites=tuple(sites), width=width))
    return members


def widths_on_first(
    lm: LoadedModel, hooks: Sequence[HookPoint], batches: Iterable[Any]
) -> tuple[Iterable[Any], set[int]]:
    """(the batches, still whole, and the widths of `hooks` on the first): a sequence is
    returned as it is; an iterator's first batch is put back in front of the rest."""
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        return batches, set()
    widths = {site_width(lm, hp, first) for hp in hooks}
    return (batches if isinstance(batches, Sequence) else itertools.chain([first], it)), widths


def site_width(lm: LoadedModel, hp: HookPoint, raw: Any) -> int:
    """The width (last dimension) of site `hp`'s output on batch `raw`: one forward pass,
    stopped as soon as the site fires."""
    device = device_of(lm.forward)
    batch = as_batch(raw, lm.forward, device)
    extra = {"use_cache": False} if accepts(lm.forward, "use_cache") else {}
    with Capture(lm.forward, [hp]) as cap:
        out = cap.run({**batch.inputs, **extra}, batch.args)
    return int(next(iter(out.values())).shape[-1])


def check_same_tokenizer(lms: Sequence[LoadedModel]) -> None:
    """Refuse models whose tokenizers (or, without one, vocabulary sizes) differ: the same
    token ids would be different texts."""
    first = lms[0]
    for i, lm in enumerate(lms[1:], start=1):
        a, b = _vocab(first), _vocab(lm)
        if a != b:
            raise CaptureError(
                f"models 0 ({first.model_id}) and {i} ({lm.model_id}) do not share a tokenizer ({_describe(a, b)}): "
                "record models of one tokenizer (a base model and its fine-tune) into one family"
            )


def _vocab(lm: LoadedModel) -> Any:
    tok = lm.tokenizer
    if tok is not None and hasattr(tok, "get_vocab"):
        return ("vocab", tuple(sorted(tok.get_vocab().items())))
    cfg = getattr(getattr(lm, "model", None), "config", None)
    return ("vocab_size", getattr(cfg, "vocab_size", None))


def _describe(a: Any, b: Any) -> str:
    if a[0] != b[0]:
        return "one has a tokenizer, the other none"
    if a[0] == "vocab_size":
        return f"vocabulary sizes {a[1]} and {b[1]}"
    va, vb = dict(a[1]), dict(b[1])
    differ = sorted(set(va.items()) ^ set(vb.items()))[:3]
    return f"vocabularies of {len(va)} and {len(vb)} tokens, differing at {differ}"


def write_models(o: Any, models: Sequence[str], write_one: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """`actstore write STORE --model A --model B` (or sites of several widths): the job of
    options `o` for each model (text models of one tokenizer) and width into one family at
    o.store; returns the summary of the whole (one model of one width: an ordinary store).

    Each member is the whole job (`write_one`, actstore.capture.run.write) of one model and
    one width; the data is tokenized by each model's tokenizer, refused up front unless the
    vocabularies are equal, and the finalized members are checked to hold the same token ids.
    """
    from dataclasses import replace

    from actstore.capture import preflight
    from actstore.capture.options import check_job
    from actstore.capture.target import CaptureTarget
    from actstore.inputs.data import load_source
    from actstore.inputs.models import load_model
    from actstore.inputs.textdecode import Decoding
    from actstore.read.family import FamilyStore
    from actstore.read.store import ActStore

    check_job(o)  # what fails without a model fails first, as in a job of one model
    modalities = [preflight.check_model(replace(o, model=name), CaptureTarget(o.store).identity()) for name in models]
    # the data must open before the family's record is written (nothing is left of a refused run)
    source = load_source(o.data, o.text_field, Decoding(o.encoding, o.errors)).limit(o.max_examples)
    preflight.check_data(o, source, modalities[0])
    import torch

    lms = [load_model(m, device=o.device, torch_dtype=o.model_dtype) for m in models]
    for name, lm in zip(models, lms):
        if lm.modality != "text":
            if len(models) == 1:
                return write_one(o)  # (sites of several widths of an image model: record())
            raise CaptureError(f"--model {name} is a {lm.modality} model; several --model record text models only")
    check_same_tokenizer(lms)
    probe = {"input_ids": torch.zeros((1, 4), dtype=torch.long, device=lms[0].device)}  # measures each site's width
    family = Family(tuple(members_of(lms, probe, o.layers)))
    if len(family.members) == 1:  # one model, one width: an ordinary store
        return write_one(o)
    storage = create_family(o.store, family, resume=o.resume)
    summaries = [
        write_one(replace(o, model=models[m.model], store=str(member_location(storage, m)), layers=tuple(m.sites)))
        for m in family.members
    ]
    if o.finalize:
        FamilyStore(o.store, open_member=ActStore).check_aligned()
    out = dict(summaries[0])
    for key in ("written", "tokens", "bytes", "seconds", "capture_seconds"):
        out[key] = sum(s[key] for s in summaries)
    out["store"] = str(o.store)
    out["family"] = [m.to_json() for m in family.members]
    warnings = [
        f"member {m.name}: {s['sink_warning']}" for m, s in zip(family.members, summaries) if s.get("sink_warning")
    ]
    out["sink_warning"] = "; ".join(warnings) or None
    return out
