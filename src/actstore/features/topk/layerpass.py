"""`top_activations`: one sequential pass over a layer's real tokens, many features at once.

Examples are read in store order (actstore.features.topk.groups), padding is never encoded, and
the tokens that the loaders' default mask leaves out (token label != 0: BOS, special and
chat template tokens) are left out unless `keep_special`. The kept tokens go to a consumer
(actstore.features.topk.consumers): encoded and accumulated on the host (numba), or on a torch
device (encode, top-k, statistics, histograms and sample pools there; only the results
come back). Memory is O(features x (k + pool)) plus one batch of `batch_elements` feature
values, never tokens x features. The tables are built by actstore.features.topk.collect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from actstore.errors import FeatureError, LayerNotFoundError
from actstore.features.encoders.encoder import Encoder
from actstore.features.topk.collect import SIGNS, FeatureTables, build_tables
from actstore.features.topk.consumers import DeviceConsumer, HostConsumer
from actstore.features.topk.groups import GroupReader
from actstore.progress import updater
from actstore.read.api import ReaderLike, as_reader

MAX_TOP_K = 10_000
DEFAULT_BATCH_ELEMENTS = 1 << 22  # feature values per encoded batch on the host (16 MiB of float32)
DEVICE_BATCH_ELEMENTS = 1 << 26  # ... for the torch update (256 MiB of float32, and its keys)


def parse_features(spec: str | Sequence[int] | None, n_features: int) -> np.ndarray | None:
    """`0-4095,5000` or a list of ids -> sorted unique int64 ids (None: all)."""
    if spec is None:
        return None
    ids: list[int] = []
    if isinstance(spec, str):
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            try:
                lo, hi = int(a), int(b) if b else int(a)
            except ValueError:
                raise FeatureError(f"--features takes ids and ranges like '0-4095,5000'. Got {spec!r}.") from None
            ids.extend(range(lo, hi + 1))
    else:
        ids = [int(x) for x in spec]
    out = np.unique(np.asarray(ids, np.int64))
    if not len(out) or out[0] < 0 or out[-1] >= n_features:
        raise FeatureError(f"features must be ids in 0..{n_features - 1} (the encoder has {n_features}); got {spec!r}")
    return out


def top_activations(
    store: ReaderLike,
    layer: Any,
    encoder: Encoder,
    *,
    k: int = 20,
    features: str | Sequence[int] | None = None,
    segments: Sequence[str] | str | None = None,
    keep_special: bool = False,
    n_intervals: int = 5,
    per_interval: int = 5,
    pool: int | None = None,
    seed: int = 0,
    batch_elements: int | None = None,
    device: str | None = "auto",
    progress: bool | Callable[[int], Any] = False,
    kernel: str = "auto",
    sign: str = "positive",
    mmap: bool = True,
    quality: Any = None,
) -> FeatureTables:
    """Top-k activations, statistics and interval samples of many features, in one pass.

    Args:
        store: a Reader (actstore.open), or a store's path or URL (opened here).
        layer: a stored layer number or name.
        encoder: the directions (actstore.features.encoders.encoder / sources).
        k: top activations per feature and tail (1..MAX_TOP_K).
        features: the feature ids (`"0-4095"` or a list); None: all.
        segments: segment names to read (default all); token positions stay those of `store[ex, layer]`.
        keep_special: include the tokens with a nonzero token label (BOS, specials, template).
        n_intervals, per_interval: SAEDashboard's equal-width intervals of the max, and the
            samples drawn in each (seeded).
        pool: the uniform sample kept per feature for the intervals (default 4 x their total).
        seed: the sampling seed.
        batch_elements: feature values encoded at once (memory: 4 bytes each, a few times);
            default 2**22 on the host, 2**26 for the torch update.
        device: where the encode runs: "cpu", "cuda", "cuda:N" (torch), None (numpy), or
            "auto" (torch on the CPU when torch is installed, else numpy).
        progress: True for a bar on stderr, or a callable taking the examples done.
        kernel: the per-batch update: "numba" (compiled, one read of each value), "numpy"
            (the reference), "torch" (the update on `device` too: only the results come
            back; actstore.features.topk.device), or "auto" (torch on a CUDA device, else numba
            when installed). The same tables either way.
        sign: "positive" (the top k of the positive values), "negative" (the bottom k of the
            negative values) or "both" (actstore.features.topk.collect).
        mmap: on a local store of raw chunks, map its files and read the stored rows in
            place (actstore.features.topk.groups); False reads them into buffers.
        quality: a Reconstruction (actstore.features.topk.quality) that every encoded batch
            feeds: an SAE's reconstruction quality over the pass's tokens.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_TOP_K:
        raise FeatureError(f"--top-k must be an int in 1..{MAX_TOP_K}. Got {k!r}.")
    if not (isinstance(n_intervals, int) and n_intervals >= 1 and isinstance(per_interval, int) and per_interval >= 0):
        raise FeatureError(
            f"intervals need n_intervals >= 1 and per_interval >= 0. Got {n_intervals!r}, {per_interval!r}."
        )
    if sign not in SIGNS:
        raise FeatureError(f"--sign must be one of {list(SIGNS)}. Got {sign!r}.")
    store = as_reader(store)
    layer = store.layer_number(layer)
    if int(layer) not in [int(x) for x in store.layers]:
        raise LayerNotFoundError(f"layers [{layer}] are not stored; this store holds layers {list(store.layers)}")
    layer = int(layer)
    encoder.check_input(int(store.d_model), f"layer {layer} of {store.path}")
    ids = parse_features(features, encoder.n_features)
    device = pick_device(device)
    kernel = _pick_kernel(kernel, device)
    n_f = encoder.n_features if ids is None else len(ids)
    pool = 4 * n_intervals * per_interval if pool is None else int(pool)
    if batch_elements is None:
        batch_elements = DEVICE_BATCH_ELEMENTS if kernel == "torch" else DEFAULT_BATCH_ELEMENTS
    tok_batch = max(1, batch_elements // max(1, n_f))
    kw = dict(k=int(k), pool=pool, seed=int(seed), sign=sign, tok_batch=tok_batch, quality=quality)
    if kernel == "torch":
        from actstore.features.encoders.torchenc import torch_device

        consumer: Any = DeviceConsumer(encoder, ids, device=torch_device(device or "cpu"), **kw)
    else:
        consumer = HostConsumer(encoder, ids, kernel=kernel, device=device, **kw)
    groups = GroupReader(
        store, layer, segments, keep_special, device=consumer.device if kernel == "torch" else None, mmap=mmap
    )
    bar = updater(progress, len(store), "features", "ex")
    for exs, flat, rows, ords in groups:
        consumer.group(flat, rows, ords)
        if bar is not None:
            bar(len(exs))
    pos, neg = consumer.finish()
    feat_ids = np.arange(n_f, dtype=np.int64) if ids is None else ids
    return build_tables(pos, neg, feat_ids, n_intervals, per_interval, sign)


def _pick_kernel(kernel: str, device: str | None) -> str:
    if kernel not in ("auto", "numba", "numpy", "torch"):
        raise FeatureError(f"kernel must be one of ['auto', 'numba', 'numpy', 'torch']. Got {kernel!r}.")
    if kernel == "torch" and device is None:
        raise FeatureError("kernel='torch' needs torch: pass device='cpu' or 'cuda' (pip install 'actstore[torch]')")
    if kernel == "auto" and device is not None and device != "cpu":
        return "torch"  # on an accelerator the whole pass stays there
    return kernel


def pick_device(device: str | None) -> str | None:
    if device != "auto":
        if device is not None:
            from actstore.features.encoders.torchenc import torch_device

            torch_device(device)  # a missing torch or accelerator is refused before the pass
        return device
    import importlib.util

    return "cpu" if importlib.util.find_spec("torch") is not None else None
