"""An export killed with SIGKILL leaves no <HASH> directory, and a rerun completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from factory import vit_store
from saev_checks import dir_files

from actstore.saev import export_saev, verify_saev

pytestmark = pytest.mark.slow  # exports killed in a subprocess

CHILD = r"""
import os, sys, time
from actstore.saev import pipeline as ex, export_saev

marker, store, dump = sys.argv[1:4]
real = ex.write_all
writes = []

def slow_write(fd, arr):
    real(fd, arr)
    writes.append(1)
    if len(writes) == 3:  # mid-export: two shards done, more to come
        open(marker, "w").close()
        time.sleep(120)

ex.write_all = slow_write
export_saev(store, dump, patches_per_shard=30, batch_bytes=1, progress=False)
"""


def test_sigkill_leaves_no_hash_directory_and_rerun_completes(tmp_path):
    store = vit_store(tmp_path / "s", n=13)
    dump, marker = tmp_path / "dump", tmp_path / "marker"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.join(os.getcwd(), "src"), os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), str(store.path), str(dump)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, f"the export child exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "the export child never reached the middle of the export"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    left = os.listdir(dump)
    assert len(left) == 1 and left[0].startswith(".") and ".staging-" in left[0]  # only the hidden stage
    assert (dump / left[0] / "acts000000.bin").exists()  # it really was killed mid-way

    res = export_saev(store, dump, patches_per_shard=30, progress=False)
    assert not res.reused
    assert os.listdir(dump) == [res.hash]  # the dead build's directory was removed
    assert left[0].startswith(f".{res.hash}.staging-")
    assert verify_saev(res.path, values=True).problems == []
    fresh = export_saev(store, tmp_path / "fresh", patches_per_shard=30, progress=False)
    assert dir_files(fresh.path) == dir_files(res.path)
