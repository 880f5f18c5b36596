"""Core store benchmark (issue 2): write throughput and warm random (example, layer) reads.

All figures come from one run on the same bytes:
- write: ShardWriter appends of fp16 batches (+ close, + syncfs) vs a raw sequential
  write of the same bytes to one file (+ fsync); ratio = raw time / actstore time. Also
  the layout's own limit: the same bytes written plainly as the files the layout needs
  (v2: one per (example, layer) chunk; v3-sharded: one per S examples), + syncfs.
- read: p50/mean of random warm store[ex, layer] vs np.memmap of a raw file holding the
  same bytes in (N, L, T, D) order (copied out, as the store returns an array), and vs
  zarr-python's own arr[i, l] on the same shard.

Run: .venv/bin/python benchmarks/bench_store.py [--examples N] [--tokens T] [--d-model D] [--layers L]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_store_shape_args, percentile_us, save  # noqa: E402

import actstore  # noqa: E402
from actstore.storage.files import syncfs  # noqa: E402

LAYOUTS = {
    "v2": {"zarr_format": 2},
    "v3-sharded": {"zarr_format": 3, "shard_examples": 64},
    "v3-sharded-256": {"zarr_format": 3, "shard_examples": 256},
}


def raw_write(path: Path, batches: list[np.ndarray], repeats: int) -> float:
    path.unlink(missing_ok=True)  # freeing the old file's blocks is not part of the write
    syncfs(path.parent)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(repeats):
            for b in batches:
                f.write(memoryview(b).cast("B"))
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def files_write(d: Path, batches: list[np.ndarray], repeats: int, layout: str) -> float:
    """The layout's own physical limit: the same bytes written as the files the layout
    needs (one per (example, layer) chunk, or one per S examples), plainly, + syncfs."""
    S = LAYOUTS[layout].get("shard_examples")
    shutil.rmtree(d, ignore_errors=True)
    syncfs(d.parent)
    time.sleep(1)
    d.mkdir()
    t0 = time.perf_counter()
    k = 0
    pending: list[memoryview] = []
    for _ in range(repeats):
        for b in batches:
            for ex in b:
                if S is None:
                    for lp, row in enumerate(ex):
                        with open(d / f"{k}.{lp}", "wb", buffering=0) as f:
                            f.write(memoryview(row).cast("B"))
                else:
                    pending.append(memoryview(ex).cast("B"))
                    if len(pending) == S:
                        with open(d / str(k // S), "wb", buffering=0) as f:
                            os.writev(f.fileno(), pending)
                        pending = []
                k += 1
    if pending:
        with open(d / "last", "wb", buffering=0) as f:
            os.writev(f.fileno(), pending)
    syncfs(d)
    t = time.perf_counter() - t0
    shutil.rmtree(d)
    return t


def bench_write(
    root: Path,
    batches: list[np.ndarray],
    n_layers: int,
    tokens: int,
    d_model: int,
    repeats: int,
    layout: str,
    durability: str = "writer",
    io_threads: int | None = None,
) -> dict:
    """Durable writes: actstore against a raw write (+ fsync) of the same bytes, the raw
    write timed right before and right after, the ratio taken against their mean.
    durability "writer": ShardWriter(fsync=True) (each file synced on its I/O thread, the
    storage before each commit); "syncfs": a plain writer, then one syncfs at the end."""
    nbytes = sum(b.nbytes for b in batches) * repeats
    raw = root / "raw.bin"
    t_raw_before = raw_write(raw, batches, repeats)
    store = root / f"store-{layout}"
    syncfs(root)
    t0 = time.perf_counter()
    with actstore.ShardWriter(
        store,
        shard=0,
        layers=list(range(n_layers)),
        d_model=d_model,
        tokens=tokens,
        fsync=durability == "writer",
        io_threads=io_threads,
        **LAYOUTS[layout],
    ) as w:
        for _ in range(repeats):
            for b in batches:
                w.append(b)
    if durability == "syncfs":
        syncfs(store)
    t_store = time.perf_counter() - t0
    actstore.finalize(store)
    t_raw = (t_raw_before + raw_write(raw, batches, repeats)) / 2
    t_files = files_write(root / "files", batches, repeats, layout)
    return {
        "layout": layout,
        "bytes": nbytes,
        "raw_seconds": t_raw,
        "actstore_seconds": t_store,
        "raw_MBps": nbytes / t_raw / 1e6,
        "actstore_MBps": nbytes / t_store / 1e6,
        "ratio_vs_raw": t_raw / t_store,
        "layout_files_seconds": t_files,
        "layout_files_vs_raw": t_raw / t_files,
        "ratio_vs_layout_files": t_files / t_store,
    }


def bench_read(root: Path, n: int, n_layers: int, queries: int, seed: int, layout: str) -> dict:
    store = actstore.ActStore(root / f"store-{layout}")
    checked = actstore.ActStore(root / f"store-{layout}", verify="reads")  # every read checked against its crc32c
    raw = np.memmap(
        root / "raw.bin", dtype=np.float16, mode="r", shape=(n, n_layers, store.config.segments[0].t_max, store.d_model)
    )
    z = zarr.open_array(str(root / f"store-{layout}/shards/shard-00000.zarr/arrays/tokens_activations"), mode="r")
    rng = np.random.default_rng(seed)
    pairs = list(zip(rng.integers(0, n, queries).tolist(), rng.integers(0, n_layers, queries).tolist()))
    # Equal bytes: the raw file was written from the same batches in the same order.
    ex, l = pairs[0]
    assert np.array_equal(store[ex, l], raw[ex, l]) and np.array_equal(z[ex, l], raw[ex, l])
    for ex, l in pairs:  # warm every page the timed loops touch
        store[ex, l]
        checked[ex, l]
        np.array(raw[ex, l])

    def timed(fn, qs):
        out = []
        for ex, l in qs:
            t0 = time.perf_counter()
            fn(ex, l)
            out.append(time.perf_counter() - t0)
        return out

    res = {}
    for name, fn, qs in (
        ("memmap", lambda e, l: np.array(raw[e, l]), pairs),
        ("actstore", lambda e, l: store[e, l], pairs),
        ("actstore_verify_reads", lambda e, l: checked[e, l], pairs),
        ("zarr", lambda e, l: z[e, l], pairs[: max(200, queries // 10)]),
    ):
        ts = timed(fn, qs)
        res[name] = {
            "p50_us": percentile_us(ts, 50),
            "p95_us": percentile_us(ts, 95),
            "mean_us": 1e6 * sum(ts) / len(ts),
            "queries": len(qs),
        }
    res["actstore_p50_vs_memmap"] = res["actstore"]["p50_us"] / res["memmap"]["p50_us"]
    res["zarr_p50_vs_actstore"] = res["zarr"]["p50_us"] / res["actstore"]["p50_us"]
    res["verify_reads_p50_vs_memmap"] = res["actstore_verify_reads"]["p50_us"] / res["memmap"]["p50_us"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_store_shape_args(ap)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--dir", default=None, help="where to put the temporary store (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-repeats", type=int, default=5, help="write runs per layout (median ratio reported)")
    ap.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=["v2", "v3-sharded"])
    ap.add_argument(
        "--durability",
        choices=["writer", "syncfs"],
        default="writer",
        help="writer: ShardWriter(fsync=True); syncfs: a plain writer, then syncfs (sessions 2-5)",
    )
    ap.add_argument("--io-threads", type=int, default=None, help="the writer's I/O threads (default: its own)")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    pool = 8  # distinct batches, cycled: generating random numbers is not what we measure
    batches = [
        rng.standard_normal((a.batch, a.layers, a.tokens, a.d_model), dtype=np.float32).astype(np.float16)
        for _ in range(pool)
    ]
    repeats = max(1, a.examples // (a.batch * pool))
    n = repeats * pool * a.batch
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="actstore-bench-"))
    result = {
        "shape": [n, a.layers, a.tokens, a.d_model],
        "dtype": "float16",
        "durability": a.durability,
        "layouts": {},
        "load_average": os.getloadavg(),
    }
    print(
        f"store of {n} examples x {a.layers} layers x {a.tokens} tokens x {a.d_model} "
        f"(fp16, {n * a.layers * a.tokens * a.d_model * 2 / 1e9:.2f} GB)"
    )
    try:
        for layout in a.layout:
            runs = []
            for i in range(a.write_repeats):
                if i:
                    # Deleting the last run's thousands of files is filesystem work of its
                    # own: let it finish (syncfs, pause) so it is not timed in this run.
                    shutil.rmtree(root / f"store-{layout}")
                    syncfs(root)
                    time.sleep(2)
                runs.append(
                    bench_write(
                        root, batches, a.layers, a.tokens, a.d_model, repeats, layout, a.durability, a.io_threads
                    )
                )
            # The disk's speed drifts between runs: the ratio of each adjacent (raw, actstore)
            # pair shares the drift; the headline is the median pair.
            w = sorted(runs, key=lambda x: x["ratio_vs_raw"])[len(runs) // 2]
            w["ratios_all_runs"] = [round(x["ratio_vs_raw"], 3) for x in runs]
            w["layout_files_vs_raw_all_runs"] = [round(x["layout_files_vs_raw"], 3) for x in runs]
            w["ratio_vs_layout_files_all_runs"] = [round(x["ratio_vs_layout_files"], 3) for x in runs]
            w["ratio_vs_layout_files_median"] = float(np.median(w["ratio_vs_layout_files_all_runs"]))
            r = bench_read(root, n, a.layers, a.queries, a.seed, layout)
            shutil.rmtree(root / f"store-{layout}")
            result["layouts"][layout] = {"write": w, "read": r}
            print(
                f"[{layout}] durable write (median of {len(runs)} runs {w['ratios_all_runs']}): raw {w['raw_MBps']:.0f} MB/s, "
                f"actstore {w['actstore_MBps']:.0f} MB/s -> {w['ratio_vs_raw']:.2f}x of raw"
            )
            print(
                f"[{layout}] the layout's own files written plainly: {w['layout_files_vs_raw_all_runs']} of raw; "
                f"actstore / those files: {w['ratio_vs_layout_files_all_runs']} (median {w['ratio_vs_layout_files_median']:.2f})"
            )
            print(
                f"[{layout}] warm random store[ex, layer] p50: memmap {r['memmap']['p50_us']:.0f} us, actstore {r['actstore']['p50_us']:.0f} us "
                f"({r['actstore_p50_vs_memmap']:.2f}x memmap), zarr-python {r['zarr']['p50_us']:.0f} us "
                f"({r['zarr_p50_vs_actstore']:.1f}x slower than actstore); verify='reads' "
                f"{r['actstore_verify_reads']['p50_us']:.0f} us ({r['verify_reads_p50_vs_memmap']:.2f}x memmap)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"results: {save('store', result)}")


if __name__ == "__main__":
    main()
