"""The loaders over a saev directory opened with actstore.open(saev_dir): same invariants, values
equal to the exported float32 vectors."""

from __future__ import annotations

import numpy as np
import torch
from loader_checks import check_batch, check_values, expected_rows, rows_of

import actstore
from actstore import ActStore, ShardWriter
from actstore.saev import SaevStore, export_saev
from actstore.torch import PairDataset, TokenStream


def _saev_dir(tmp_path, n=11, t=5, d=6):
    rng = np.random.default_rng(7)
    with ShardWriter(
        tmp_path / "store", layers=[4, 8], d_model=d, tokens=t, token_labels=True, attrs={"cls_token": True}
    ) as w:
        w.append(
            rng.standard_normal((n, 2, t, d)).astype(np.float16),
            token_labels=rng.integers(0, 3, (n, t)).astype(np.uint8),
        )
    actstore.finalize(tmp_path / "store")
    res = export_saev(
        tmp_path / "store",
        tmp_path / "dump",
        protocol="2.0",
        patches_per_shard=4 * t * 2,
        family="dinov2",
        ckpt="facebook/dinov2-small",
        dataset="/d",
        fsync=False,
        progress=False,
    )
    return ActStore(tmp_path / "store"), actstore.open(res.path)


def test_token_stream_over_saev_dir(tmp_path):
    src, store = _saev_dir(tmp_path)
    assert isinstance(store, SaevStore) and store.geometry.n_shards == 3  # 4 examples per shard, short last shard
    ts = TokenStream(store, batch_size=7, buffer_bytes=7 * 6 * 4 * 2, return_index=True)
    batches = list(ts.loader(num_workers=2, multiprocessing_context="fork"))
    assert sorted(rows_of(batches)) == sorted(expected_rows(store)) and len(rows_of(batches)) == 11 * 2 * 5
    check_values(store, ts, batches)
    for b in batches[:3]:  # and they are the original store's values
        for i in range(len(b["acts"])):
            ex, layer, tok = int(b["example"][i]), int(b["layer"][i]), int(b["token"][i])
            np.testing.assert_array_equal(b["acts"][i].numpy(), src[ex, layer][tok].astype(np.float32))
    # Content tokens only: labels.bin gives CLS label 0, so a mask on labels drops it.
    masked = rows_of(list(TokenStream(store, batch_size=16, token_mask="token_labels", return_index=True)))
    labels = store.field("tokens_token_labels")
    assert sorted(masked) == sorted(expected_rows(store, keep={"tokens": labels != 0})) and all(
        t != 0 for *_, t in masked
    )


def test_pair_dataset_over_saev_dir(tmp_path):
    _, store = _saev_dir(tmp_path)
    ds = PairDataset(store, return_mask=True)
    n = 0
    for batch in ds.loader(batch_size=4, num_workers=2, multiprocessing_context="fork"):
        assert batch["acts"].dtype == torch.float32
        check_batch(store, ds, batch)
        n += len(batch["examples"])
    assert n == 11
