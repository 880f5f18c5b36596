"""Stores in the legacy (pre-zarr) format, written as the old writer wrote them (tests/test_legacy.py, tests/test_hostile_legacy.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
from pathlib import Path

import numpy as np

LAYERS = [15, 16]


def legacy_records(first: int, n: int, rng: np.random.Generator) -> dict:
    out: dict = {f"layer_{l}": [] for l in LAYERS}
    for i in range(first, first + n):
        seq = 2 + i % (T - 1)  # 2..6 tokens
        for l in LAYERS:
            a = rng.standard_normal((seq, D)).astype(np.float32)
            out[f"layer_{l}"].append(
                {
                    "sample_idx": np.int64(1000 + i) if i % 2 else 1000 + i,  # numpy and plain ints both occur
                    "activation": a,
                    "shape": a.shape,
                    "text_preview": f"text of sample {i}",
                    "metadata": {"token_count": seq, "dataset_idx": np.int64(7 * i), "machine_id": 0},
                }
            )
    return out


def write_legacy(
    root: Path, shards: list[dict], *, protocol: int = 4, raw: dict[int, bytes] | None = None, **md_extra
) -> Path:
    """A legacy directory; `raw` replaces the bytes of shard files (checksums still listed correctly)."""
    root.mkdir(parents=True)
    infos = []
    first = 0
    for k, doc in enumerate(shards):
        data = gzip.compress(pickle.dumps(doc, protocol=protocol)) if raw is None or k not in raw else raw[k]
        name = f"shard_{k + 1:04d}.pkl.gz"
        (root / name).write_bytes(data)
        n = len(doc[f"layer_{LAYERS[0]}"]) if doc else 0
        infos.append(
            {
                "shard_id": k + 1,
                "filename": name,
                "size_bytes": len(data),
                "num_samples": n,
                "layers": LAYERS,
                "sample_id_range": [1000 + first, 1000 + first + n - 1],
                "compressed": True,
                "checksum": "sha256:" + hashlib.sha256(data).hexdigest(),
            }
        )
        first += n
    md = {
        "version": "1.0",
        "created_at": "2025-01-09T12:00:00Z",
        "extraction_config": {
            "model_name": "Qwen/Qwen2.5-7B",
            "model_params": {"hidden_size": D},
            "layers_extracted": LAYERS,
            "max_seq_length": T,
            "batch_size": 16,
        },
        "distributed_config": {"machine_id": 0, "total_machines": 1},
        "shards": infos,
        "statistics": {"total_shards": len(shards), "total_samples": first},
    }
    md.update(md_extra)
    (root / "metadata.json").write_text(json.dumps(md))
    return root


D = 8


T = 6
