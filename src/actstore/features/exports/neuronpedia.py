"""Neuronpedia's export layout, which its importer reads (hijohnnylin/neuronpedia,
apps/webapp/app/api/admin/import/route.ts and lib/db/import.ts at ebb8426f):

    <model>/<source>/model.jsonl, sourceset.jsonl, source.jsonl, release.jsonl
    <model>/<source>/features/batch-<n>.jsonl.gz      one `Neuron` row a line
    <model>/<source>/activations/batch-<n>.jsonl.gz   one `Activation` row a line

`<source>` is `<layer>-<source set>`. Each line's keys are columns of its table (the importer
inserts them with jsonb_to_recordset, ignoring none and guessing none); the rows are made
from SAEDashboard's feature JSON as Neuronpedia's convert-saedashboard-to-neuronpedia-export.py
makes them (utils/neuronpedia-utils; db_models/ holds the row types). No explanations are
written (`explanations/` is absent; delphi writes explanations).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actstore.read.interface import Reader

DEFAULT_CREATOR_ID = "clkht01d40000jv08hvalcvly"  # the user a self-hosted Neuronpedia seeds (prisma/seed.ts)
GZIP_LEVEL = 5  # as Neuronpedia's converter compresses


def model_name(model_id: str) -> str:
    """A Neuronpedia model id from a store's: its last path part, lower case, [a-z0-9._-] only
    (embedded:smollm2-135m (...) -> smollm2-135m)."""
    name = model_id.split(" ")[0].rstrip("/").split("/")[-1].split(":")[-1].lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", name).strip("-")
    return name or "model"


def _lines(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


class Source:
    """One Neuronpedia source folder under `root`: its metadata files at once, then batches."""

    def __init__(
        self, root: Path, model: str, layer: int, source_set: str, creator_id: str, store: Reader, meta: dict
    ) -> None:
        self.model, self.creator = model, creator_id
        self.source_id = f"{layer}-{source_set}"
        self.folder = root / model / self.source_id
        self.created = datetime.now(timezone.utc).isoformat()
        self.folder.mkdir(parents=True)
        n_tokens = sum(v["t_max"] for v in store.meta["segments"].values())
        dataset = str(store.meta.get("dataset") or store.meta.get("source") or store.path)
        files = {
            "model.jsonl": {
                "id": model,
                "instruct": model.endswith("-it") or "instruct" in model,
                "creatorId": creator_id,
                "displayNameShort": model,
                "displayName": model,
                "createdAt": self.created,
                "updatedAt": self.created,
            },
            "sourceset.jsonl": {
                "modelId": model,
                "name": source_set,
                "creatorId": creator_id,
                "createdAt": self.created,
                "creatorName": "actstore",
                "releaseName": source_set,
                "description": f"{meta['encoder'].get('kind')} {meta['encoder'].get('path') or ''}".strip(),
                "visibility": "PUBLIC",
            },
            "source.jsonl": {
                "id": self.source_id,
                "modelId": model,
                "setName": source_set,
                "creatorId": creator_id,
                "visibility": "PUBLIC",
                "dataset": dataset,
                "num_prompts": int(meta["store"]["n_examples"]),
                "num_tokens_in_prompt": int(n_tokens),
                "createdAt": self.created,
            },
            "release.jsonl": {
                "name": source_set,
                "description": f"actstore features of layer {layer} of {dataset}",
                "descriptionShort": f"actstore features, layer {layer}",
                "creatorName": "actstore",
                "creatorNameShort": "actstore",
                "creatorId": creator_id,
                "urls": [],
                "createdAt": self.created,
            },
        }
        for name, row in files.items():
            (self.folder / name).write_bytes(_lines([row]))

    def write_batch(self, n: int, features: list[dict[str, Any]], cos: dict[int, Any] | None) -> None:
        """features/batch-<n>.jsonl.gz and activations/batch-<n>.jsonl.gz of SAEDashboard
        feature dicts; `cos`: per feature (neighbour ids, cosines)."""
        neurons, activations = [], []
        for fd in features:
            f = fd["feature_index"]
            acts = [self._activation(f, a, i) for i, a in enumerate(fd["activations"])]
            activations += acts
            near = cos.get(f) if cos else None
            neurons.append(
                {
                    "modelId": self.model,
                    "layer": self.source_id,
                    "index": str(f),
                    "creatorId": self.creator,
                    "createdAt": self.created,
                    "maxActApprox": max((a["maxValue"] for a in acts), default=0.0),
                    "hasVector": False,
                    "vector": [],
                    "vectorLabel": None,
                    "hookName": None,
                    "topkCosSimIndices": [] if near is None else [int(i) for i in near[0]],
                    "topkCosSimValues": [] if near is None else [round(float(v), 4) for v in near[1]],
                    **{k: fd[k] for k in _FEATURE_COPIED},
                }
            )
        for sub, rows in (("features", neurons), ("activations", activations)):
            (self.folder / sub).mkdir(exist_ok=True)
            (self.folder / sub / f"batch-{n}.jsonl.gz").write_bytes(
                gzip.compress(_lines(rows), compresslevel=GZIP_LEVEL, mtime=0)
            )

    def _activation(self, f: int, a: dict[str, Any], i: int) -> dict[str, Any]:
        values = a["values"]
        top = max(range(len(values)), key=lambda t: values[t]) if values else 0
        ident = hashlib.sha1(f"{self.model}/{self.source_id}/{f}/{i}".encode()).hexdigest()[:23]
        return {
            "id": "c" + ident + "a",  # a cuid's length (25), unique per (model, source, feature, row)
            "tokens": a["tokens"],
            "modelId": self.model,
            "layer": self.source_id,
            "index": str(f),
            "maxValue": max(values, default=0.0),
            "maxValueTokenIndex": top,
            "minValue": min(values, default=0.0),
            "values": values,
            "creatorId": self.creator,
            "createdAt": self.created,
            "dfaValues": [],
            "lossValues": [],
            "binMin": a["bin_min"],
            "binMax": a["bin_max"],
            "binContains": a["bin_contains"],
            "qualifyingTokenIndex": a["qualifying_token_index"],
        }


_FEATURE_COPIED = (
    "neuron_alignment_indices",
    "neuron_alignment_values",
    "neuron_alignment_l1",
    "correlated_neurons_indices",
    "correlated_neurons_pearson",
    "correlated_neurons_l1",
    "correlated_features_indices",
    "correlated_features_pearson",
    "correlated_features_l1",
    "neg_str",
    "neg_values",
    "pos_str",
    "pos_values",
    "frac_nonzero",
    "freq_hist_data_bar_heights",
    "freq_hist_data_bar_values",
    "logits_hist_data_bar_heights",
    "logits_hist_data_bar_values",
    "decoder_weights_dist",
)
