"""The importers' sources as their own tools write them: Activault's megabatch files, dictionary_learning's activation caches and SAELens's cached-activation datasets (the importer tests share these)."""

from __future__ import annotations

import io
import json
import os
import uuid

import numpy as np

from actstore import ActStore
from actstore.storage import open_storage

ACTIVAULT_HOOK = "models.layers.3.mlp.post"


def write_hook(
    root, *, n_files=3, batch_size=2, batches_per_file=2, seq=5, d=8, dtype=None, seed=0, hook=ACTIVAULT_HOOK
):
    """A run folder {root}/run/{hook}/ as HookUploader leaves it (dtype: torch.bfloat16 unless
    given); returns (states, ids) per file name."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    storage = open_storage(f"{root}/run/{hook}" if "://" in str(root) else root / "run" / hook)
    files, metadata = {}, None
    for k in range(n_files):
        group_uuid = str(uuid.UUID(int=seed * 1000 + k + 1))
        batches = [
            {
                "states": torch.randn(batch_size, seq, d, generator=g).to(dtype),
                "input_ids": torch.randint(0, 50_000, (batch_size, seq), generator=g),
            }
            for _ in range(batches_per_file)
        ]
        states = torch.cat([b["states"] for b in batches])
        ids = torch.cat([b["input_ids"] for b in batches])
        combined = {
            "states": states,
            "input_ids": ids,
            "tensor_bytes": states.numel() * states.element_size() + ids.numel() * ids.element_size(),
        }
        buf = io.BytesIO()
        torch.save(combined, buf)
        name = f"{group_uuid}--{k + 1}_0.saved.pt"
        storage.put(name, buf.getvalue())
        metadata = {
            "batch_size": batch_size,
            "sequence_length": seq,
            "dtype": str(dtype),
            "d_in": d,
            "batches_per_file": batches_per_file,
            "shape": [batch_size, seq, d],
            "input_ids_shape": [batch_size, seq],
            "bytes_per_file": len(buf.getvalue()),
        }
        files[name] = (states, ids)
    storage.put("metadata.json", json.dumps(metadata).encode())
    mean = torch.zeros(d)
    storage.put(
        "statistics.json",
        json.dumps({"mean": mean.tolist(), "std": (mean + 1).tolist(), "norm": 2.5, "M2": mean.tolist()}).encode(),
    )
    return files


def check_store(store, files, layer=3):
    st = ActStore(store)
    ex = 0
    for name in sorted(files):
        states, ids = files[name]
        for i in range(len(states)):
            got = np.asarray(st[ex, layer])
            assert np.array_equal(
                got.astype(np.float32), states[i].float().numpy()
            )  # exact (bfloat16 is widened on read)
            assert st.token_ids(ex).tolist() == ids[i].tolist()
            ex += 1
    assert len(st) == ex
    return st


def write_cache(root, *, sizes=(23, 17, 9), d=6, context_len=8, seed=0, name="resid_5_out"):
    """collect()'s files for one submodule: shards 0..k-2 counted in config.json, the last not."""
    rng = np.random.default_rng(seed)
    folder = root / name
    os.makedirs(folder, exist_ok=True)
    shards = []
    for i, n in enumerate(sizes):
        acts = rng.standard_normal((n, d)).astype(np.float32)
        mm = np.memmap(folder / f"shard_{i}.memmap", dtype=np.float32, mode="w+", shape=(n, d))
        mm[:] = acts
        mm.flush()
        del mm
        with open(folder / f"shard_{i}.meta", "w") as f:
            json.dump({"shape": [n, d]}, f)
        shards.append(acts)
    with open(folder / "config.json", "w") as f:
        json.dump(
            {
                "batch_size": 4,
                "context_len": context_len,
                "shard_size": 10,
                "d_model": d,
                "shuffle_shards": False,
                "io": "out",
                "total_size": sum(sizes[:-1]),
                "shard_count": len(sizes) - 1,
            },
            f,
        )
    return folder, shards


def tokens_of(st, layer):
    return np.concatenate([np.asarray(st[ex, layer]) for ex in range(len(st))])


SAELENS_HOOK = "blocks.4.hook_resid_post"


def saelens_cache(root, *, n_buffers=2, rows=6, C=8, D=5, dtype="float32", seed=0, hook=SAELENS_HOOK):
    """A cache folder as CacheActivationsRunner leaves it; returns (acts (R, C, D), ids (R, C))."""
    from datasets import Array2D, Dataset, Features, Sequence, Value
    from sae_lens.cache_activations_runner import CacheActivationsRunner

    features = Features(
        {hook: Array2D(shape=(C, D), dtype=dtype), "token_ids": Sequence(Value(dtype="int32"), length=C)}
    )
    import torch

    g = torch.Generator().manual_seed(seed)
    tmp = root / "tmp"
    all_acts, all_ids = [], []
    for i in range(n_buffers):
        acts = torch.randn(rows, C, D, generator=g).to(getattr(torch, dtype))
        ids = torch.randint(0, 30_000, (rows, C), generator=g).to(torch.int32)
        Dataset.from_dict({hook: acts, "token_ids": ids}, features=features).save_to_disk(
            f"{tmp}/shard_{i:05d}", num_shards=1
        )
        all_acts.append(acts)
        all_ids.append(ids)
    (root / "cache").mkdir()
    CacheActivationsRunner._consolidate_shards(tmp, root / "cache", copy_files=False)
    return torch.cat(all_acts).numpy(), torch.cat(all_ids).numpy()
