"""`actstore finalize` and `actstore info`: in this process through click's runner (the exit
code, stdout and stderr apart), and `python -m actstore.cli` once as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from actstore import ShardWriter

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str):
    """`actstore ARGS` in this process: .returncode, .stdout and .stderr as a process's."""
    from types import SimpleNamespace

    from factory import cli

    res = cli(*args, ok=False)
    return SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr)


def test_finalize_then_info_json_and_text(store_path, rng):
    for shard, n in ((0, 3), (1, 2)):
        with ShardWriter(
            store_path, shard=shard, layers=[4, 9], d_model=8, segments={"prompt": 5, "response": 2}, stats=True
        ) as w:
            w.append(
                prompt=rng.standard_normal((n, 2, 5, 8)).astype(np.float16),
                response=rng.standard_normal((n, 2, 2, 8)).astype(np.float16),
                lengths={"prompt": [5] * n, "response": [1] * n},
                source_lengths={"prompt": [9] + [5] * (n - 1)},
            )
    r = _cli("info", str(store_path))
    assert r.returncode == 1 and r.stderr.startswith("actstore: error: ") and "never finalized" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("finalize", str(store_path))
    assert r.returncode == 0 and "5 examples in 2 shards" in r.stdout
    r = _cli("info", "--json", str(store_path))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["n_examples"] == 5 and info["layers"] == [4, 9] and info["dtype"] == "float16"
    assert info["segments"]["prompt"]["shape"] == [5, 2, 5, 8]
    assert info["segments"]["prompt"]["truncated"] == {"count": 2, "fraction": 0.4}
    assert info["segments"]["response"]["tokens"] == 5
    assert [s["n_examples"] for s in info["shards"]] == [3, 2]
    assert info["statistics"]["layer9/response"]["count"] == 5
    assert info["bytes_on_disk"] > 5 * 2 * 7 * 8 * 2
    r = _cli("info", str(store_path))
    assert r.returncode == 0
    assert "examples     5" in r.stdout and "truncated 2 (40.00%)" in r.stdout and "layer4/prompt" in r.stdout


def test_help_lists_core_commands():
    """The module's entry point in a process of its own (the one process this file starts)."""
    r = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0 and "finalize" in r.stdout and "info" in r.stdout


def test_info_prints_a_packed_corpus_packing(tmp_path):
    """`info` shows in text what --json shows: how a --pack / --chunk corpus was cut."""
    from factory import vit_store

    packing = {"mode": "pack", "context": 5, "documents": 1234, "tokens": 56789, "windows": 13, "window_bos": 1}
    path = vit_store(tmp_path / "s", cls=None, attrs={"packing": packing}).path
    r = _cli("info", str(path))
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("packing")]
    assert line == [
        "packing      --pack --context 5: 1,234 documents, 56,789 tokens in 13 windows; "
        "each window starts with token 1 (labelled special)"
    ]
    assert json.loads(_cli("info", "--json", str(path)).stdout)["attrs"]["packing"] == packing
