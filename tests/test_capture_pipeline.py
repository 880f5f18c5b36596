"""The capture pipeline's parts (issue 32): statistics on the device against the float64
reference, layers appended as the hooks made them, buffers reused between captures,
batches moved to the model's device, lengths checked before anything is written, and the
group commit of a durable writer."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from capture_support import tiny_llama

import actstore
from actstore.capture import CaptureError, devstats
from actstore.capture.devstats import moments, running_stats
from actstore.stats import RunningStats


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _reference(x: np.ndarray) -> RunningStats:
    ref = RunningStats(["k"], x.shape[-1])
    ref.update("k", x.reshape(-1, x.shape[-1]))
    return ref


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("block", [2**10, 2**17])
def test_device_moments_equal_the_float64_reference(dtype, block, monkeypatch):
    """float32 blocks merged exactly in float64: mean and variance within 1e-6 (relative) of
    RunningStats.update, which works in float64; count, min, max and non-finite rows exact."""
    monkeypatch.setattr(devstats, "BLOCK_VALUES", block)
    g = torch.Generator().manual_seed(0)
    d = 48
    offset = torch.randn(d, generator=g) * 40  # large means: cancellation would show
    x = (torch.randn(7, 300, d, generator=g) * 3 + offset).to(getattr(torch, dtype))
    x[2, 5, 3] = float("inf")
    x[4, 7] = float("nan")
    stored = x.float().numpy()
    got = running_stats(["k"], d, moments(x).numpy()[None])
    ref = _reference(stored)
    assert got.count[0] == ref.count[0] == 7 * 300 - 2 and got.nonfinite[0] == ref.nonfinite[0] == 2
    assert (got.min[0], got.max[0]) == (ref.min[0], ref.max[0])
    assert _rel(got.mean[0], ref.mean[0]) <= 1e-6 and _rel(got.m2[0], ref.m2[0]) <= 1e-6
    assert got.norm_sum[0] == pytest.approx(ref.norm_sum[0], rel=1e-6)


def test_device_moments_count_only_the_kept_rows_and_the_gpu_path_agrees(monkeypatch):
    monkeypatch.setattr(devstats, "BLOCK_VALUES", 512)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 40, 16, generator=g) * 2 + 7).to(torch.float16)
    keep = torch.rand(5, 40, generator=g) > 0.3
    keep[3] = False  # a whole example left out
    ref = _reference(x.float().numpy()[keep.numpy()])
    blocks = running_stats(["k"], 16, moments(x, keep, overflow=5).numpy()[None])
    head, mean, m2 = devstats._masked_f64(x.reshape(-1, 16), keep.reshape(-1))  # what a GPU runs
    assert blocks.count[0] == ref.count[0] == int(keep.sum()) == int(head[0]) and blocks.overflow[0] == 5
    assert _rel(blocks.mean[0], ref.mean[0]) <= 1e-6 and _rel(blocks.m2[0], ref.m2[0]) <= 1e-6
    np.testing.assert_allclose(mean.numpy(), ref.mean[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m2.numpy(), ref.m2[0], rtol=1e-10)
    empty = running_stats(["k"], 16, moments(x, torch.zeros(5, 40, dtype=torch.bool)).numpy()[None])
    assert empty.count[0] == 0 and np.isinf(empty.min[0])


@pytest.mark.parametrize("layout", [{"zarr_format": 2}, {"shard_examples": 3}, {"compressor": "zstd"}])
def test_a_list_of_layers_is_stored_as_the_stacked_batch(tmp_path, layout):
    """ShardWriter.append(list of L (b, T, D) arrays) == append((b, L, T, D)), in every layout."""
    if layout.get("compressor") == "zstd":
        from zarr.codecs import ZstdCodec

        layout = {"compressor": ZstdCodec()}
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 7, 8)).astype(np.float16)
    kw = dict(layers=[0, 1, 2], d_model=8, tokens=7, stats=True, **layout)
    for name, acts in (("stacked", x), ("layers", [torch.from_numpy(x[:, lp].copy()) for lp in range(3)])):
        with actstore.ShardWriter(tmp_path / name, **kw) as w:
            w.append(acts[:2] if name == "stacked" else [a[:2] for a in acts])
            w.append(acts[2:] if name == "stacked" else [a[2:] for a in acts])
        actstore.finalize(tmp_path / name)
    a, b = actstore.ActStore(tmp_path / "stacked"), actstore.ActStore(tmp_path / "layers")
    for i in range(5):
        for layer in range(3):
            np.testing.assert_array_equal(b[i, layer], x[i, layer])
    np.testing.assert_array_equal(a.stats().m2, b.stats().m2)
    with pytest.raises(actstore.AppendError, match="a list of layers must hold L arrays"):
        with actstore.ShardWriter(tmp_path / "bad", **kw) as w:
            w.append([x[:, 0], x[:, 1, :5]])


def test_plain_token_batches_of_two_lengths_are_refused_before_anything_is_written(tmp_path):
    model, _ = tiny_llama(layers=3)  # (layer 1 is not the last block, whose hidden state HF norms)
    batches = [torch.randint(4, 60, (2, 10)), torch.randint(4, 60, (2, 13))]
    with pytest.raises(CaptureError, match=r"batch 2 holds 13 tokens .* segments=\{'tokens': T_MAX\}"):
        actstore.record(model, batches, tmp_path / "s", layers=[0])
    assert not (tmp_path / "s").exists()

    def gen():  # a generator cannot be looked at first: refused at the batch, the first one kept
        yield from batches

    with pytest.raises(CaptureError, match="batch 2 holds 13 tokens per example but the store keeps 10"):
        actstore.record(model, gen(), tmp_path / "g", layers=[0])
    # Given the budget, record() pads them itself (every token real without an attention_mask).
    actstore.record(model, batches, tmp_path / "p", layers=[1], segments={"tokens": 16})
    actstore.finalize(tmp_path / "p")
    store = actstore.ActStore(tmp_path / "p")
    assert [store.lengths(i)["tokens"] for i in range(4)] == [10, 10, 13, 13]
    with torch.inference_mode():
        want = model(batches[1], output_hidden_states=True).hidden_states[2][1]
    np.testing.assert_array_equal(store[3, 1], want.numpy().astype(np.float16))


def test_buffers_are_reused_by_the_next_capture_and_data_stays_right(tmp_path):
    """The pool's host slots outlive a capture (allocated once per process: kept in the
    capture's spare); a second capture into them stores its own values. (The shard files'
    staging buffers are not used here: a capture lends its rows.)"""
    from actstore.capture import stage

    model, _ = tiny_llama(layers=3)
    g = torch.Generator().manual_seed(3)
    runs = [[torch.randint(4, 60, (3, 6), generator=g) for _ in range(3)] for _ in range(2)]
    for k, batches in enumerate(runs):
        actstore.record(model, batches, tmp_path / f"s{k}", layers=[0, 1], dtype="float32", shard_examples=4)
        assert stage.SPARE.kept()  # kept for the next capture
    spare = stage.SPARE.kept()
    for k, batches in enumerate(runs):
        actstore.finalize(tmp_path / f"s{k}")
        store = actstore.ActStore(tmp_path / f"s{k}")
        with torch.inference_mode():
            for b, ids in enumerate(batches):
                hs = model(ids, output_hidden_states=True).hidden_states
                for j in range(3):
                    np.testing.assert_array_equal(store[b * 3 + j, 1], hs[2][j].numpy())
    assert all(any(s is t for t in stage.SPARE.kept()) for s in spare)


def test_a_durable_commit_syncs_every_file_it_wrote_and_never_the_whole_disk(tmp_path, monkeypatch):
    """ShardWriter(fsync=True): each commit fsyncs the files of its block together (the
    group commit), never syncfs, which would wait for other writers' data."""
    import actstore.storage.durable as durable
    import actstore.storage.local as local

    synced: set[str] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        folder, _, name = path.rpartition("/")
        tmp = re.fullmatch(r"\.(.+)\.tmp-\d+-[0-9a-f]+", name)  # synced, then renamed (its folder synced after)
        synced.add(f"{folder}/{tmp.group(1)}" if tmp else path)
        real(fd)

    def no_syncfs(path):
        raise AssertionError(f"syncfs({path}) in a group commit")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(local, "syncfs", no_syncfs)
    monkeypatch.setattr(durable, "syncfs", no_syncfs)
    for layout in ({"zarr_format": 2}, {"shard_examples": 2}):
        root = tmp_path / f"v{len(layout)}{layout.get('zarr_format', 3)}"
        x = np.random.default_rng(4).standard_normal((5, 2, 9, 8)).astype(np.float32)
        with actstore.ShardWriter(
            root, layers=[0, 1], d_model=8, segments={"t": 9}, fsync=True, stats=True, texts=["k"], **layout
        ) as w:
            for i in range(0, 5, 2):
                w.append(t=x[i : i + 2], lengths=np.full(len(x[i : i + 2]), 9), texts={"k": ["a"] * len(x[i : i + 2])})
                w.commit()
        files = {str(p) for p in root.rglob("*") if p.is_file() and "leases" not in p.parts}
        folders = {str(p) for p in root.rglob("*") if p.is_dir() and "leases" not in p.parts} | {str(root)}
        assert files - synced == set(), f"written, never fsynced: {sorted(files - synced)[:5]}"
        assert folders - synced == set(), f"folders whose new names were never fsynced: {sorted(folders - synced)[:5]}"


class _Hand(torch.nn.Module):
    """A block that hands over a fixed output (what benchmarks/bench_gpu.py --replay does)."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.register_buffer("out", out, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out


class _Handing(torch.nn.Module):
    def __init__(self, outs: list[torch.Tensor]):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Hand(o) for o in outs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            input_ids = blk(input_ids)
        return input_ids


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float32"])
def test_values_beyond_float16_are_refused_or_clipped_to_its_maximum(tmp_path, model_dtype):
    """A bfloat16 or float32 output beyond +-65504: refused before anything of the batch is
    written, or (clip) stored as +-65504 and counted, never as inf (bfloat16 cannot even
    hold 65504: the clip works in float32)."""
    out = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
    out[0, 1, 2], out[1, 4, 7] = 1e6, -3e5
    model = _Handing([out.to(getattr(torch, model_dtype))])
    ids = [torch.zeros(2, 5, dtype=torch.long)]
    with pytest.raises(actstore.Float16OverflowError, match=f"2 finite {model_dtype} values lie beyond the range"):
        actstore.record(model, ids, tmp_path / "r", layers=[0])
    actstore.record(model, ids, tmp_path / "c", layers=[0], on_overflow="clip")
    actstore.finalize(tmp_path / "c")
    store = actstore.ActStore(tmp_path / "c")
    st = store.stats()
    assert (st.overflow[0], st.nonfinite[0], store.manifest.overflow["tokens"]) == (2, 0, 2)
    assert (store[0, 0][1, 2], store[1, 0][4, 7]) == (65504.0, -65504.0) and st.max[0] == 65504.0


@pytest.mark.parametrize("layout", [{"zarr_format": 2}, {"shard_examples": 3}])
def test_lent_rows_are_written_as_they_are_and_released_once_written(tmp_path, layout):
    """append(release=f): a Zarr shard file is written from the caller's rows, and f runs
    once every file holding them is written (a batch spanning two files: after both); the
    chunk-file layout writes at once and releases before append returns."""
    x = np.random.default_rng(6).standard_normal((7, 2, 5, 8)).astype(np.float16)
    released: list[int] = []
    sharded = "shard_examples" in layout
    with actstore.ShardWriter(tmp_path / "s", layers=[0, 1], d_model=8, tokens=5, **layout) as w:
        w.append(x[0:2].copy(), release=lambda: released.append(0))
        assert released == ([] if sharded else [0])  # the first shard file (3 examples) is not full
        w.append([x[2:4, 0].copy(), x[2:4, 1].copy()], release=lambda: released.append(2))  # spans files 0 and 1
        w.commit()  # writes the partial file 1 too; its rows stay lent (it is rewritten whole)
        assert released == [0] if sharded else released == [0, 2]
        w.append(x[4:7].copy(), release=lambda: released.append(4))
        with pytest.raises(actstore.AppendError):
            w.append(x[:1, :, :4], release=lambda: released.append(-1))  # refused: never released
    assert sorted(released) == [0, 2, 4]
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    for i in range(7):
        np.testing.assert_array_equal(np.stack([store[i, 0], store[i, 1]]), x[i])


def test_the_writer_publishes_the_bytes_it_may_hold_lent_and_the_capture_sizes_its_pool_from_it(tmp_path, monkeypatch):
    """lent_bytes: the file being gathered plus the pipeline's bound (or one file when a file
    is larger); a capture's pool may lend that many batches' slots beyond its queue's."""
    from actstore.capture import stage as stage_mod
    from actstore.layout.config import make_config
    from actstore.write.pipeline import MAX_BYTES
    from actstore.write.shardfiles import lent_bytes

    cfg = make_config(layers=[0, 1], d_model=8, segments={"tokens": 6}, dtype="float16", shard_examples=4)
    file_bytes = 4 * 2 * 6 * 8 * 2
    assert cfg.example_bytes() * 4 == file_bytes
    assert lent_bytes(cfg) == file_bytes + MAX_BYTES
    assert lent_bytes(cfg, max_bytes=100) == 2 * file_bytes  # a file larger than the bound goes alone
    made = []
    orig = stage_mod.Stage._start

    def spy(self, out):
        orig(self, out)
        made.append((self.ring.n, self.cfg))

    model, _ = tiny_llama(layers=3)
    batches = [torch.randint(4, 60, (3, 6)) for _ in range(2)]
    monkeypatch.setattr(stage_mod.Stage, "_start", spy)
    actstore.record(model, batches, tmp_path / "s", layers=[0, 1], shard_examples=4, queue_size=2)
    n, got = made[0]
    assert n == 2 + 2 + -(-lent_bytes(got) // (3 * got.example_bytes())) + 1
