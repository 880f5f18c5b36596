"""Dashboards for the tools people already use: the feature JSON that SAEDashboard's
Neuronpedia runner writes (`batch-<n>.json`, SAEDashboard 0.8.0's NeuronpediaDashboardBatch:
model_id, layer, sae_set, sae_id_suffix, features), which Neuronpedia's bulk import and
SAEDashboard's `neuronpedia_export` read, so dashboards are uploaded instead of recomputed.

Per feature: its top activations (bin_min -1, bin_max the max, bin_contains -1, as
SAEDashboard writes its "TOP ACTIVATIONS" group) and each interval's samples (bin_min / bin_max
the interval, bin_contains the fraction of the feature's active tokens in it, estimated from
the histogram), each with its token window, values and the top token's index; frac_nonzero
(density); the activation histogram (bar values: bin centres, heights: counts); with the
decoder and an unembedding, the top positive / negative logits and their histogram; the
decoder direction's largest neuron alignments. Correlations are not computed (empty lists).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from actstore.features import context
from actstore.features.encoders import Encoder
from actstore.errors import FeatureError
from actstore.features.tables import FEATURES, INTERVALS, TOP, read_meta, read_table
from actstore.read.api import ReaderLike

SAEDASHBOARD_VERSION = "0.8.0"
FEATURES_PER_BATCH = 128  # SAEDashboard's n_features_at_a_time default


def _round(xs: Any, nd: int = 3) -> list[float]:
    return [round(float(x), nd) for x in xs]


def _activation(rec: dict[str, Any], bin_min: float, bin_max: float, bin_contains: float) -> dict[str, Any]:
    return {
        "bin_min": bin_min,
        "bin_max": bin_max,
        "bin_contains": bin_contains,
        "tokens": list(rec["tokens"]),
        "values": _round(rec["acts"]),
        "qualifying_token_index": int(rec["center"]),
    }


def _histogram(counts: np.ndarray, edges: np.ndarray) -> tuple[list[float], list[float]]:
    lo = np.concatenate([[0.0], edges])
    hi = np.concatenate([edges, [edges[-1] * 2]])
    nz = np.flatnonzero(counts)
    return _round((lo[nz] + hi[nz]) / 2, 6), [float(c) for c in counts[nz]]


def _contains(counts: np.ndarray, edges: np.ndarray, lo: float, hi: float) -> float:
    centres = (np.concatenate([[0.0], edges]) + np.concatenate([edges, [edges[-1] * 2]])) / 2
    total = counts.sum()
    return round(float(counts[(centres > lo) & (centres <= hi)].sum() / total), 4) if total else 0.0


def export_neuronpedia(
    src: str,
    out: str | os.PathLike,
    *,
    store: ReaderLike | None = None,
    encoder: Encoder | None = None,
    tokenizer: str | None = None,
    unembedding: str | None = None,
    model_id: str | None = None,
    sae_set: str = "actstore",
    per_batch: int = FEATURES_PER_BATCH,
) -> list[Path]:
    """Write `batch-<n>.json` files of `per_batch` features each into folder `out`; returns them."""
    from actstore.features.site import _columns, _group, _open, encoder_from_meta

    meta = read_meta(src)
    store = _open(meta, store)
    if store.config.attrs.get("image"):
        raise FeatureError(
            "the Neuronpedia export holds token windows: it takes text stores (use `actstore view` for a ViT store)"
        )
    encoder = encoder or encoder_from_meta(meta, store)
    tok = context.load_tokenizer(store, tokenizer)
    layer = int(meta["layer"])
    top, feats, ivs = (_columns(read_table(src, n)) for n in (TOP, FEATURES, INTERVALS))
    edges = np.asarray(meta["histogram_edges"], np.float64)
    top_ctx = context.text_windows(store, layer, encoder, top, tok)
    iv_ctx = context.text_windows(store, layer, encoder, ivs, tok)
    W_U = context.load_unembedding(unembedding, encoder.d_in) if unembedding and encoder.W_dec is not None else None
    by_top, by_iv = _group(top["feature"]), _group(ivs["feature"])
    n_tokens = max((sum(v["t_max"] for v in store.meta["segments"].values()),), default=0)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for b0 in range(0, len(feats["feature"]), per_batch):
        features = []
        for j in range(b0, min(b0 + per_batch, len(feats["feature"]))):
            f = int(feats["feature"][j])
            counts = np.asarray(feats["histogram"][j])
            values, heights = _histogram(counts, edges)
            acts = [_activation(top_ctx[i], -1, round(float(feats["max"][j]), 3), -1) for i in by_top.get(f, [])]
            acts += [
                _activation(
                    iv_ctx[i],
                    round(float(ivs["lo"][i]), 3),
                    round(float(ivs["hi"][i]), 3),
                    _contains(counts, edges, float(ivs["lo"][i]), float(ivs["hi"][i])),
                )
                for i in by_iv.get(f, [])
            ]
            feature = {
                "feature_index": f,
                "neuron_alignment_indices": [],
                "neuron_alignment_values": [],
                "neuron_alignment_l1": [],
                "correlated_neurons_indices": [],
                "correlated_neurons_l1": [],
                "correlated_neurons_pearson": [],
                "correlated_features_indices": [],
                "correlated_features_l1": [],
                "correlated_features_pearson": [],
                "neg_str": [],
                "neg_values": [],
                "pos_str": [],
                "pos_values": [],
                "frac_nonzero": float(feats["density"][j]),
                "freq_hist_data_bar_values": values,
                "freq_hist_data_bar_heights": heights,
                "logits_hist_data_bar_heights": [],
                "logits_hist_data_bar_values": [],
                "n_prompts_total": int(meta["store"]["n_examples"]),
                "n_tokens_in_prompt": int(n_tokens),
                "dataset": str(store.meta.get("dataset") or store.meta.get("source") or ""),
                "decoder_weights_dist": [],
                "activations": acts,
                "vector": [],
            }
            if encoder.W_dec is not None:
                d = encoder.W_dec[f]
                idx = np.argsort(-np.abs(d), kind="stable")[:3]
                feature |= {
                    "neuron_alignment_indices": [int(i) for i in idx],
                    "neuron_alignment_values": _round(d[idx]),
                    "neuron_alignment_l1": _round(np.abs(d[idx]) / max(float(np.abs(d).sum()), 1e-30)),
                }
            if W_U is not None:
                table = context.logit_table(encoder.W_dec[f], W_U, tok)
                logits = encoder.W_dec[f].astype(np.float32) @ W_U
                h, e = np.histogram(logits, bins=40)
                feature |= {
                    "pos_str": [t for t, _ in table["positive"]],
                    "pos_values": _round(v for _, v in table["positive"]),
                    "neg_str": [t for t, _ in table["negative"]],
                    "neg_values": _round(v for _, v in table["negative"]),
                    "logits_hist_data_bar_heights": [float(x) for x in h],
                    "logits_hist_data_bar_values": _round((e[:-1] + e[1:]) / 2),
                }
            features.append(feature)
        batch = {
            "model_id": model_id or str(store.meta.get("model_id") or ""),
            "layer": layer,
            "sae_set": sae_set,
            "sae_id_suffix": None,
            "features": features,
        }
        path = out / f"batch-{b0 // per_batch}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(batch), encoding="utf-8")
        os.replace(tmp, path)  # a batch file is whole or absent
        written.append(path)
    return written
