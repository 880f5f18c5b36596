"""Write-path breakdown (issue 17): CPU nanoseconds per stored byte of each stage of a
ShardWriter append and commit, and the disk's own time, measured on the same block.

The stages are the functions the writer runs (actstore.dtypes.convert: cast and the
non-finite screen; actstore.layout.checksum.crc32c: per-row and block checksums; the copy
into a contiguous staging array; the file writes through LocalStorage.put; the writeback
wait, fdatasync), each timed alone over --block-mb of activations, --repeats times (the
median is reported). The disk's limit is a raw sequential write of the same bytes plus
fsync in the same run. From these the table derives each layout's ceiling on this
machine: with every stage on one thread (today's writer thread) the costs add up; with
the CPU stages on other threads than the disk writes they overlap, and the slowest stage
bounds the rate.

Run: .venv/bin/python benchmarks/bench_breakdown.py [--block-mb 64] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from actstore.dtypes import convert, count_nonfinite_16  # noqa: E402
from actstore.layout.checksum import combine_all, crc32c  # noqa: E402
from actstore.storage import LocalStorage  # noqa: E402

T, D, L = 257, 768, 2  # a ViT-B example: CLS + 16x16 patches, 2 layers


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs (after one warm-up)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-mb", type=float, default=64, help="stored (float16) bytes per measured block")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    args = ap.parse_args()
    row = T * D * 2  # stored bytes of one (example, layer) in float16
    n = max(1, int(args.block_mb * 2**20) // (row * L))
    x = np.random.default_rng(0).standard_normal((n, L, T, D)).astype(np.float32)
    stored, _, _ = convert(x, "float32", "float16")
    nbytes = stored.nbytes
    root = Path(tempfile.mkdtemp(prefix="bench-breakdown-", dir=args.dir))
    storage = LocalStorage(root)
    staging = np.empty_like(stored)
    rows = [stored[i, lp] for i in range(n) for lp in range(L)]
    row_crcs = [crc32c(r) for r in rows]
    try:

        def write_files() -> None:
            for i in range(n):
                storage.put(f"c/{i}", memoryview(stored[i].reshape(-1).view(np.uint8)), atomic=False)

        def write_and_sync() -> None:
            write_files()
            storage.sync()

        def raw() -> None:
            with open(root / "raw.bin", "wb", buffering=0) as f:
                f.write(memoryview(stored.reshape(-1).view(np.uint8)))
                os.fsync(f.fileno())

        stages = {
            "cast float32 -> float16 (with overflow count)": timed(
                lambda: convert(x, "float32", "float16"), args.repeats
            ),
            "non-finite screen of float16 input (count_nonfinite_16)": timed(
                lambda: count_nonfinite_16(stored), args.repeats
            ),
            "per-row crc32c (one per example and layer)": timed(lambda: [crc32c(r) for r in rows], args.repeats),
            "block crc32c as a second pass (before session 5)": timed(
                lambda: crc32c(memoryview(stored.reshape(-1).view(np.uint8))), args.repeats
            ),
            "block crc32c derived from the rows' (combine)": timed(
                lambda: combine_all(0, row_crcs, rows[0].nbytes), args.repeats
            ),
            "copy into a contiguous staging array": timed(lambda: np.copyto(staging, stored), args.repeats),
            "file writes (page cache, one file per example)": timed(write_files, args.repeats),
        }
        wb = timed(write_and_sync, args.repeats) - stages["file writes (page cache, one file per example)"]
        stages["writeback wait (syncfs after the writes)"] = max(wb, 0.0)
        disk = timed(raw, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ns = {k: v / nbytes * 1e9 for k, v in stages.items()}
    ns_all = dict(ns)
    del ns["block crc32c as a second pass (before session 5)"]  # not a stage of today's writer
    cpu_stages = [k for k in ns if not k.startswith(("file writes", "writeback"))]
    serial = sum(ns.values())
    io = ns["file writes (page cache, one file per example)"] + ns["writeback wait (syncfs after the writes)"]
    pipelined = max(max(ns[k] for k in cpu_stages), io)
    disk_ns = disk / nbytes * 1e9
    print(
        f"write-path breakdown: {nbytes / 2**20:.0f} MiB stored (float16), {n} examples x {L} layers x {T} x {D}, "
        f"{os.cpu_count()} CPUs, median of {args.repeats}"
    )
    print(f"{'stage':<52}{'ns/B':>8}{'MB/s alone':>12}")
    for k, v in ns_all.items():
        print(f"{k:<52}{v:>8.3f}{1e3 / v if v else float('inf'):>12.0f}")
    print(f"{'raw sequential write + fsync (the disk)':<52}{disk_ns:>8.3f}{1e3 / disk_ns:>12.0f}")
    print(f"ceiling, every stage on one thread:   {1e3 / serial:6.0f} MB/s = {disk_ns / serial:.2f}x the disk")
    print(
        f"ceiling, CPU stages beside the I/O:   {1e3 / pipelined:6.0f} MB/s = {min(1.0, disk_ns / pipelined):.2f}x the disk "
        f"(bound: {'the I/O' if pipelined == io else max(cpu_stages, key=ns.get)})"
    )
    print(
        f"results: {save('breakdown', {'bytes': nbytes, 'ns_per_byte': ns_all, 'disk_ns_per_byte': disk_ns, 'serial_ratio': disk_ns / serial, 'pipelined_ratio': min(1.0, disk_ns / pipelined)})}"
    )


if __name__ == "__main__":
    main()
