"""What a read checks (docs/format.md, section 3.4): a flipped byte inside a chunk of the
right size reads back as it is by default (said, not hidden: `actstore verify --deep`
finds it), and is refused by every read path of a store opened with verify="reads"
(the writer's crc32c of each (example, segment, layer)), in both layouts."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from factory import plain_vit_store, text_store

import actstore
from actstore.errors import CorruptChunkError
from actstore.torch import TokenStream

LAYOUTS = {
    "chunk files (format 2)": {"zarr_format": 2},
    "shard files (format 3)": {"zarr_format": 3, "shard_examples": 4},
}


def flip_a_byte(store, ex: int) -> None:
    """Flip one byte of the activations of example `ex`, layer position 0, in place."""
    io = store._shard(0).io["tokens"]
    g = io.geo
    if g.shard_examples is None:
        path, offset = io.chunk_path(ex, 0, 0), 7
    else:
        path = io.where(g.shard_key(ex))
        offset = (ex % g.shard_examples) * g.n_layers * g.n_tchunks * g.chunk_nbytes + 7
    path = Path(path)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_flipped_byte_is_refused_by_every_read_path_with_verify_reads(tmp_path, layout):
    store = plain_vit_store(tmp_path / "s", **LAYOUTS[layout])
    good = store[3, 0].copy()
    flip_a_byte(store, 3)
    plain = actstore.ActStore(store.path)
    assert (plain[3, 0] != good).sum() == 1  # read back as it is: reads do not check chunk bytes by default
    checked = actstore.open(store.path, verify="reads")
    np.testing.assert_array_equal(checked[2, 0], store[2, 0])  # an undamaged example reads as before
    message = r"the chunk bytes of \(example 3 of shard .*, layer 0, segment 'tokens'\) read back differ from what its writer wrote"
    with pytest.raises(CorruptChunkError, match=message):
        checked[3, 0]
    out = np.empty((5, 6), np.float16)
    with pytest.raises(CorruptChunkError, match=message):
        checked.read_into(3, 0, "tokens", out)
    with pytest.raises(CorruptChunkError, match=message):
        checked.read_many_into([(2, 0, "tokens", out), (3, 0, "tokens", np.empty_like(out))])
    assert checked.read_cached(3, 0, "tokens", out) is False  # the page-cache fast path declines: reads check
    with pytest.raises(CorruptChunkError, match=message):
        list(TokenStream(checked, batch_size=8, token_mask="all"))
    with pytest.raises(CorruptChunkError, match=message):
        pickle.loads(pickle.dumps(checked))[3, 0]  # a worker's copy checks its reads too
    assert checked[3, 1].shape == (5, 6)  # the other layer of the example is intact


def test_a_read_of_fewer_rows_than_the_padded_segment_is_checked_whole(tmp_path):
    """A text segment read to its length only: the rest of its chunks is read to check it."""
    store = text_store(tmp_path / "t", t_chunk={"prompt": 2, "response": 2}, zarr_format=2)
    checked = actstore.open(store.path, verify="reads")
    assert store.config.segment("prompt").n_chunks == 3
    for ex in range(len(store)):
        np.testing.assert_array_equal(checked[ex, store.layers[0]], store[ex, store.layers[0]])


def test_verify_reads_is_refused_for_a_saev_directory_and_unknown_modes(tmp_path):
    with pytest.raises(ValueError, match=r"verify must be one of \[None, 'fast', 'deep', 'reads'\]. Got 'all'."):
        actstore.open(tmp_path, verify="all")
