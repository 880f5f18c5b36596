"""TokenStream's pin_memory / device options on a CPU-only torch: what can be checked
without an accelerator. The device path itself (pinned buffers, non_blocking copies on a
side stream, events) is exercised by `python tests/cuda_check.py` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch
from factory import plain_vit_store

from actstore.loaders.buffers import BufferRing
from actstore.torch import TokenStream


def vit_store(path):
    return plain_vit_store(path, n=10, seed=2)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_cpu_device_yields_the_same_cpu_batches(tmp_path, device):
    store = vit_store(tmp_path / "s")
    want = [b.clone() for b in TokenStream(store, batch_size=8, seed=1, normalize="standardize")]
    got = [b.clone() for b in TokenStream(store, batch_size=8, seed=1, normalize="standardize", device=device)]
    assert len(got) == len(want) == 13 and all(g.device.type == "cpu" and torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].dtype == torch.float32


def test_devices_it_cannot_serve_are_refused_up_front(tmp_path):
    store = vit_store(tmp_path / "s")
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match=r"device='cuda' but torch.cuda.is_available\(\) is False: install a CUDA build"
        ):
            TokenStream(store, device="cuda")
    with pytest.raises(ValueError, match=r"moves batches to 'cuda' devices .* move them to meta yourself"):
        TokenStream(store, device="meta")
    with pytest.raises(ValueError, match=r"device must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device. Got 'gpu0'"):
        TokenStream(store, device="gpu0")


def test_pin_memory_without_an_accelerator_warns_and_yields_plain_batches(tmp_path):
    store = vit_store(tmp_path / "s")
    if torch.cuda.is_available():
        ts = TokenStream(store, batch_size=8, pin_memory=True)
        assert all(b.is_pinned() for b in ts)
        return
    with pytest.warns(UserWarning, match="pin_memory=True but no accelerator is available"):
        ts = TokenStream(store, batch_size=8, pin_memory=True)
    assert ts.pin_memory is False and sum(len(b) for b in ts) == 100


class RecordingEvent:
    """Stands for a CUDA event recorded after an asynchronous copy out of a buffer."""

    def __init__(self, log: list):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronized")


def test_a_buffer_an_asynchronous_copy_reads_is_reused_only_after_its_event():
    log: list = []
    ring = BufferRing(2, torch.float16)
    first = ring.take((4, 3))
    ptr = first.data_ptr()
    ring.hold(RecordingEvent(log))  # a copy out of `first` was issued, not yet known to be done
    del first  # the loop dropped its CPU view: only the copy still reads the memory
    second = ring.take((4, 3))
    assert second.data_ptr() != ptr and log == []  # the other slot: no wait
    third = ring.take((4, 3))  # back to the first slot: waits for the copy, then reuses the memory
    assert log == ["synchronized"] and third.data_ptr() == ptr
    del second, third
    ring.take((4, 3))
    ring.take((4, 3))
    assert log == ["synchronized"]  # an event is waited for once
    shared = BufferRing(2, torch.float16, shared=True)
    a = shared.take((2, 2))
    shared.hold(RecordingEvent(log))  # worker buffers are never reused: nothing to wait for
    assert shared.take((2, 2)).data_ptr() != a.data_ptr()
