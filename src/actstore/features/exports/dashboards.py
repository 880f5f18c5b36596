"""`actstore export-neuronpedia`: a pass's dashboards in the two forms the field's tools read.

- `OUT/batch-<n>.json`: the JSON of SAEDashboard 0.8.0's Neuronpedia runner
  (`NeuronpediaDashboardBatch`: model_id, layer, sae_set, sae_id_suffix, features), 128
  features a file. Per feature: its top activations (bin_min -1, bin_max the max, as
  SAEDashboard writes its "TOP ACTIVATIONS" group) and each interval's samples (bin_min /
  bin_max the interval, bin_contains the fraction of the feature's active tokens in it, from
  the histogram), each with its token window, values and the top token's index;
  frac_nonzero; the activation histogram; with the decoder and an unembedding, the top
  positive / negative logits and their histogram; the decoder's largest neuron alignments.
- `OUT/<model>/<layer>-<source set>/`: Neuronpedia's export layout, which its importer
  (apps/webapp/app/api/admin/import) reads: model.jsonl, sourceset.jsonl, source.jsonl,
  release.jsonl, and `features/` and `activations/` of `batch-<n>.jsonl.gz` with one row of
  its `Neuron` / `Activation` tables a line (actstore.features.exports.neuronpedia), made from the
  SAEDashboard JSON as Neuronpedia's own convert-saedashboard-to-neuronpedia-export.py does,
  plus the decoder-cosine neighbours (topkCosSimIndices / topkCosSimValues).

A window's tokens are pieces of its decoded text (actstore.inputs.tokentext): they join to
`tokenizer.decode` of its ids; a token holding part of a character has the text before that
character (often ""), the character is on the token that completes it. A logit table's
token alone that holds part of a character is written as its bytes (`\xe4`), never U+FFFD.

Only the positive tail is exported (Neuronpedia's pages read activations as positive); the
tokens the pass left out (BOS, special and template tokens) have value 0, as Neuronpedia's
converter writes BOS with --zero-out-bos-token.
Correlated neurons and features (Pearson over every token) are not computed: empty lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.features.encoders.encoder import Encoder
from actstore.features.exports import neuronpedia
from actstore.features.staging import staged_folder
from actstore.features.topk.passdata import check_store, load_pass, open_store_of
from actstore.features.views import context, relations
from actstore.features.views.logits import applicable_unembedding
from actstore.features.views.sitedata import KIND_INTERVAL, KIND_TOP, gather_rows
from actstore.features.views.windows import text_windows, window_pieces
from actstore.inputs.tokentext import TokenText
from actstore.read.api import ReaderLike

SAEDASHBOARD_VERSION = "0.8.0"
FEATURES_PER_BATCH = 128  # SAEDashboard's n_features_at_a_time default
WINDOW = (32, 8)  # tokens before and after each activation (Neuronpedia shows longer contexts than the site)
KIND = "actstore export-neuronpedia"


def _round(xs: Any, nd: int = 3) -> list[float]:
    return [round(float(x), nd) for x in xs]


def _centres(edges: np.ndarray) -> np.ndarray:
    return (np.concatenate([[0.0], edges]) + np.concatenate([edges, [edges[-1] * 2]])) / 2


def _histogram(counts: np.ndarray, edges: np.ndarray) -> tuple[list[float], list[float]]:
    nz = np.flatnonzero(counts)
    return _round(_centres(edges)[nz], 6), [float(c) for c in counts[nz]]


def _contains(counts: np.ndarray, edges: np.ndarray, lo: float, hi: float) -> float:
    centres = _centres(edges)
    total = counts.sum()
    return round(float(counts[(centres > lo) & (centres <= hi)].sum() / total), 4) if total else 0.0


def export_neuronpedia(
    src: Any,
    out: str | Path,
    *,
    store: ReaderLike | None = None,
    encoder: Encoder | None = None,
    tokenizer: str | None = None,
    unembedding: str | None = None,
    model_id: str | None = None,
    sae_set: str = "actstore",
    creator_id: str = neuronpedia.DEFAULT_CREATOR_ID,
    per_batch: int = FEATURES_PER_BATCH,
    overwrite: bool = False,
    on_store_change: str = "refuse",
) -> Path:
    """Write both layouts into folder `out` (staged, swapped in whole); returns the
    Neuronpedia source folder (`out/<model>/<layer>-<sae_set>`)."""
    from actstore.features.views.site import encoder_from_meta

    p = load_pass(src)
    st = open_store_of(p.meta, store)
    check_store(p.meta, st, on_store_change)
    if st.config.attrs.get("image"):
        raise FeatureError(
            "the Neuronpedia export holds token windows: it takes text stores (use `actstore view` for a ViT store)"
        )
    encoder = encoder or encoder_from_meta(p.meta, st)
    unembedding = applicable_unembedding(unembedding, encoder, image=False)  # before any work
    tok = context.load_tokenizer(st, tokenizer)
    layer = int(p.meta["layer"])
    rows = gather_rows(p)
    rows_pos = np.flatnonzero(rows.sign > 0)
    w = text_windows(
        st, layer, encoder, rows.feature[rows_pos], rows.example[rows_pos], rows.token[rows_pos], window=WINDOW
    )
    tt = TokenText(tok)
    pieces = window_pieces(tt, w)  # each window's tokens: pieces of its decoded text
    feats = p.features["feature"].astype(np.int64)
    logit, text = None, {}
    if unembedding is not None:
        from actstore.features.views.logits import load_unembedding, logit_tables

        logit = logit_tables(encoder.W_dec[feats], load_unembedding(unembedding, encoder.d_in, st))
        more = np.unique(np.concatenate([logit.top_ids.ravel(), logit.bottom_ids.ravel()]))
        text = dict(zip(more.tolist(), tt.labels(more)[0]))  # a token alone: a split character's bytes
    nb = relations.neighbours(encoder.W_dec[feats]) if encoder.W_dec is not None and len(feats) > 1 else None
    edges = np.asarray(p.meta["histogram_edges"], np.float64)
    starts = np.searchsorted(rows.feature[rows_pos], feats)
    ends = np.searchsorted(rows.feature[rows_pos], feats, side="right")
    model = neuronpedia.model_name(model_id or str(st.meta.get("model_id") or ""))
    with staged_folder(out, kind=KIND, overwrite=overwrite, source=st) as stage:
        source = neuronpedia.Source(stage, model, layer, sae_set, creator_id, st, p.meta)
        for b0 in range(0, len(feats), per_batch):
            features = []
            for j in range(b0, min(b0 + per_batch, len(feats))):
                f = int(feats[j])
                counts = np.asarray(p.features["histogram"][j])
                values, heights = _histogram(counts, edges)
                acts = []
                for r in range(int(starts[j]), int(ends[j])):
                    i = rows_pos[r]
                    if rows.kind[i] == KIND_TOP:
                        bins = (-1, round(float(p.features["max"][j]), 3), -1)
                    elif rows.kind[i] == KIND_INTERVAL:
                        lo, hi = float(rows.lo[i]), float(rows.hi[i])
                        bins = (round(lo, 3), round(hi, 3), _contains(counts, edges, lo, hi))
                    else:
                        continue
                    acts.append(_activation(w, r, pieces[r].text, *bins))
                feature = _feature(f, float(p.features["density"][j]), values, heights, acts, p, st)
                if encoder.W_dec is not None:
                    feature |= _alignment(encoder.W_dec[f])
                if logit is not None:
                    feature |= _logits(logit, j, text)
                features.append(feature)
            batch = {
                "model_id": model_id or str(st.meta.get("model_id") or ""),
                "layer": layer,
                "sae_set": sae_set,
                "sae_id_suffix": None,
                "features": features,
            }
            n = b0 // per_batch
            (stage / f"batch-{n}.json").write_text(json.dumps(batch), encoding="utf-8")
            cos = (
                None
                if nb is None
                else {int(feats[j]): (feats[nb[0][j]], nb[1][j]) for j in range(b0, b0 + len(features))}
            )
            source.write_batch(n, features, cos)
        folder = source.folder.relative_to(stage)
    return Path(out) / folder


def _activation(w: Any, r: int, tokens: list[str], bin_min: float, bin_max: float, bin_contains: float) -> dict:
    inside = w.ids[r] >= 0
    first = int(np.argmax(inside))
    return {
        "bin_min": bin_min,
        "bin_max": bin_max,
        "bin_contains": bin_contains,
        "tokens": tokens,
        "values": _round(np.where(w.off[r], 0.0, w.acts[r])[inside]),  # left-out tokens (BOS) as 0
        "qualifying_token_index": int(w.before - first),
    }


def _feature(f: int, density: float, values: list, heights: list, acts: list, p: Any, st: Any) -> dict[str, Any]:
    n_tokens = sum(v["t_max"] for v in st.meta["segments"].values())
    empty = (
        "neuron_alignment_indices neuron_alignment_values neuron_alignment_l1 correlated_neurons_indices "
        "correlated_neurons_l1 correlated_neurons_pearson correlated_features_indices correlated_features_l1 "
        "correlated_features_pearson neg_str neg_values pos_str pos_values"
    ).split()
    return {
        "feature_index": f,
        **{k: [] for k in empty},
        "frac_nonzero": density,
        "freq_hist_data_bar_values": values,
        "freq_hist_data_bar_heights": heights,
        "logits_hist_data_bar_heights": [],
        "logits_hist_data_bar_values": [],
        "n_prompts_total": int(p.meta["store"]["n_examples"]),
        "n_tokens_in_prompt": int(n_tokens),
        "dataset": str(st.meta.get("dataset") or st.meta.get("source") or ""),
        "decoder_weights_dist": [],
        "activations": acts,
        "vector": [],
    }


def _alignment(d: np.ndarray) -> dict[str, Any]:
    idx = np.argsort(-np.abs(d), kind="stable")[:3]
    return {
        "neuron_alignment_indices": [int(i) for i in idx],
        "neuron_alignment_values": _round(d[idx]),
        "neuron_alignment_l1": _round(np.abs(d[idx]) / max(float(np.abs(d).sum()), 1e-30)),
    }


def _logits(L: Any, j: int, text: dict[int, str]) -> dict[str, Any]:
    width = (float(L.hi[j]) - float(L.lo[j])) / len(L.hist[j])
    centres = float(L.lo[j]) + width * (np.arange(len(L.hist[j])) + 0.5)
    return {
        "pos_str": [text[int(t)] for t in L.top_ids[j]],
        "pos_values": _round(L.top_values[j]),
        "neg_str": [text[int(t)] for t in L.bottom_ids[j]],
        "neg_values": _round(L.bottom_values[j]),
        "logits_hist_data_bar_heights": [float(x) for x in L.hist[j]],
        "logits_hist_data_bar_values": _round(centres),
    }
