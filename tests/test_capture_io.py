"""Capture through the write pipeline: progress shows what is written (or uploaded) and
queued, to a local folder and to S3 (moto), and the stores equal each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from capture_support import tiny_dinov2

import actstore
from actstore.capture.capture_bar import CaptureBar, io_note


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_io_progress_follows_the_pipeline_and_the_store_equals_a_local_one(tmp_path, request, where):
    model = tiny_dinov2(layers=3)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 3, 28, 28, generator=g) for _ in range(5)]
    url = str(tmp_path / "s") if where == "local" else request.getfixturevalue("s3_url")
    seen = []
    res = actstore.record(model, batches, url, layers=[0, 2], zarr_format=3, shard_examples=8, io_progress=seen.append)
    assert res.n_written == 20 and len(seen) == 5
    assert all(s.remote == (where == "s3") for s in seen)
    written = [s.written_bytes for s in seen]
    assert written == sorted(written) and all(s.pending_bytes <= s.max_bytes for s in seen)
    assert max(s.peak_pending_bytes for s in seen) > 0
    actstore.finalize(url)
    ref = tmp_path / "ref"
    actstore.record(model, batches, ref, layers=[0, 2])
    actstore.finalize(ref)
    a, b = actstore.ActStore(url), actstore.ActStore(ref)
    assert np.array_equal(a[0:20, :], b[0:20, :])


def test_the_bar_shows_every_writers_io():
    from actstore.storage import retry
    from actstore.write.pipeline import IOStats

    retry.reset_counts()  # the process's network retries (an earlier test's) join every bar's note
    p = CaptureBar(total=10, disable=True)
    p.io(IOStats(2**20, 2**20, 2**29, 10**9, 3, 0.0, True), who=0)
    p.io(IOStats(3 * 2**20, 3 * 2**20, 2**29, 2 * 10**9, 5, 0.0, True), who=1)
    p.io(IOStats(0, 0, 2**29, 3 * 10**9, 7, 0.0, True), who=1)  # writer 1's latest replaces its last
    p.update(2, 100, 1000)
    assert p.bar.postfix.endswith("upload 4,000 MB done, 1/1,024 MiB queued")
    assert io_note([IOStats(0, 0, 2**20, 5 * 10**6, 1, 0.0, False)]) == "write 5 MB done, 0/1 MiB queued"
    p.close()
