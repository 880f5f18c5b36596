"""actstore.hostmem.DeviceCopy on the CPU (the stand-in every CPU test runs; the CUDA
path runs in tests/cuda_check.py) and the shared and torch views of host buffers."""

from __future__ import annotations

import torch

from actstore.hostmem import DONE, DeviceCopy, HostBuffer, hand_over, shared_empty, unreferenced


def test_the_cpu_stand_in_copies_both_ways_and_its_event_is_done():
    copy = DeviceCopy(torch.device("cpu"))
    assert not copy.cuda and not copy.pinned
    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    host = torch.empty(3, 4, dtype=torch.float32)
    copy.to_host(src, host)
    assert torch.equal(host, src) and host.data_ptr() != src.data_ptr()
    assert copy.record() is DONE
    (moved,), event = copy.to_device([host], then=lambda ts: [ts[0].to(torch.float16) * 2])
    assert event is DONE and moved.dtype == torch.float16
    assert torch.equal(moved, (src * 2).half())
    host.zero_()  # the source's memory may be reused once copied
    assert torch.equal(moved, (src * 2).half())
    hand_over([moved], event)  # nothing to wait for on the CPU
    copy.synchronize()


def test_host_buffer_views_share_memory_and_reuse_is_refused_while_a_view_lives():
    b = HostBuffer(64)
    (t,) = b.carve([((4, 4), torch.float32)])
    t.fill_(3.0)
    assert b.array[:64].view("float32").tolist() == [3.0] * 16
    s = shared_empty((8,), torch.float16)
    assert s.is_shared() and s.shape == (8,) and s.dtype == torch.float16
    x = torch.empty(10)
    assert unreferenced(x)
    view = x[:5]
    assert not unreferenced(x)
    del view
    assert unreferenced(x)


def test_the_device_copy_is_spelled_once():
    """Side streams, their events and record_stream appear in hostmem/devcopy.py only: every
    copy between host and device (capture, loaders, the features pass) goes through it."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "actstore"
    steps = ("cuda.Stream(", "record_stream(", "cuda.Event(", "record_event(", "cuda.stream(")
    found = sorted(
        str(p.relative_to(src)) for p in src.rglob("*.py") if any(s in p.read_text(encoding="utf-8") for s in steps)
    )
    assert found == ["hostmem/devcopy.py"]
