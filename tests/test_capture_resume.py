"""A `write` killed with SIGKILL halfway and rerun with --resume gives the same store as an
uninterrupted run (activations, keys, texts, lengths, labels and statistics)."""

from __future__ import annotations

import os
import signal
import time

import forked
import numpy as np
import pytest
from capture_support import SENTENCES, save_llama, write_jsonl
from click.testing import CliRunner

import actstore
from actstore.capture import committed
from actstore.capture.target import CaptureTarget
from actstore.cli import main

pytestmark = pytest.mark.slow  # a capture killed in a process of its own and resumed


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def test_sigkill_halfway_then_resume_equals_uninterrupted(tmp_path):
    model = save_llama(tmp_path / "llama", layers=3)
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES * 2])  # 18 examples
    n = 18
    common = [
        "--model",
        model,
        "--data",
        data,
        "--layers",
        "0,2",
        "--batch-size",
        "1",
        "--commit-mb",
        "0.000001",
        "--quiet",
    ]
    killed = tmp_path / "killed"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    code = "import sys; from actstore.cli import main; sys.argv[0] = 'actstore'; main()"
    proc = forked.start("-c", "write", str(killed), *map(str, common), code=code, env=env)  # a process of its own
    deadline = time.monotonic() + 120
    target = CaptureTarget(killed)
    while target.committed(0)[0] < 6:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the writer never committed 6 examples"
        time.sleep(0.005)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    n_done, complete = committed(killed, 0)
    assert 6 <= n_done < n and not complete and not (killed / "manifest.json").exists()
    out = _cli("write", killed, *common, "--resume")
    assert f"wrote {n - n_done} examples" in out and f"{n} examples in shard(s) [0]" in out
    _cli("write", tmp_path / "whole", *common)
    a, b = actstore.ActStore(killed), actstore.ActStore(tmp_path / "whole")
    assert len(a) == len(b) == n
    assert list(a.field("sample_key")) == list(b.field("sample_key"))
    assert list(a.texts("text")) == list(b.texts("text"))
    np.testing.assert_array_equal(a.field("tokens_len"), b.field("tokens_len"))
    np.testing.assert_array_equal(a.field("tokens_token_labels"), b.field("tokens_token_labels"))
    for i in range(n):
        for layer in (0, 2):
            np.testing.assert_array_equal(a[i, layer], b[i, layer])
    sa, sb = a.stats(), b.stats()
    np.testing.assert_array_equal(sa.count, sb.count)
    np.testing.assert_allclose(sa.mean, sb.mean, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(sa.m2, sb.m2, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(sa.min, sb.min)
    np.testing.assert_array_equal(sa.max, sb.max)
    # resuming a finished store does nothing and keeps it whole
    out = _cli("write", killed, *common, "--resume")
    assert "wrote 0 examples" in out and len(actstore.ActStore(killed)) == n
