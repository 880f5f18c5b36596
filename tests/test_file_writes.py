"""The one home of each file write outside a store's commit: atomic publication
(storage.files.atomic_write and its bytes form) and the gathered write
(storage.durable.write_all), and the chunk grid's padded length (SegmentSpec.t_pad)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from actstore.layout.config import SegmentSpec
from actstore.storage import durable
from actstore.storage.files import atomic_write, atomic_write_bytes, write_new


def test_atomic_write_publishes_what_the_callback_wrote(tmp_path):
    target = tmp_path / "picture.png"
    target.write_bytes(b"old")
    seen = []

    def save(tmp):
        seen.append(tmp)
        assert tmp.parent == tmp_path and tmp.name.startswith(".picture.png.tmp-")
        tmp.write_bytes(b"new bytes")

    atomic_write(target, save, fsync=True)
    assert target.read_bytes() == b"new bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["picture.png"]
    assert not seen[0].exists()


@pytest.mark.parametrize("fail_after_write", [False, True])
def test_a_callback_that_raises_leaves_the_old_file_and_no_temporary(tmp_path, fail_after_write):
    target = tmp_path / "plot.svg"
    target.write_bytes(b"old")

    def save(tmp):
        if fail_after_write:
            tmp.write_bytes(b"half a pic")
        raise ValueError("renderer failed")

    with pytest.raises(ValueError, match="renderer failed"):
        atomic_write(target, save)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.svg"]


def test_an_oserror_that_names_no_file_names_the_target(tmp_path):
    def save(tmp):
        tmp.write_bytes(b"x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "a.json", save)
    assert e.value.filename == str(tmp_path / "a.json")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_bytes_replaces_the_file_whole(tmp_path):
    target = tmp_path / "index.html"
    atomic_write_bytes(target, b"first")
    atomic_write_bytes(target, memoryview(b"second, longer"), fsync=True)
    assert target.read_bytes() == b"second, longer"
    assert [p.name for p in tmp_path.iterdir()] == ["index.html"]


def test_write_new_never_overwrites(tmp_path):
    write_new(tmp_path / "f", b"ab", np.arange(3, dtype=np.uint8), memoryview(b""))
    assert (tmp_path / "f").read_bytes() == b"ab\x00\x01\x02"
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "f", b"x")
    assert (tmp_path / "f").read_bytes() == b"ab\x00\x01\x02"


def test_write_all_resumes_short_gathered_writes(tmp_path, monkeypatch):
    """A writev that writes 5 bytes a call (a short write mid-part, across parts, exactly at
    a part's end) still writes every byte once, in order, across more parts than IOV_MAX."""
    calls = []
    real = os.writev

    def short_writev(fd, buffers):
        calls.append(len(buffers))
        assert len(buffers) <= durable.IOV_MAX
        head = b"".join(bytes(b) for b in buffers)[:5]
        return real(fd, [head])

    monkeypatch.setattr(os, "writev", short_writev)
    monkeypatch.setattr(durable, "IOV_MAX", 4)
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (3, 0, 7, 5, 1, 12, 2, 9, 4)]
    parts.append(np.arange(6, dtype=np.float32).reshape(2, 3))  # a 2-D array: its bytes in C order
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        n = durable.write_all(fd, parts)
    finally:
        os.close(fd)
    want = b"".join(bytes(p) if isinstance(p, bytes) else p.tobytes() for p in parts)
    assert n == len(want) == 43 + 24
    assert path.read_bytes() == want
    assert len(calls) == -(-len(want) // 5)
    assert max(calls) == 4  # gathered: several parts a call


def test_write_all_of_nothing_writes_nothing(tmp_path):
    fd = os.open(tmp_path / "empty", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert durable.write_all(fd, [b"", memoryview(b"")]) == 0
    finally:
        os.close(fd)
    assert (tmp_path / "empty").read_bytes() == b""


@pytest.mark.parametrize(("t_max", "t_chunk", "t_pad"), [(1, 1, 1), (7, 7, 7), (8, 3, 9), (9, 3, 9), (10, 64, 64)])
def test_t_pad_is_the_chunk_grid_covering_t_max(t_max, t_chunk, t_pad):
    seg = SegmentSpec(name="tokens", t_max=t_max, t_chunk=t_chunk, fixed=False)
    assert seg.t_pad == t_pad == seg.n_chunks * t_chunk
    assert t_max <= seg.t_pad < t_max + t_chunk
