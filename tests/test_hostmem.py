"""actstore.hostmem: the slot pool (reuse, cap, pinned fallback), the lent hand-back and
the condition-woken bounded queue. Waits are checked with events and joins, never sleeps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from actstore.hostmem import ENDED, BoundedQueue, HostBuffer, Lent, SlotPool, Spare, carve_bytes
from actstore.hostmem import pool as pool_mod

JOIN_S = 30  # a safety bound for a broken wake-up; the waits below end on their event


def _in_thread(fn):
    """Run fn on a thread; (thread, started event, result dict)."""
    started, out = threading.Event(), {}

    def run():
        started.set()
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(JOIN_S)
    return t, out


def _joined(t):
    t.join(JOIN_S)
    assert not t.is_alive(), "the waiting thread was never woken"


def test_a_pool_reuses_a_given_back_buffer_and_replaces_one_too_small():
    p = SlotPool(2, "plain")
    a = p.take(100)
    assert a.nbytes == 100 and a.kind == "plain" and a.array.dtype == np.uint8
    p.give_back(a)
    assert p.take(80) is a  # the same memory, not a new allocation
    p.give_back(a)
    b = p.take(200)  # the free one is too small: replaced, still one of the two slots
    assert b is not a and b.nbytes == 200 and p.made == 1


def test_a_full_pool_waits_until_a_buffer_comes_back():
    p = SlotPool(1, "plain")
    a = p.take(64)
    t, out = _in_thread(lambda: p.take(64))
    p.give_back(a)
    _joined(t)
    assert out["value"] is a


def test_a_failed_pool_wakes_its_waiting_take_with_the_error():
    p = SlotPool(1, "plain")
    p.take(64)
    t, out = _in_thread(lambda: p.take(64))
    err = OSError("disk full")
    p.fail(err)
    _joined(t)
    assert out["error"] is err
    with pytest.raises(OSError, match="disk full"):
        p.take(1)


def test_a_closed_pool_keeps_its_free_buffers_for_the_next_under_the_cap():
    spare = Spare(cap_bytes=300)
    p = SlotPool(3, "plain", spare)
    bufs = [p.take(n) for n in (100, 150, 120)]
    for b in bufs:
        p.give_back(b)
    p.close()
    kept = spare.kept()
    assert sum(b.nbytes for b in kept) <= 300 and len(kept) == 2  # the third would pass the cap
    q = SlotPool(2, "plain", spare)
    got = q.take(110)  # the smallest kept buffer that fits
    assert got in kept and got.nbytes == min(b.nbytes for b in kept if b.nbytes >= 110)
    assert spare.held_bytes == sum(b.nbytes for b in kept) - got.nbytes
    assert spare.take(10, "shared") is None  # kept per kind


def test_pinned_falls_back_to_plain_memory_without_cuda(monkeypatch):
    monkeypatch.setattr(pool_mod, "_cuda_available", lambda: False)
    b = HostBuffer(256, "pinned")
    assert b.kind == "plain" and b.array.nbytes == 256
    spare = Spare(1024)
    p = SlotPool(1, "pinned", spare)
    x = p.take(256)
    assert x.kind == "plain"
    p.give_back(x)
    p.close()
    assert SlotPool(1, "pinned", spare).take(200) is x  # a pinned pool without CUDA reuses it
    with pytest.raises(ValueError, match=r"kind must be one of \['plain', 'pinned', 'shared'\]. Got 'gpu'."):
        HostBuffer(8, "gpu")


def test_carved_arrays_are_aligned_views_of_the_one_buffer():
    shapes = [((3, 5), np.float16), ((7,), np.float64)]
    n = carve_bytes([30, 56])
    assert n == 64 + 64
    b = HostBuffer(n)
    x, y = b.carve_arrays(shapes)
    x[:] = 1.5
    y[:] = np.arange(7)
    assert x.ctypes.data == b.array.ctypes.data and y.ctypes.data == b.array.ctypes.data + 64
    np.testing.assert_array_equal(b.array[:30].view(np.float16), np.full(15, 1.5, np.float16))
    np.testing.assert_array_equal(b.array[64:120].view(np.float64), np.arange(7.0))


def test_lent_releases_once_every_holder_is_done():
    released = []
    lent = Lent(lambda: released.append(True))
    lent.hold()
    lent.hold()
    lent.done()  # the lender's own hold
    lent.done()
    assert released == [] and not lent.released
    lent.done()
    assert released == [True] and lent.released
    with pytest.raises(RuntimeError, match="done\\(\\) called more times than the buffer was held"):
        lent.done()
    with pytest.raises(RuntimeError, match="hold\\(\\) after the buffer was handed back"):
        lent.hold()
    assert released == [True]


def test_lent_is_released_once_when_holders_end_on_several_threads():
    released = []
    lent = Lent(lambda: released.append(threading.get_ident()))
    go = threading.Event()
    for _ in range(8):
        lent.hold()

    def holder():
        go.wait(JOIN_S)
        lent.done()

    threads = [threading.Thread(target=holder) for _ in range(8)]
    for t in threads:
        t.start()
    lent.done()
    go.set()
    for t in threads:
        _joined(t)
    assert len(released) == 1 and released[0] in {t.ident for t in threads} | {threading.get_ident()}


def test_a_queue_get_is_woken_by_a_put_and_a_put_by_a_get():
    q = BoundedQueue(1)
    t, out = _in_thread(q.get)
    assert q.put("a")
    _joined(t)
    assert out["value"] == "a"
    assert q.put("b")
    t, out = _in_thread(lambda: q.put("c"))  # full: waits for room
    assert q.get() == "b"
    _joined(t)
    assert out["value"] is True and q.get() == "c" and len(q) == 0


def test_a_queue_stop_wakes_both_sides():
    q = BoundedQueue(1)
    t_get, got = _in_thread(q.get)
    q.stop()
    _joined(t_get)
    assert got["value"] is ENDED
    q2 = BoundedQueue(1)
    q2.put(1)
    t_put, put = _in_thread(lambda: q2.put(2))
    q2.stop()
    _joined(t_put)
    assert put["value"] is False and q2.get() is ENDED  # stopped: the queued item is abandoned


def test_a_queue_error_wakes_a_waiting_put_and_the_consumer_goes_on():
    q = BoundedQueue(1)
    q.put("x")
    t, out = _in_thread(lambda: q.put("y"))
    err = RuntimeError("writer failed")
    q.fail(err)
    _joined(t)
    assert out["error"] is err
    assert q.get() == "x"  # what was queued is still taken (its buffer goes back)
    with pytest.raises(RuntimeError, match="writer failed"):
        q.put("z")


def test_a_closed_queue_ends_after_its_items():
    q = BoundedQueue(3)
    q.put(1)
    q.put(2)
    t, out = _in_thread(lambda: [q.get(), q.get(), q.get()])
    q.close()
    _joined(t)
    assert out["value"] == [1, 2, ENDED]
    assert q.clear() == [] and q.get() is ENDED
    with pytest.raises(ValueError, match="maxsize must be >= 0. Got -1."):
        BoundedQueue(-1)
