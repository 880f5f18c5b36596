"""A writer process for multi-process tests: deterministic data per global example id.

python tests/writer_proc.py STORE SHARD FIRST COUNT [--resume] [--batch B] [--commit-bytes N] [--sleep S] [--world-size W] [--fsync] [--spool BUDGET]
writes examples FIRST..FIRST+COUNT-1 as shard SHARD; example id k holds example_data(k).
With --resume it continues after the shard's last committed example.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from actstore import ShardWriter
from actstore.errors import ShardCompleteError

LAYERS = [1, 4]
D = 16
T = 9


def spawn(*args: str) -> subprocess.Popen:
    """This script in a new process (text pipes for its lines), for the multi-process tests."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen(
        [sys.executable, str(root / "tests" / "writer_proc.py"), *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def example_data(k: int) -> np.ndarray:
    return np.random.default_rng(k).standard_normal((len(LAYERS), T, D)).astype(np.float16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("shard", type=int)
    ap.add_argument("first", type=int)
    ap.add_argument("count", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--commit-bytes", type=int, default=4000)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--fsync", action="store_true", help="durable commits (each file synced, then the commit)")
    ap.add_argument("--spool", default=None, help="write into a spool of this budget (issue 41)")
    ap.add_argument("--start-after", default=None, help="wait until this file exists (a start line for racers)")
    a = ap.parse_args()
    if a.start_after:
        Path(f"{a.start_after}.ready.{os.getpid()}").touch()  # imported: at the start line
        while not os.path.exists(a.start_after):
            time.sleep(0.002)
    try:
        _write(a)
    except ShardCompleteError:
        if not a.resume:
            raise
        print("complete already", flush=True)  # a kill that landed after the close: nothing left to do
    print("closed", flush=True)


def _write(a: argparse.Namespace) -> None:
    with ShardWriter(
        a.store,
        shard=a.shard,
        layers=LAYERS,
        d_model=D,
        tokens=T,
        resume=a.resume,
        commit_bytes=a.commit_bytes,
        texts=["id"],
        world_size=a.world_size,
        fsync=a.fsync or None,
        spool=a.spool,
    ) as w:
        done = w.n_committed
        print(f"start {done}", flush=True)
        k = done
        while k < a.count:
            ids = list(range(a.first + k, a.first + min(k + a.batch, a.count)))
            w.append(np.stack([example_data(i) for i in ids]), sample_keys=[f"ex{i}" for i in ids], texts={"id": ids})
            k += len(ids)
            print(f"appended {k} committed {w.n_committed}", flush=True)
            if a.sleep:
                time.sleep(a.sleep)


if __name__ == "__main__":
    sys.exit(main())
