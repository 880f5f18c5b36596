"""TokenStream.follow(path): the committed blocks of a store still being written,
every kept token vector exactly once, ending when the store is finalized; both layouts,
the default mask, a store that does not exist yet, and what it refuses."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import actstore
from actstore.errors import NotFinalizedError
from actstore.torch import TokenStream

D = 8
SEGS = {"prompt": 6, "response": 4}


def write(path, shard, n_blocks, zarr_format, sleep=0.0, per_block=5, world_size=2):
    rng = np.random.default_rng(shard)
    with actstore.ShardWriter(
        path,
        shard=shard,
        world_size=world_size,
        layers=[1, 3],
        d_model=D,
        segments=SEGS,
        token_labels=True,
        zarr_format=zarr_format,
        t_chunk={"prompt": 3, "response": 4},
        **({"shard_examples": 4} if zarr_format == 3 else {}),
    ) as w:
        for _ in range(n_blocks):
            w.append(
                prompt=rng.standard_normal((per_block, 2, 6, D)).astype(np.float16),
                response=rng.standard_normal((per_block, 2, 4, D)).astype(np.float16),
                lengths={"prompt": rng.integers(1, 7, per_block), "response": rng.integers(0, 5, per_block)},
                token_labels={
                    "prompt": (rng.random((per_block, 6)) < 0.3).astype(np.uint8),
                    "response": np.zeros((per_block, 4), np.uint8),
                },
            )
            w.commit()
            time.sleep(sleep)


def sorted_rows(x: torch.Tensor) -> np.ndarray:
    a = np.ascontiguousarray(x.numpy())
    v = a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).ravel()
    return np.sort(v)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_follow_streams_every_committed_token_once_and_ends_at_finalize(tmp_path, zarr_format):
    path = tmp_path / "s"

    def capture():
        threads = [threading.Thread(target=write, args=(path, s, 6, zarr_format, 0.05)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        actstore.finalize(path)

    writer = threading.Thread(target=capture)
    writer.start()  # the store does not exist yet: the stream waits for it
    fs = TokenStream.follow(path, batch_size=16, buffer_bytes=40 * D * 2, poll_s=0.02, idle_timeout_s=60)
    got = [b.clone() for b in fs]
    writer.join()
    assert all(b.dtype == torch.float16 and b.shape[1] == D for b in got)
    assert all(len(b) == 16 for b in got[:-1]) and 0 < len(got[-1]) <= 16
    want = torch.cat(
        list(TokenStream(actstore.open(path), batch_size=64, shuffle=False))
    )  # the finalized store, content tokens
    np.testing.assert_array_equal(sorted_rows(torch.cat(got)), sorted_rows(want))
    assert len(want) > 200 and {b[0] for b in fs.blocks_read} == {0, 1}
    assert sum(b[2] - b[1] for b in fs.blocks_read) == 60  # each of the 2 x 30 examples read once


def test_follow_of_a_finalized_store_is_one_epoch_in_pool_order(tmp_path):
    path = tmp_path / "s"
    write(path, 0, 2, 3, world_size=1)
    actstore.finalize(path)
    a = torch.cat(list(TokenStream.follow(path, batch_size=8, layers=[3], token_mask="all", dtype=torch.float32)))
    want = torch.cat(list(TokenStream(actstore.open(path), batch_size=8, layers=[3], token_mask="all", shuffle=False)))
    assert a.dtype == torch.float32 and len(a) == len(want)
    np.testing.assert_array_equal(sorted_rows(a.half()), sorted_rows(want))


def test_a_store_never_finalized_ends_with_an_error_after_the_idle_timeout(tmp_path):
    path = tmp_path / "s"
    write(path, 0, 1, 2)  # shard 1 of 2 never comes
    fs = TokenStream.follow(path, batch_size=4, buffer_bytes=10**6, poll_s=0.01, idle_timeout_s=0.3)
    with pytest.raises(NotFinalizedError, match=r"no block was committed to .* for 0.3 s and it is not finalized"):
        list(fs)
    with pytest.raises(NotFinalizedError, match="holds no store after 0.2 s: start its writers"):
        list(TokenStream.follow(tmp_path / "none", poll_s=0.01, idle_timeout_s=0.2))


def test_what_a_follow_stream_refuses(tmp_path):
    path = tmp_path / "s"
    with pytest.raises(ValueError, match="cannot take normalize='standardize': the store's statistics exist once"):
        TokenStream.follow(path, normalize="standardize")
    with pytest.raises(ValueError, match="cannot take world_size=2: one process reads the growing store"):
        TokenStream.follow(path, rank=0, world_size=2)
    with pytest.raises(TypeError, match=r"TokenStream.follow\(\) got unexpected options \['colour'\]"):
        TokenStream.follow(path, colour=1)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int\. Got 0\."):  # StreamSpec's checks
        TokenStream.follow(path, batch_size=0)
    fs = TokenStream.follow(path, threads=3, rank=0, world_size=1, shuffle=True)  # ignored, or at their defaults
    assert fs.spec.threads == 3 and fs.batch_size == 4096
    with pytest.raises(ValueError, match="num_workers must be 0"):
        fs.loader(num_workers=2)
    assert fs.loader() is fs
    with pytest.raises(ValueError, match="cannot be resumed: its order depends on when each block was committed"):
        fs.state_dict()
