"""store[ex, layer] from a mapped local Zarr shard file (ChunkIO.read_mapped): one copy
from the page cache when the file's checked index stores the example densely in order and
every page is resident; the read path otherwise, with its damage checks."""

from __future__ import annotations

import numpy as np
import pytest
from crc32c import crc32c

from actstore import ActStore, ShardWriter, finalize
from actstore.errors import CorruptChunkError

ARRAY = "shards/shard-00000.zarr/arrays/tokens_activations"


def make(root, n=9, dtype="float16") -> tuple[ActStore, np.ndarray]:
    rng = np.random.default_rng(0)
    acts = rng.standard_normal((n, 2, 16, 64)).astype(np.float32)
    with ShardWriter(
        root, shard=0, layers=[2, 5], d_model=64, segments={"tokens": 16}, dtype=dtype, zarr_format=3, shard_examples=4
    ) as w:
        w.append(acts, lengths=np.arange(n) % 16 + 1)
    finalize(root)
    return ActStore(root), acts


def io_of(st: ActStore):
    return st._shard(0).io["tokens"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_mapped_reads_equal_the_written_values_and_the_read_path(tmp_path, dtype):
    st, acts = make(tmp_path / "s", dtype=dtype)
    for ex in range(9):
        for lp, layer in enumerate((2, 5)):
            n = ex % 16 + 1
            got = st[ex, layer]
            assert got.shape == (n, 64) and got.flags.writeable and got.flags.c_contiguous
            want = acts[ex, lp, :n].astype(np.float16) if dtype == "float16" else acts[ex, lp, :n]
            if dtype == "bfloat16":  # bf16 keeps the top 16 bits (rounded)
                np.testing.assert_allclose(got, want, rtol=2**-7)
            else:
                np.testing.assert_array_equal(got, want)
            out = np.empty((16, 64), st._act_dtype)
            assert io_of(st).read_mapped(ex, lp, out) is True  # warm and dense: the mapped copy
            ref = np.empty_like(out)
            io_of(st).read_into(ex, lp, ref)
            np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8))
    got = st[3, 5]
    got[:] = 0  # the caller's own array: the next read is unchanged
    assert np.abs(st[3, 5]).sum() > 0


def test_a_file_truncated_after_it_was_mapped_reads_as_damage_not_a_crash(tmp_path):
    st, acts = make(tmp_path / "s")
    first = st[0, 5].copy()  # maps shard file 0 (examples 0..3)
    path = tmp_path / "s" / ARRAY / "c/0/0/0/0"
    nb = 16 * 64 * 2
    with open(path, "r+b") as f:
        f.truncate(2 * nb)  # example 0's two layers are left
    np.testing.assert_array_equal(st[0, 5], first)  # its pages are still in the page cache
    out = np.empty((16, 64), np.float16)
    assert io_of(st).read_mapped(2, 0, out) is False  # past the end: its pages left the page cache
    with pytest.raises(CorruptChunkError, match="is truncated"):
        st[2, 2]


def test_a_shard_file_in_another_order_is_read_through_its_index(tmp_path):
    """A valid Zarr shard whose inner chunks lie in another order (as another writer may
    place them) is not mapped densely; every value still comes from where its index says."""
    st, acts = make(tmp_path / "s")
    path = tmp_path / "s" / ARRAY / "c/0/0/0/0"
    nb = 16 * 64 * 2
    raw = bytearray(path.read_bytes())
    n_index = 4 * 2 * 1 * 16
    data, index = raw[: len(raw) - n_index - 4], np.frombuffer(bytes(raw[len(raw) - n_index - 4 : -4]), "<u8").copy()
    index = index.reshape(-1, 2)
    # swap the chunks of (example 0, layer 2) and (example 0, layer 5), and their index entries
    data[0:nb], data[nb : 2 * nb] = data[nb : 2 * nb], data[0:nb]
    index[[0, 1]] = index[[1, 0]]
    index[0, 0], index[1, 0] = nb, 0
    path.write_bytes(bytes(data) + index.tobytes() + crc32c(index.tobytes()).to_bytes(4, "little"))
    st = ActStore(tmp_path / "s")
    for lp, layer in enumerate((2, 5)):
        np.testing.assert_array_equal(st[0, layer], acts[0, lp, :1].astype(np.float16))
        np.testing.assert_array_equal(st[2, layer], acts[2, lp, :3].astype(np.float16))
    assert io_of(st).read_mapped(2, 0, np.empty((16, 64), np.float16)) is False


def test_mapped_files_are_bounded_per_process_and_released_with_their_reader(tmp_path, monkeypatch):
    import gc

    from actstore.storage import mapping

    gc.collect()
    before = mapping._mapped_files
    monkeypatch.setattr(mapping, "MAX_MAPPED_FILES", before + 1)
    st, acts = make(tmp_path / "s")
    out = np.empty((16, 64), np.float16)
    assert io_of(st).read_mapped(0, 1, out) is True  # shard file 0: the one mapping allowed
    assert mapping._mapped_files == before + 1
    assert io_of(st).read_mapped(5, 1, out) is False  # shard file 1: over the bound, read instead
    np.testing.assert_array_equal(st[5, 5], acts[5, 1, :6].astype(np.float16))
    del st
    gc.collect()
    assert mapping._mapped_files == before  # the store dropped: its mapping released
    st2, _ = make(tmp_path / "s2")
    assert io_of(st2).read_mapped(5, 1, out) is True
