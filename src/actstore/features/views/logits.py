"""The logit effect of decoder directions: W_U (d_model, vocab) from a file or, with
`auto`, from the model the store records (the final norm's scale folded in), and per
direction the tokens it raises and lowers most with the histogram of its logits.

A direction d written into the residual stream reaches the logits through the final norm
and W_U. The norm's per-token scale is the same for every vocabulary entry, so the effect's
shape is that of `(gamma * d) @ W_U` (RMSNorm) or `(gamma * (d - mean(d))) @ W_U`
(LayerNorm), gamma the norm's weight: `auto` folds that into W_U once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.read.interface import Reader

AUTO = "auto"
N_LOGITS = 10  # tokens listed on each side
LOGIT_BINS = 40  # bins of each direction's logit histogram
BLOCK = 512  # directions multiplied by W_U at a time (bounds the (BLOCK, vocab) buffer)
UNEMBED_NAMES: Sequence[str] = (
    "lm_head.weight",
    "embed_out.weight",
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
    "gpt_neox.embed_in.weight",
    "wte.weight",
    "W_U",
)
# final norms: (weight key, "rms" or "layer"); the first present is used
FINAL_NORMS: Sequence[tuple[str, str]] = (
    ("model.norm.weight", "rms"),
    ("norm.weight", "rms"),
    ("transformer.ln_f.weight", "layer"),
    ("gpt_neox.final_layer_norm.weight", "layer"),
    ("model.final_layernorm.weight", "layer"),
    ("ln_f.weight", "layer"),
)


@dataclass(frozen=True)
class Unembedding:
    """W (d_model, vocab) float32, the final norm's weight folded in; `norm` says which."""

    W: np.ndarray
    norm: str | None  # None, "rms" or "layer"
    source: str

    def project(self, directions: np.ndarray) -> np.ndarray:
        """(n, d_model) directions -> (n, vocab) logit effects."""
        d = np.asarray(directions, np.float32)
        if self.norm == "layer":
            d = d - d.mean(axis=1, keepdims=True)
        return d @ self.W


def _oriented(W: np.ndarray, d_model: int, where: str) -> np.ndarray:
    W = np.asarray(W, np.float32)
    if W.ndim == 2 and W.shape[0] != d_model and W.shape[1] == d_model:
        W = W.T  # (vocab, d_model) as checkpoints store it
    if W.ndim != 2 or W.shape[0] != d_model:
        raise FeatureError(
            f"the unembedding in {where} is {W.shape}; it must be (d_model={d_model}, vocab) or (vocab, d_model)"
        )
    return np.ascontiguousarray(W)


def load_unembedding(path: str | Any, d_model: int, store: Reader | None = None) -> Unembedding:
    """W_U from `path`: a `.npy` (d_model, vocab), a safetensors file holding `lm_head.weight`
    or tied embeddings, a model folder, or "auto" (the model `store` records)."""
    if str(path) == AUTO:
        if store is None:
            raise FeatureError("--unembedding auto needs the store, to read which model it records")
        return auto_unembedding(store, d_model)
    p = Path(path)
    if p.is_dir():
        return _from_folder(p, d_model)
    if p.suffix == ".npy":
        return Unembedding(_oriented(np.load(p, allow_pickle=False), d_model, str(p)), None, str(p))
    tensors = _safetensors(p, UNEMBED_NAMES)
    key = next((k for k in UNEMBED_NAMES if k in tensors), None)
    if key is None:
        raise FeatureError(f"{p} holds no unembedding; expected one of {list(UNEMBED_NAMES)}")
    return Unembedding(_oriented(tensors[key], d_model, str(p)), None, str(p))


def _safetensors(p: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The tensors of `names` present in safetensors file p (only those are read)."""
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="numpy") as f:
            return {k: f.get_tensor(k) for k in names if k in f.keys()}
    except FeatureError:
        raise
    except Exception as e:  # safetensors' own errors
        raise FeatureError(f"{p} is not a readable safetensors file ({str(e).splitlines()[0]})") from None


def auto_unembedding(store: Reader, d_model: int) -> Unembedding:
    """W_U and the final norm of the model `store.meta["model_id"]` names: an embedded model
    (embedded:smollm2-135m: its GGUF), a model folder, or a hub id in the local cache."""
    name = str(store.meta.get("model_id") or "")
    if not name:
        raise FeatureError(
            f"{store.path} records no model id: pass --unembedding FILE (.npy or safetensors) instead of auto"
        )
    if name.startswith("embedded:smollm2-135m"):
        return _from_gguf(d_model)
    if name.startswith("embedded:"):
        raise FeatureError(f"the model {name!r} has no unembedding (it is not a language model with an LM head)")
    folder = Path(name)
    if not folder.is_dir():
        folder = _cached_snapshot(name)
    return _from_folder(folder, d_model)


def _cached_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise FeatureError(
            f"the store's model {repo_id!r} is neither a folder nor in the local hub cache ({str(e).splitlines()[0]}): "
            "pass --unembedding FILE or a model folder"
        ) from None


def _from_folder(folder: Path, d_model: int) -> Unembedding:
    """W_U (and the final norm) from a model folder's safetensors files (only those tensors read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FeatureError(f"{folder} holds no .safetensors weights: pass --unembedding FILE (.npy (d_model, vocab))")
    found: dict[str, np.ndarray] = {}
    for f in files:
        found |= _safetensors(f, [*UNEMBED_NAMES, *(k for k, _ in FINAL_NORMS)])
    key = next((k for k in UNEMBED_NAMES if k in found), None)
    if key is None:
        raise FeatureError(f"{folder}'s weights hold no unembedding; expected one of {list(UNEMBED_NAMES)}")
    W = _oriented(found[key], d_model, str(folder))
    norm = next(((k, kind) for k, kind in FINAL_NORMS if k in found), None)
    if norm is None:
        return Unembedding(W, None, str(folder))
    kind = norm[1]
    cfg = folder / "config.json"
    if kind == "layer" and cfg.exists() and "rms" in json.loads(cfg.read_text()).get("model_type", ""):
        kind = "rms"
    return _fold(W, found[norm[0]], kind, str(folder))


def _fold(W: np.ndarray, gamma: np.ndarray, kind: str, source: str) -> Unembedding:
    gamma = np.asarray(gamma, np.float32).reshape(-1)
    if gamma.shape[0] != W.shape[0]:
        raise FeatureError(f"{source}: the final norm has {gamma.shape[0]} weights; W_U has d_model={W.shape[0]}")
    return Unembedding(np.ascontiguousarray(W * gamma[:, None]), kind, source)


def _from_gguf(d_model: int) -> Unembedding:
    """The embedded SmolLM2's tied embeddings (dequantised) and its final RMSNorm."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        raise FeatureError("reading the embedded SmolLM2's weights needs gguf: pip install gguf") from None
    from actstore.inputs.embedded import SMOLLM2_GGUF, smollm2_folder

    path = smollm2_folder() / SMOLLM2_GGUF
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]  # tied when no output.weight
    W = _oriented(dequantize(t.data, t.tensor_type), d_model, str(path))
    return _fold(W, np.asarray(tensors["output_norm.weight"].data), "rms", str(path))


@dataclass(frozen=True)
class LogitTables:
    """Per direction: the N_LOGITS token ids it raises most (`top_ids`, `top_values`, highest
    first) and lowers most (`bottom_*`, lowest first), and a LOGIT_BINS histogram of all its
    logits on [`lo`, `hi`]."""

    top_ids: np.ndarray
    top_values: np.ndarray
    bottom_ids: np.ndarray
    bottom_values: np.ndarray
    hist: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def logit_tables(
    directions: np.ndarray, unembed: Unembedding, n: int = N_LOGITS, bins: int = LOGIT_BINS
) -> LogitTables:
    """LogitTables of (F, d_model) directions, BLOCK directions at a time."""
    F = len(directions)
    n = min(n, unembed.W.shape[1])
    out = {k: np.zeros((F, n), np.int64 if k.endswith("i") else np.float32) for k in ("ti", "tv", "bi", "bv")}
    hist = np.zeros((F, bins), np.int64)
    lo, hi = np.zeros(F, np.float32), np.zeros(F, np.float32)
    for b0 in range(0, F, BLOCK):
        L = unembed.project(directions[b0 : b0 + BLOCK])  # (b, vocab)
        top = np.argpartition(-L, n - 1, axis=1)[:, :n]
        bot = np.argpartition(L, n - 1, axis=1)[:, :n]
        rows = np.arange(len(L))[:, None]
        top = np.take_along_axis(top, np.argsort(-L[rows, top], axis=1, kind="stable"), axis=1)
        bot = np.take_along_axis(bot, np.argsort(L[rows, bot], axis=1, kind="stable"), axis=1)
        sl = slice(b0, b0 + len(L))
        out["ti"][sl], out["tv"][sl] = top, L[rows, top]
        out["bi"][sl], out["bv"][sl] = bot, L[rows, bot]
        lo[sl], hi[sl] = L.min(axis=1), L.max(axis=1)
        width = np.where(hi[sl] > lo[sl], hi[sl] - lo[sl], 1.0)
        idx = np.minimum(((L - lo[sl, None]) / width[:, None] * bins).astype(np.int64), bins - 1)
        idx += np.arange(len(L))[:, None] * bins  # one bincount for the block's rows
        hist[sl] = np.bincount(idx.ravel(), minlength=len(L) * bins).reshape(len(L), bins)
    return LogitTables(out["ti"], out["tv"], out["bi"], out["bv"], hist, lo, hi)


def applicable_unembedding(unembedding: str | None, encoder: Any, image: bool) -> str | None:
    """The W_U a view uses, checked before any work: None when there is none to use.

    "auto" means "where it applies": a source with decoder directions on a text store; for
    --neurons (no decoder) or an image store it is None (no logit tables). A W_U named
    explicitly that cannot apply is refused, naming why.
    """
    if unembedding is None:
        return None
    if image:
        why = "this store holds image activations"
    elif encoder.W_dec is None:
        why = f"a {encoder.kind} source has no decoder directions (SAEs and --directions have)"
    else:
        return unembedding
    if unembedding == "auto":
        return None
    raise FeatureError(
        f"--unembedding gives logit tables of decoder directions through a language model's W_U; {why}: "
        "leave it out (--unembedding auto draws them only where they apply)"
    )
