"""What the loaders' batches must hold, checked against the store (the loader tests share these)."""

from __future__ import annotations

import numpy as np
import torch


def check_batch(store, ds, batch):
    """Every (example, layer) slice of a batch equals the store's, padding as stored, mask right."""
    acts = batch["acts"]
    b, k = batch["layers"].shape
    assert acts.shape == (b, k, ds.t_total, store.d_model)
    for i in range(b):
        ex = int(batch["examples"][i])
        lens = store.lengths(ex)
        assert batch["lengths"][i].tolist() == [lens[s.name] for s in ds.segments]
        for j in range(k):
            layer = int(batch["layers"][i, j])
            if [sg.name for sg in ds.segments] == list(store.segments):
                # The real tokens of every segment, one after another, are ActStore[ex, layer].
                real = [
                    acts[i, j, int(ds.offsets[s]) : int(ds.offsets[s]) + lens[sg.name]]
                    for s, sg in enumerate(ds.segments)
                ]
                np.testing.assert_array_equal(
                    torch.cat(real).float().numpy(), np.asarray(store[ex, layer], dtype=np.float32)
                )
            for s, seg in enumerate(ds.segments):
                o = int(ds.offsets[s])
                got = acts[i, j, o : o + seg.t_max].float().numpy()
                want = np.asarray(store.segment(seg.name)[ex, layer], dtype=np.float32)
                np.testing.assert_array_equal(got[: lens[seg.name]], want)
                # Past the length: the padding exactly as stored.
                np.testing.assert_array_equal(
                    got, np.asarray(store.segment(seg.name).padded(ex, layer), dtype=np.float32)
                )
        if "mask" in batch:
            # The default mask: real tokens, and of those content only (label 0) where the labels mark token kinds.
            kinds = store.config.default_keeps is not None
            want_mask = np.concatenate(
                [
                    (np.arange(s.t_max) < lens[s.name])
                    & ((store.field(f"{s.name}_token_labels")[ex] == 0) if kinds else True)
                    for s in ds.segments
                ]
            )
            assert batch["mask"][i].tolist() == want_mask.tolist()


def expected_rows(store, layers=None, segments=None, keep=None):
    """Every kept (example, layer, segment position, token) of the store."""
    layers = store.layers if layers is None else layers
    segs = store.segments if segments is None else segments
    out = []
    for ex in range(len(store)):
        lens = store.lengths(ex)
        for layer in layers:
            for si, name in enumerate(segs):
                out.extend((ex, layer, si, t) for t in range(lens[name]) if keep is None or keep[name][ex, t])
    return out


def rows_of(batches):
    return [
        (int(e), int(l), int(s), int(t))
        for b in batches
        for e, l, s, t in zip(b["example"], b["layer"], b["segment"], b["token"])
    ]


def check_values(store, ts, batches):
    """Every yielded row equals the matching row of ActStore[ex, layer] (the segments'
    tokens one after another), in the stream's dtype."""
    rows = {}
    for b in batches:
        assert b["acts"].dtype == ts.dtype
        for i in range(len(b["acts"])):
            ex, layer, tok = int(b["example"][i]), int(b["layer"][i]), int(b["token"][i])
            if (ex, layer) not in rows:
                rows[ex, layer] = np.asarray(store[ex, layer], dtype=np.float32)
            lens = store.lengths(ex)
            names = list(store.segments)
            name = ts.segments[int(b["segment"][i])].name
            assert tok < lens[name]
            at = sum(lens[n] for n in names[: names.index(name)]) + tok
            np.testing.assert_array_equal(b["acts"][i].float().numpy(), rows[ex, layer][at])
