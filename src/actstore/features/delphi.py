"""`actstore export-delphi`: every non-zero activation of a dictionary over a stored layer, as
delphi's latent cache (EleutherAI/delphi, eai-delphi 0.1.3: delphi/latents/cache.py
`save_splits` and `save_config`, read by delphi/latents/loader.py `LatentDataset`):

    OUT/<hookpoint>/<start>_<end>.safetensors   one per latent range (`n_splits` ranges, as
                                                delphi cuts them: linspace(0, F, n + 1))
        locations    (N, 3) [example, token position, latent - start], uint16 when every
                     value fits (as delphi chooses), else uint32
        activations  (N,) float16
        tokens       (n_examples, ctx_len) int32, the store's token ids (padding: pad_token_id)
    OUT/<hookpoint>/config.json                 delphi's CacheConfig fields and model_name

Rows are the example and position of `store[ex, layer]`; the tokens the loaders' default
mask leaves out (BOS, specials, chat template) have no activations unless `keep_special`.
Everything non-zero is kept (not only a top k): delphi samples its examples from quantiles
of all of them. The non-zeros are held in memory until the end (14 bytes each at most, as
delphi's own cache holds them) and each file is written header first, then its tensors from
the kept chunks without joining them (safetensors' byte layout; `safetensors.numpy.load_file`
and delphi read it).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.encoders import Encoder
from actstore.features.staging import staged_folder
from actstore.read.api import Reader

N_SPLITS = 5  # delphi's CacheConfig default
BATCH_TOKENS = 4096  # tokens encoded at a time
KIND = "actstore export-delphi"
_DTYPES = {
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
}


def split_bounds(n_latents: int, n_splits: int) -> np.ndarray:
    """delphi's split boundaries: torch.linspace(0, F, n + 1).long() (truncated)."""
    return np.linspace(0, n_latents, n_splits + 1).astype(np.int64)


class DelphiWriter:
    """Collects non-zero activations (example, position, latent, value) and writes the split
    files. `add` takes them as coordinate arrays in any order within a call; calls in
    example order keep each file's rows in (example, position) order, as delphi's are."""

    def __init__(self, n_latents: int, n_examples: int, ctx_len: int, n_splits: int = N_SPLITS) -> None:
        if not 1 <= n_splits <= n_latents:
            raise FeatureError(f"n_splits must be in 1..{n_latents} (the latents). Got {n_splits}.")
        self.bounds = split_bounds(n_latents, n_splits)
        widest = int(np.diff(self.bounds).max())
        small = max(n_examples, ctx_len, widest) <= 1 << 16
        self.loc_dtype = np.dtype(np.uint16 if small else np.uint32)
        self.split_of = np.repeat(np.arange(n_splits, dtype=np.uint8), np.diff(self.bounds))
        self.chunks: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_splits)]
        self.n_latents = n_latents

    def add(self, example: np.ndarray, position: np.ndarray, latent: np.ndarray, value: np.ndarray) -> None:
        """Keep non-zeros given as coordinates (equal-length arrays): one buffer a call, in
        which each split's rows are one contiguous slice (kept as views)."""
        n_splits = len(self.chunks)
        value16 = np.asarray(value).astype(np.float16).view(np.uint16)  # numba moves the bits
        loc = np.empty((len(value16), 3), self.loc_dtype)
        act = np.empty(len(value16), np.uint16)
        counts = _scatter(
            np.asarray(example, np.int64),
            np.asarray(position, np.int64),
            np.asarray(latent, np.int64),
            value16,
            self.split_of,
            self.bounds,
            n_splits,
            loc,
            act,
        )
        act16 = act.view(np.float16)
        o = 0
        for i, c in enumerate(counts.tolist()):
            if c:
                self.chunks[i].append((loc[o : o + c], act16[o : o + c]))
            o += c

    @property
    def n_nonzero(self) -> int:
        return sum(len(a) for split in self.chunks for _, a in split)

    def write(self, folder: Path, tokens: np.ndarray | None) -> list[Path]:
        """One safetensors file a split into `folder`; returns them."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, chunks in enumerate(self.chunks):
            start, end = int(self.bounds[i]), int(self.bounds[i + 1]) - 1
            tensors: list[tuple[str, np.dtype, tuple[int, ...], list[np.ndarray]]] = [
                ("activations", np.dtype(np.float16), (sum(len(a) for _, a in chunks),), [a for _, a in chunks]),
                ("locations", self.loc_dtype, (sum(len(loc) for loc, _ in chunks), 3), [loc for loc, _ in chunks]),
            ]
            if tokens is not None:
                tensors.append(("tokens", np.dtype(np.int32), tokens.shape, [tokens]))
            path = folder / f"{start}_{end}.safetensors"
            write_safetensors(path, tensors)
            paths.append(path)
        return paths


def _scatter_py(example, position, latent, value16, split_of, bounds, n_splits, loc, act):  # noqa: ANN001, ANN202
    """Each non-zero into its split's slice of loc / act (splits in order, input order within
    a split); returns the rows of each split. The numpy reference of _scatter_blocks."""
    split = split_of[latent]
    order = np.argsort(split, kind="stable")
    loc[:, 0] = example[order]
    loc[:, 1] = position[order]
    loc[:, 2] = latent[order] - bounds[split[order]]
    act[:] = value16[order]
    return np.bincount(split, minlength=n_splits)


def _scatter_loop(example, position, latent, value16, split_of, bounds, n_splits, loc, act):  # noqa: ANN001, ANN202
    """_scatter_py in one pass (compiled with numba): each row written at its split's cursor
    (no sort, no temporaries)."""
    counts = np.zeros(n_splits, np.int64)
    for i in range(len(latent)):
        counts[split_of[latent[i]]] += 1
    cur = np.zeros(n_splits, np.int64)
    for s in range(1, n_splits):
        cur[s] = cur[s - 1] + counts[s - 1]
    for i in range(len(latent)):
        s = split_of[latent[i]]
        j = cur[s]
        cur[s] += 1
        loc[j, 0] = example[i]
        loc[j, 1] = position[i]
        loc[j, 2] = latent[i] - bounds[s]
        act[j] = value16[i]
    return counts


try:
    import numba

    _scatter = numba.njit(nogil=True, cache=True)(_scatter_loop)
except ImportError:  # the numpy reference: the same arrays
    _scatter = _scatter_py


def write_safetensors(path: Path, tensors: list[tuple[str, np.dtype, tuple[int, ...], list[np.ndarray]]]) -> None:
    """A safetensors file of tensors given as lists of C-contiguous chunks (name, dtype,
    shape, chunks), written without joining the chunks: the 8-byte header length, the JSON
    header (padded with spaces to 8 bytes), then each tensor's bytes in order."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, chunks in tensors:
        n = sum(c.nbytes for c in chunks)
        if n != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise FeatureError(f"{path}: tensor {name} has {n} bytes for shape {shape}")
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, dtype, _, chunks in tensors:
            for c in chunks:
                f.write(memoryview(np.ascontiguousarray(c, dtype=dtype)).cast("B"))


def export_delphi(
    store: Reader,
    layer: int,
    encoder: Encoder,
    out: str | Path,
    *,
    hookpoint: str | None = None,
    n_splits: int = N_SPLITS,
    keep_special: bool = False,
    device: str | None = "auto",
    model_name: str | None = None,
    pad_token_id: int = 0,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Encode every token of `layer` and write delphi's latent cache into folder `out`
    (staged, swapped in whole); returns the hookpoint folder."""
    from actstore.features.topk import _pick_device
    from actstore.read.masks import leaves_out_special

    device = _pick_device(device)
    encoder.check_input(int(store.d_model), f"layer {layer} of {store.path}")
    if not store.config.token_ids:
        raise FeatureError(
            f"{store.path} keeps no token ids: delphi's cache needs them (a store captured with token_ids)"
        )
    hookpoint = hookpoint or f"layers.{layer}"
    if "/" in hookpoint or hookpoint.startswith("."):
        raise FeatureError(f"the hookpoint must be a folder name (like layers.6). Got {hookpoint!r}.")
    n = len(store)
    ctx_len = sum(s.t_max for s in store.config.segments)
    writer = DelphiWriter(encoder.n_features, n, ctx_len, n_splits)
    tokens = np.full((n, ctx_len), pad_token_id, np.int32)
    labels = _labels(store) if leaves_out_special(store) and not keep_special else None
    bar = _bar(progress, n)
    batch: list[tuple[int, np.ndarray]] = []
    size = n_tokens = 0
    for ex in range(n):
        x = np.asarray(store[ex, layer], np.float32)
        ids = store.token_ids(ex)
        tokens[ex, : len(ids)] = ids
        n_tokens += len(ids)
        batch.append((ex, x))
        size += len(x)
        if size >= BATCH_TOKENS or ex == n - 1:
            _encode(writer, encoder, batch, labels, store, device)
            batch, size = [], 0
        if bar is not None:
            bar(1)
    config = {
        "dataset_repo": str(store.meta.get("dataset") or store.path),
        "dataset_split": "",
        "dataset_name": "",
        "dataset_column": "text",
        "batch_size": 1,
        "cache_ctx_len": ctx_len,
        "n_tokens": n_tokens,
        "n_splits": n_splits,
        "model_name": model_name or str(store.meta.get("model_id") or ""),
        "pad_token_id": pad_token_id,
        "actstore": {"store": str(store.path), "layer": layer, "encoder": encoder.describe()},
    }
    with staged_folder(out, kind=KIND, overwrite=overwrite) as stage:
        writer.write(stage / hookpoint, tokens)
        (stage / hookpoint / "config.json").write_text(json.dumps(config, indent=4), encoding="utf-8")
    return Path(out) / hookpoint


def _labels(store: Reader) -> list[np.ndarray]:
    from actstore.layout import spec

    return [np.asarray(store.field(s + spec.TOKEN_LABELS_SUFFIX)) for s in store.segments]


def _encode(writer: DelphiWriter, encoder: Encoder, batch: list, labels: Any, store: Reader, device: Any) -> None:
    """Encode a batch of examples and keep its non-zeros (the left-out tokens' dropped)."""
    x = np.concatenate([b[1] for b in batch])
    ex = np.concatenate([np.full(len(b[1]), b[0], np.int64) for b in batch])
    pos = np.concatenate([np.arange(len(b[1]), dtype=np.int64) for b in batch])
    if labels is not None:
        keep = np.concatenate([_content(store, labels, b[0]) for b in batch])
        x, ex, pos = x[keep], ex[keep], pos[keep]
    z = encoder.encode(x, device=device)
    r, c = np.nonzero(z)
    writer.add(ex[r], pos[r], c, z[r, c])


def _content(store: Reader, labels: list[np.ndarray], ex: int) -> np.ndarray:
    lengths = store.lengths(ex)
    return np.concatenate([lab[ex, : lengths[s]] == 0 for lab, s in zip(labels, store.segments)])


def _bar(progress: bool, total: int) -> Any:
    if not progress:
        return None
    import sys

    from actstore.progress import bar

    return bar(total=total, desc="examples", unit="example", file=sys.stderr).update
