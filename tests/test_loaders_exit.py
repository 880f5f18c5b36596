"""A script that ends right after an epoch: the stream's reader may still be reading the
next epoch's first window. At interpreter exit every pipeline's threads are stopped and
joined (actstore.loaders.pipeline._stop_all), so no thread is frozen inside native code
during finalization (seen: 'terminate called without an active exception', exit code
134, in about one run of three of a benchmark script before the fix)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import actstore
from actstore import ShardWriter

pytestmark = pytest.mark.torch  # its script streams batches with torch

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time

    def check():  # registered first, so it runs after actstore's exit handler
        alive = [t.name for t in threading.enumerate() if t.name.startswith("actstore-")]
        print("ALIVE", alive, flush=True)

    atexit.register(check)

    import actstore
    from actstore.loaders import pipeline
    from actstore.torch import TokenStream

    fill = pipeline.TokenPipeline._fill
    def slow_fill(self, w, slot):  # the next epoch's first window takes long to read
        if self.epoch_read:
            time.sleep(1.5)
        fill(self, w, slot)
    pipeline.TokenPipeline._fill = slow_fill

    ts = TokenStream(actstore.ActStore(sys.argv[1]), batch_size=16, seed=0, buffer_bytes=4096)
    n = sum(len(b) for b in ts)
    print("TOKENS", n, flush=True)
    """
)


def test_threads_stopped_at_exit(tmp_path):
    path = tmp_path / "s.store"
    rng = np.random.default_rng(0)
    with ShardWriter(path, layers=[0], d_model=8, tokens=5) as w:
        w.append(rng.standard_normal((40, 1, 5, 8)).astype(np.float16))
    actstore.finalize(path)
    script = tmp_path / "stream_and_exit.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TOKENS 200" in r.stdout
    assert "ALIVE []" in r.stdout, r.stdout  # the reader was joined before finalization
    assert "terminate called" not in r.stderr
