"""TokenLoader's workers (persistent from epoch to epoch, reused shared-memory slots) and
the DeviceFeeder (batches copied ahead to a device on a side thread), on a CPU-only torch:
the CUDA steps are stood in for by host copies (actstore.hostmem.DeviceCopy on the CPU); tests/cuda_check.py runs
the real ones on a GPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from factory import plain_vit_store as vit_store
from loader_checks import rows_of

from actstore.loaders.buffers import Stopped, WorkerBatch, WorkerRing, WorkerSlots
from actstore.loaders.feed import DeviceFeeder
from actstore.torch import TokenStream

CPU = torch.device("cpu")


def epochs(loader, n):
    return [
        [b.clone() if isinstance(b, torch.Tensor) else {**b, "acts": b["acts"].clone()} for b in loader]
        for _ in range(n)
    ]


@pytest.mark.parametrize("return_index", [False, True])
def test_persistent_workers_give_the_batches_of_workers_started_each_epoch(tmp_path, return_index):
    store = vit_store(tmp_path / "s", n=30)
    kw = dict(batch_size=16, seed=3, buffer_bytes=16 * 6 * 2 * 3, return_index=return_index)
    fresh = TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork", persistent_workers=False)
    kept = TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork")
    a, b = epochs(fresh, 3), epochs(kept, 3)
    assert [len(e) for e in b] == [len(e) for e in a] and len(a[0]) == 19
    for ea, eb in zip(a, b):
        for x, y in zip(ea, eb):
            if return_index:
                assert torch.equal(x["acts"], y["acts"]) and torch.equal(x["example"], y["example"])
            else:
                assert torch.equal(x, y)
    assert not torch.equal(
        b[0][0] if not return_index else b[0][0]["acts"], b[1][0] if not return_index else b[1][0]["acts"]
    )
    assert kept.stream.epoch == 3 and kept._slots is not None and kept._slots.busy() == 0  # every slot handed back
    if return_index:  # every token once per epoch
        for e in b:
            assert sorted(rows_of(e)) == sorted(set(rows_of(e))) and len(rows_of(e)) == 30 * 2 * 5


def test_a_loop_that_stops_mid_epoch_continues_with_the_next_batch(tmp_path):
    store = vit_store(tmp_path / "s", n=30)
    kw = dict(batch_size=16, seed=5, buffer_bytes=16 * 6 * 2 * 2)
    want = epochs(TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork"), 2)
    loader = TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork")
    got = []
    for cut in (3, 7):  # stop twice within the first epoch, with batches in flight in the slots
        for i, b in enumerate(loader):
            got.append(b.clone())
            if i + 1 == cut:
                break
    got += [b.clone() for b in loader]  # the rest of epoch 0
    assert loader.stream.epoch == 1
    got += [b.clone() for b in loader]  # epoch 1: the workers' slots were freed at each restart
    flat = [b for e in want for b in e]
    assert len(got) == len(flat) and all(torch.equal(x, y) for x, y in zip(got, flat))


def test_batches_from_worker_slots_stay_valid_when_kept(tmp_path):
    store = vit_store(tmp_path / "s", n=30)
    kw = dict(batch_size=8, seed=1)
    loader = TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork", pin_memory=False)
    kept = list(loader)  # every batch kept: the main process's ring must never overwrite one
    again = [b.clone() for b in TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork")]
    assert len(kept) == len(again) == 38 and all(torch.equal(x, y) for x, y in zip(kept, again))
    assert len({b.data_ptr() for b in kept}) == len(kept)


def test_the_loader_feeds_a_device_through_the_feeder(tmp_path):
    store = vit_store(tmp_path / "s", n=20)
    kw = dict(batch_size=16, seed=2, normalize="standardize")
    want = epochs(TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork"), 2)
    ts = TokenStream(store, prefetch_batches=3, **kw)
    ts.device = CPU  # stands for a CUDA device: the same steps, host copies (DeviceCopy on the CPU)
    loader = ts.loader(num_workers=2, multiprocessing_context="fork")
    got = epochs(loader, 2)
    assert [len(e) for e in got] == [len(e) for e in want] == [13, 13]
    assert all(torch.equal(x, y) for e, f in zip(got, want) for x, y in zip(e, f))
    assert got[0][0].dtype == torch.float32 and loader._slots.busy() == 0
    one = TokenStream(store, prefetch_batches=3, **kw)
    one.device = CPU  # the worker's float16 rows cast and normalised by the device step
    in_process = [b.clone() for b in TokenStream(store, **kw)]
    assert all(
        torch.equal(x, y)
        for x, y in zip(epochs(one.loader(num_workers=1, multiprocessing_context="fork"), 1)[0], in_process)
    )


@pytest.mark.parametrize("mode", ["standardize", "scale"])
def test_workers_ship_the_stored_dtype_and_keys_and_the_main_process_normalises(tmp_path, mode):
    """With normalize=, a worker sends float16 rows and their (layer, segment) keys (half the
    bytes of float32 through shared memory); the batches equal the in-process stream's and
    the statistics' own arithmetic: (x - mean) / sqrt(var + 1e-6), or x * sqrt(D) / mean norm."""
    store = vit_store(tmp_path / "s", n=20, d=8, layers=(0, 1))
    kw = dict(batch_size=16, seed=4, normalize=mode, return_index=True)
    want = [{**b, "acts": b["acts"].clone()} for b in TokenStream(store, **kw)]
    loader = TokenStream(store, **kw).loader(num_workers=1, multiprocessing_context="fork")
    sent = []
    received = loader._received
    loader._received = lambda item: (sent.append(item), received(item))[1]
    got = [{**b, "acts": b["acts"].clone()} for b in loader]
    assert len(got) == len(want) == 13 and all(torch.equal(x["acts"], y["acts"]) for x, y in zip(got, want))
    assert all(isinstance(i, WorkerBatch) and i.batch["acts"].dtype == torch.float16 for i in sent)
    assert all(torch.equal(i.keys, i.batch["layer"]) for i in sent)  # one segment: key = layer position
    assert got[0]["acts"].dtype == torch.float32 and loader._slots.busy() == 0
    st = store.stats()
    for b in got[:3]:
        for row, layer, ex, tok in zip(b["acts"], b["layer"], b["example"], b["token"]):
            k = st.keys.index(f"layer{int(layer)}/tokens")
            x = store[int(ex), int(layer)][int(tok)].astype(np.float64)
            if mode == "standardize":
                ref = (x - st.mean[k]) / np.sqrt(st.m2[k] / st.count[k] + 1e-6)
            else:
                ref = x * np.sqrt(8) / (st.norm_sum[k] / st.count[k])
            np.testing.assert_allclose(row.numpy(), ref, rtol=1e-5, atol=1e-5)


class Source:
    """Batches made on demand, recording how far the feeder has read ahead."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.made = n, fail_at, 0

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError(f"batch {i} failed")
            self.made += 1
            yield {"acts": torch.full((4, 3), float(i)), "mask": torch.ones(4, dtype=torch.bool), "example": i}


def test_the_feeder_moves_each_batch_in_order_and_reads_a_bounded_way_ahead():
    src = Source(20)
    seen = []
    feeder = DeviceFeeder(src, CPU, prefetch=3, keys=("acts",), on_copied=lambda b: seen.append(b["example"]))
    got = []
    for i, b in enumerate(feeder):
        assert src.made <= i + 1 + 3 + 2  # the batch held, `prefetch` queued, one being moved, one taken
        got.append(b)
    assert [b["example"] for b in got] == list(range(20)) == seen
    assert all(
        torch.equal(b["acts"], torch.full((4, 3), float(i))) for i, b in enumerate(got)
    )  # kept: never overwritten
    assert len({b["acts"].data_ptr() for b in got}) == 20


def test_the_feeder_raises_the_sources_error_and_stops_its_thread_when_the_loop_breaks():
    with pytest.raises(RuntimeError, match="batch 5 failed"):
        list(DeviceFeeder(Source(9, fail_at=5), CPU))
    before = threading.active_count()
    for i, _ in enumerate(DeviceFeeder(Source(100), CPU, prefetch=2)):
        if i == 3:
            break
    assert threading.active_count() == before  # the feeder's thread has ended
    with pytest.raises(ValueError, match="prefetch must be an int >= 1. Got 0"):
        DeviceFeeder([], CPU, prefetch=0)


def test_worker_batches_are_unwrapped_and_their_slots_released_after_the_copy():
    released = []
    items = [WorkerBatch(0, i % 2, torch.full((2, 2), float(i))) for i in range(5)]
    feeder = DeviceFeeder(items, CPU, unwrap=lambda b: b.batch, on_copied=lambda b: released.append(b.slot))
    got = [b for b in feeder]
    assert [float(b[0, 0]) for b in got] == [0, 1, 2, 3, 4] and released == [0, 1, 0, 1, 0]
    assert np.all([isinstance(b, torch.Tensor) for b in got])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pair_batches_through_the_device_loader(tmp_path, num_workers):
    from actstore.loaders.feed import DeviceLoader
    from actstore.torch import PairDataset

    store = vit_store(tmp_path / "s", n=20)
    ds = PairDataset(store, return_mask=True)
    kw = dict(batch_size=6, k=2, seed=4, num_workers=num_workers)
    if num_workers:
        kw["multiprocessing_context"] = "fork"
    want = [{k: v.clone() for k, v in b.items()} for b in ds.loader(**kw)]
    loader = DeviceLoader(ds.loader(**kw), CPU, prefetch=2)  # CPU stands for the device (DeviceCopy on the CPU)
    loader.sampler.set_epoch(0)  # the DataLoader's attributes pass through
    got = list(loader)
    assert len(loader) == len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w) and all(torch.equal(g[k], w[k]) for k in w)
    assert len({b["acts"].data_ptr() for b in got}) == 4  # kept batches are distinct memory


def test_the_stream_under_a_loader_stays_a_plain_dataset(tmp_path):
    """A TokenLoader's position and slot flags live on its workers' copies of the stream:
    the same stream under a plain DataLoader afterwards yields plain batches."""
    from torch.utils.data import DataLoader

    store = vit_store(tmp_path / "s", n=20)
    ts = TokenStream(store, batch_size=16, seed=2)
    first = [b.clone() for b in ts.loader(num_workers=2, multiprocessing_context="fork")]
    assert ts._worker_slots is None and ts.position.shared is None
    ts.set_epoch(0)
    plain = list(DataLoader(ts, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert all(isinstance(b, torch.Tensor) for b in plain) and len(plain) == len(first) == 13
    assert all(torch.equal(a, b) for a, b in zip(first, plain))


def _waiting_take(ring: WorkerRing) -> tuple[threading.Thread, dict]:
    """ring.take on another thread (a worker's assembler), its result or error in the dict."""
    out: dict = {}

    def take():
        try:
            out["batch"] = ring.take((2, 3))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=take, daemon=True)
    t.start()
    return t, out


def test_a_worker_waiting_for_a_busy_slot_wakes_when_it_is_given_back():
    slots = WorkerSlots(1, 2, "fork")
    ring = WorkerRing(slots, 0, torch.float32)
    first, second = ring.take((2, 3)), ring.take((2, 3))
    assert slots.flags.tolist() == [[1, 1]] and slots.busy() == 2
    t, out = _waiting_take(ring)  # slot 0 again: blocked until the main process hands it back
    assert "batch" not in out
    slots.give_back(0, 0)
    t.join(timeout=60)  # (a failure guard: the wake comes at once)
    assert not t.is_alive() and ring.last == 0
    assert out["batch"].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert slots.flags.tolist() == [[1, 1]] and second.untyped_storage().data_ptr() != first.data_ptr()


def test_a_worker_waiting_for_a_slot_is_woken_by_the_end_of_its_iteration():
    slots = WorkerSlots(2, 1, "fork")
    ring = WorkerRing(slots, 1, torch.float16)
    ring.stop = threading.Event()
    ring.take((2, 3))
    t, out = _waiting_take(ring)
    ring.stop.set()
    ring.wake()
    t.join(timeout=60)
    assert not t.is_alive() and isinstance(out.get("error"), Stopped)
    assert slots.flags.tolist() == [[0], [1]]  # worker 1's slot still holds its batch
    ring.clear()  # the next iteration: its slot free again, the wake-up drained
    assert slots.busy() == 0 and not slots.freed[1].acquire(False)


def test_one_slot_per_worker_waits_across_processes_for_every_batch(tmp_path, monkeypatch):
    """With one slot each, a worker waits for every batch to be copied out by the main
    process: each wake crosses the process boundary (the DataLoader's timeout guards a hang)."""
    import actstore.loaders.tokenloader as TL

    monkeypatch.setattr(TL, "SLOTS_BEYOND_PREFETCH", 0)
    store = vit_store(tmp_path / "s", n=20)
    kw = dict(batch_size=16, seed=7, buffer_bytes=16 * 6 * 2 * 2)
    lw = dict(num_workers=2, multiprocessing_context="fork", prefetch_factor=1, timeout=120)
    loader = TokenStream(store, **kw).loader(**lw)
    got = [b.clone() for b in loader]
    assert loader._slots.n_slots == 1 and loader._slots.busy() == 0
    monkeypatch.setattr(TL, "SLOTS_BEYOND_PREFETCH", 5)
    want = [b.clone() for b in TokenStream(store, **kw).loader(**lw)]  # slots to spare: no waits
    assert len(got) == len(want) == 13 and all(torch.equal(x, y) for x, y in zip(got, want))


def test_a_workers_error_reaches_the_loop(tmp_path, monkeypatch):
    from actstore.loaders.assemble import BatchMaker

    real = BatchMaker.make
    made = []

    def failing(self, slot, rows, keys):
        made.append(1)
        if len(made) == 3:
            raise OSError("disk gone mid-window")
        return real(self, slot, rows, keys)

    monkeypatch.setattr(BatchMaker, "make", failing)  # the forked worker inherits it
    store = vit_store(tmp_path / "s", n=20)
    loader = TokenStream(store, batch_size=16, seed=1).loader(
        num_workers=1, multiprocessing_context="fork", timeout=120
    )
    got = []
    with pytest.raises(OSError, match="disk gone mid-window"):
        for b in loader:
            got.append(b.clone())
    assert len(got) == 2
