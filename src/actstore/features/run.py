"""`actstore features`: open the store, read the direction source, run the pass, write
the tables and meta.json (everything checked before the pass starts)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from actstore._version import __version__
from actstore.errors import FeatureError
from actstore.features.encoders import sources
from actstore.features.topk.layerpass import top_activations
from actstore.features.topk.quality import Reconstruction
from actstore.features.topk.tables import store_checksum, write_tables
from actstore.progress import warn
from actstore.read.api import Reader, ReaderLike, as_reader
from actstore.read.family import FamilyStore
from actstore.read.masks import leaves_out_special
from actstore.read.sinkcheck import find_sinks, sink_warning
from actstore.read.state import check_unchanged


def run_features(
    store_path: ReaderLike,
    layer: Any,
    out: str,
    *,
    neurons: bool = False,
    sae: str | None = None,
    saev: str | None = None,
    dictionary: str | None = None,
    directions: str | None = None,
    bias: str | None = None,
    features: str | None = None,
    top_k: int = 20,
    segments: Sequence[str] | None = None,
    keep_special: bool = False,
    n_intervals: int = 5,
    per_interval: int = 5,
    seed: int = 0,
    sign: str = "positive",
    device: str | None = "auto",
    command: str | None = None,
    progress: bool = False,
    store: Reader | None = None,
    downstream: Callable[..., dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run one pass and write its files into `out` (a folder or URL); returns meta.json's content.
    `store_path` is opened (actstore.open) unless `store` is given or it is a Reader already.
    meta.json names the store state the pass read: the sha256 of the manifest bytes the
    store was opened with; a store finalized again, replaced or deleted during the pass is
    refused (StoreChangedError naming both states) and nothing is published. When the
    directions are an SAE (an SAELens checkpoint), meta.json's `quality` holds its
    reconstruction quality over the pass's tokens (actstore.features.topk.quality), and with
    `downstream` (called as downstream(store, layer, encoder, keep_special=, segments=)
    before the pass; the CLI's --model: actstore.capture.splice) its figures too."""
    if store is None:
        from actstore.opener import open as open_store

        store = open_store(store_path) if isinstance(store_path, (str, os.PathLike)) else as_reader(store_path)
    if isinstance(store, FamilyStore):  # a family: the member holding the site
        store, (layer,) = store.one_member(layer, "run one site a pass")
    enc = sources.load(
        neurons_d_model=int(store.d_model) if neurons else None,
        sae=sae,
        saev=saev,
        dictionary=dictionary,
        directions=directions,
        bias=bias,
    )
    if isinstance(layer, str) and layer.lstrip("-").isdigit():
        layer = int(layer)
    layer_n = int(store.layer_number(layer))
    if progress:
        from actstore.progress import say
        from actstore.read.masks import summarize

        say(f"features layer {layer_n}: {summarize(store).line(keep_all=keep_special)}")
    if downstream is not None and not enc.decodes:
        raise FeatureError(
            f"--model measures the CE loss with the SAE spliced in; the {enc.kind} directions are no SAELens SAE "
            "(they have no decoder to splice): drop --model, or pass --sae"
        )
    spliced = downstream(store, layer_n, enc, keep_special=keep_special, segments=segments) if downstream else {}
    recon = Reconstruction(enc) if enc.decodes else None
    tables = top_activations(
        store,
        layer_n,
        enc,
        k=top_k,
        features=features,
        segments=segments,
        keep_special=keep_special,
        n_intervals=n_intervals,
        per_interval=per_interval,
        seed=seed,
        sign=sign,
        device=device,
        progress=progress,
        quality=recon,
    )
    check_unchanged(store, "the feature pass")  # the tables are of the state meta.json names, or nothing is published
    labels = leaves_out_special(store)
    sinks = find_sinks(store, keep_all=keep_special, layers=[layer_n], segments=segments)
    warning = sink_warning(sinks, store)
    if warning and progress:  # (quiet: meta.json's masks.sinks says it)
        warn(warning)
    meta = {
        "store": {"path": _absolute(store.path), "sha256": store_checksum(store), "n_examples": len(store)},
        "layer": layer_n,
        "encoder": enc.describe() | ({"bias": _absolute(bias)} if bias else {}),
        "masks": {
            "token_mask": "content" if labels and not keep_special else None,
            "keep_special": keep_special,
            "segments": list(segments) if segments else list(store.segments),
            "sinks": [s.to_json() for s in sinks],  # kept positions that dwarf the others (actstore.read.sinkcheck)
        },
        "options": {
            "k": top_k,
            "features": features,
            "n_intervals": n_intervals,
            "per_interval": per_interval,
            "seed": seed,
            "sign": sign,
        },
        "command": command,
        "actstore_version": __version__,
    }
    if recon is not None:
        meta["quality"] = recon.result() | spliced
    from actstore.storage.files import export_os_errors

    kept = f"Nothing was published to {out} (an older output there is unchanged)"
    with export_os_errors(f"writing the feature tables of {store.path}", out, "the same command", left=kept):
        return write_tables(tables, out, meta)


def _absolute(path: Any) -> str:
    """A local path made absolute (meta.json is read from other folders); URLs as they are."""
    from actstore.storage import is_url

    text = str(path)
    return text if is_url(text) or "://" in text else os.path.abspath(text)
