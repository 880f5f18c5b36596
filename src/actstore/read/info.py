"""What `actstore info` reports about a store."""

from __future__ import annotations

import os
from typing import Any

from actstore.read.family import FamilyStore, is_family
from actstore.read.masks import summarize
from actstore.read.sinkcheck import find_sinks, sink_warning
from actstore.read.store import ActStore
from actstore.spoolstate import describe, read_state, spool_lines


def store_info(path: str | os.PathLike, *, sinks: bool = True) -> dict[str, Any]:
    """A JSON-ready description of a finalized store. Without `sinks` it reads the manifest
    (and a listing for the size) alone; the sink check reads a sample of the activations
    (actstore.read.sinkcheck: evenly spread examples, at most SAMPLE_BYTES)."""
    if is_family(path):
        return family_info(FamilyStore(path, open_member=ActStore), sinks=sinks)
    store = ActStore(path)
    cfg = store.config
    n = len(store)
    on_disk = store.storage.stored_bytes()
    tokens = (
        {s.name: int(store.segment(s.name).lengths().sum()) for s in cfg.segments}
        if n
        else {s.name: 0 for s in cfg.segments}
    )
    n_tokens = sum(tokens.values())
    stats = store.stats()
    mask = summarize(store)
    found = find_sinks(store) if n and sinks else []
    spool = read_state(store.storage) if store.removed is not None else None
    return {
        "path": store.storage.url,
        "n_examples": n,
        "layers": list(cfg.layers),
        "d_model": cfg.d_model,
        "dtype": cfg.dtype,
        "zarr_format": cfg.zarr_format,
        "model_id": cfg.model_id,
        "segments": {
            s.name: {
                "shape": [n, cfg.n_layers, s.t_max, cfg.d_model],
                "chunks": [1, 1, s.t_chunk, cfg.d_model],
                "fixed": s.fixed,
                "tokens": tokens[s.name],
                "mean_length": tokens[s.name] / n if n else 0.0,
                "padding": 1 - tokens[s.name] / (n * s.t_max) if n else 0.0,  # share of stored slots that are padding
                "truncated": store.manifest.truncation.get(s.name, {}),
            }
            for s in cfg.segments
        },
        "bytes_on_disk": on_disk,
        "bytes_per_token": (on_disk / (n_tokens * cfg.n_layers)) if n_tokens else None,
        "bytes_per_token_ideal": cfg.d_model * cfg.itemsize,
        "nonfinite": store.manifest.nonfinite,
        "overflow": store.manifest.overflow,
        "shards": [
            {"shard": s.shard, "n_examples": s.n_examples, "complete": s.complete} for s in store.manifest.shards
        ],
        "statistics": stats.summary() if stats is not None else None,
        "attrs": dict(cfg.attrs),
        "created": store.manifest.created,
        "actstore_version": store.manifest.actstore_version,
        "world_size": store.manifest.world_size,
        "layer_names": store.layer_names(),
        "token_ids": cfg.token_ids,
        "mask": mask.to_json(),  # which tokens the readers' default mask keeps, and how many it leaves out
        "mask_line": mask.line(),
        "sinks": [s.to_json() for s in found],  # kept positions over SINK_RATIO x the others' mean norm
        "sink_warning": sink_warning(found, store),
        "spool": describe(spool) if spool is not None else None,
        "partial": (
            {
                "missing_ranks": list(store.manifest.partial.missing_ranks),
                "incomplete_shards": list(store.manifest.partial.incomplete_shards),
            }
            if store.manifest.partial
            else None
        ),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def family_info(family: FamilyStore, *, sinks: bool = True) -> dict[str, Any]:
    """store_info() of an aligned family: each member's sites and width, and its own store_info."""
    members = []
    for m in family.family.members:
        member = family.members[m.name]
        sub = store_info(member.storage.url, sinks=sinks)
        members.append(
            {
                "member": m.name,
                "model": m.model,
                "model_id": m.model_id,
                "width": m.width,
                "sites": list(m.sites),
                "store": sub,
            }
        )
    warnings = [f"member {x['member']}: {x['store']['sink_warning']}" for x in members if x["store"]["sink_warning"]]
    return {
        "path": str(family.path),
        "n_examples": len(family),
        "family": members,
        "sink_warning": "; ".join(warnings) or None,
    }


def format_info(info: dict[str, Any]) -> str:
    """Human-readable rendering of store_info()."""
    if "family" in info:
        return _format_family(info)
    lines = [
        f"store        {info['path']}",
        f"examples     {info['n_examples']:,}",
        f"layers       {info['layers']}",
        f"d_model      {info['d_model']}",
        f"dtype        {info['dtype']} (Zarr format {info['zarr_format']})",
        f"model        {info['model_id']}",
        f"on disk      {_size(info['bytes_on_disk'])}"
        + (
            f"  ({info['bytes_per_token']:.0f} B per stored token vector; {info['bytes_per_token_ideal']} B of data)"
            if info["bytes_per_token"]
            else ""
        ),
        "segments:",
    ]
    for name, s in info["segments"].items():
        tr = s["truncated"]
        lines.append(
            f"  {name:<10} shape {tuple(s['shape'])} chunks {tuple(s['chunks'])} "
            f"{'fixed' if s['fixed'] else 'padded'}, mean length {s['mean_length']:.1f} ({100 * s['padding']:.1f}% padding), "
            f"truncated {tr.get('count', 0)} ({100 * tr.get('fraction', 0.0):.2f}%)"
        )
    bad = {k: v for k, v in info["nonfinite"].items() if v}
    over = {k: v for k, v in info["overflow"].items() if v}
    if bad or over:
        lines.append(f"non-finite   {bad}   clipped overflow {over}")
    lines.append(
        f"shards       {len(info['shards'])}: "
        + ", ".join(
            f"{s['shard']}:{s['n_examples']}{'' if s['complete'] else ' (partial)'}" for s in info["shards"][:20]
        )
        + (" ..." if len(info["shards"]) > 20 else "")
    )
    by_layer: dict[int, list[str]] = {}
    for name, n in info.get("layer_names", {}).items():
        by_layer.setdefault(n, []).append(name)
    for n, names in sorted(by_layer.items()):
        lines.append(f"layer {n:<6} = {', '.join(names)}")
    if info.get("mask_line"):
        lines.append(f"mask         {info['mask_line'].removeprefix('default mask: ')}")
    packing = info.get("attrs", {}).get("packing")
    if isinstance(packing, dict):
        lines.append(_packing(packing))
    bos = (info.get("attrs", {}).get("capture") or {}).get("bos")
    if isinstance(bos, dict) and bos.get("token_0"):  # the capture's --bos and what it made token 0
        lines.append(f"token 0      {bos['token_0']} (--bos {bos.get('option')})")
    lines += site_lines(info.get("attrs", {}))
    if info.get("token_ids"):
        lines.append("token ids    kept (int32 per stored token: store.token_ids(ex))")
    if info.get("world_size"):
        lines.append(f"ranks        {info['world_size']} (world size of the run)")
    if info.get("spool"):
        lines += spool_lines(info["spool"])
    if info.get("partial"):
        p = info["partial"]
        lines.append(
            f"PARTIAL      finalized with --allow-partial: missing ranks {p['missing_ranks'] or 'none'}, "
            f"unclosed shards {p['incomplete_shards'] or 'none'} (resume them and finalize again)"
        )
    if info["statistics"]:
        lines.append("statistics (per layer/segment):")
        lines.append(
            f"  {'key':<22}{'count':>12}{'mean L2':>12}{'mean std':>12}{'min':>12}{'max':>12}{'non-finite':>12}{'overflow':>10}"
        )
        for key, st in info["statistics"].items():
            lines.append(
                f"  {key:<22}{st['count']:>12,}{st['mean_norm']:>12.4g}{st['mean_std']:>12.4g}{st['min']:>12.4g}{st['max']:>12.4g}{st['nonfinite']:>12}{st.get('overflow', 0):>10}"
            )
    return "\n".join(lines)


def _packing(p: dict[str, Any]) -> str:
    """The corpus line of a --pack / --chunk store (its attrs['packing'])."""
    line = f"packing      --{p.get('mode')} --context {p.get('context')}"
    if all(isinstance(p.get(k), int) for k in ("documents", "tokens", "windows")):
        line += f": {p['documents']:,} documents, {p['tokens']:,} tokens in {p['windows']:,} windows"
    if "window_bos" in p:  # the token id each window starts with, or None (--no-window-bos)
        bos = p["window_bos"]
        line += f"; each window starts with token {bos} (labelled special)" if bos is not None else "; no window BOS"
    return line


def site_lines(attrs: dict[str, Any]) -> list[str]:
    """The lines of a store's site checks (attrs["capture"]["sites"], actstore.capture.proof)."""
    rec = (attrs.get("capture") or {}).get("sites")
    if not isinstance(rec, dict):
        return []
    lines = [f"sites        {rec.get('tool')}; {rec.get('layer_convention')}"]
    widths = rec.get("widths") or {}
    checked = rec.get("checks") or {}
    for name in sorted(set(widths) | set(checked)):
        what = "; ".join(checked.get(name, [])) or "not checked"
        lines.append(f"  {name:<26} width {widths.get(name, '?')}  checked: {what}")
    lines.append(f"  largest relative error {rec.get('max_error', 0.0):.3g} ({rec.get('checked_on')})")
    return lines


def _format_family(info: dict[str, Any]) -> str:
    """format_info() of a family: one block per member, each site with its width."""
    members = info["family"]
    lines = [
        f"family       {info['path']}",
        f"examples     {info['n_examples']:,} (every member holds the same examples and tokens)",
        f"members      {len(members)}",
    ]
    for m in members:
        sub = m["store"]
        lines.append(f"member {m['member']}: width {m['width']}, model {m['model']} ({m['model_id']}), {sub['dtype']}")
        by_name = sub.get("layer_names", {})
        for site in m["sites"]:
            lines.append(f"  site {site:<44} width {m['width']}, layer {by_name.get(site, '?')}")
        lines.append("  " + format_info(sub).replace("\n", "\n  "))
    return "\n".join(lines)
