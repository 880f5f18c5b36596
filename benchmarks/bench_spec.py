"""The Zarr activation logger spec's own validation matrix (issue 27).

For every H in --d-model, every layout in --layouts and every cell of the matrix
R_max (--r-max) x T_chunk_prompt (--t-chunk), a prompt/response store of --examples
examples x --layers layers (prompt P_max = --p-max, response R_max, chunks
(1, 1, T_chunk_prompt, H) and (1, 1, R_max, H)) is written, and measured against the
physical limit in the same run on the same bytes:

- write: W = 1, 2, 4 (--writers) ShardWriter processes, each writing its share of the
  examples into its own shard (fsync=True), against W processes writing the same arrays
  plainly to raw files (+ fsync); MB/s of the arrays handed to the writers
  (`--durability none`: both sides left in the page cache).
- read: --queries random (i, random layer) reads of the prompt slice
  (`store.segment("prompt")[i, l]`, prompt[:p_i]) and of the response slice, each
  against np.memmap of the raw files (the same bytes, copied out), warm; mean, p50, p95.
  zarr-python's own `arr[i, l, :p_i]` on a tenth of the queries for reference.
- batch: PairDataset batches of --batch examples x 2 random layers (both segments)
  through a DataLoader with 0, 4, 8 workers (--workers), warm: time between batches,
  against memmap fancy indexing of the raw files for the same batch in one process.

Token lengths are drawn from a real data set (--lengths bench-results/spec-data.json,
written by benchmarks/spec_data.py) or uniformly. Results: bench-results/spec.json (one
row per measurement with its parameters) and bench-results/spec.png (latency heatmaps
and the write scaling curve).

Run: .venv/bin/python benchmarks/bench_spec.py [--quick] [--d-model 1024,2048] [--layers 4]
     [--examples 256] [--r-max 32,64,128] [--t-chunk 64,128,256] [--p-max 256]
     [--layouts v2,v3-sharded] [--queries 10000] [--lengths FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import percentile_us, save  # noqa: E402

import actstore  # noqa: E402
from actstore.layout import keys  # noqa: E402

warnings.filterwarnings("ignore", message="This DataLoader will create")  # 8 workers on a small machine, on purpose
LAYOUTS = ("v2", "v3-sharded")
QUICK = {
    "d_model": "32",
    "layers": 2,
    "examples": 16,
    "r_max": "8,16",
    "t_chunk": "8,16",
    "p_max": 32,
    "queries": 200,
    "workers": "0,2",
    "writers": "1,2",
    "batch": 4,
    "shard_examples": 4,
}
FULL = {
    "d_model": "2048",
    "layers": 4,
    "examples": 256,
    "r_max": "32,64,128",
    "t_chunk": "64,128,256",
    "p_max": 256,
    "queries": 10000,
    "workers": "0,4,8",
    "writers": "1,2,4",
    "batch": 16,
    "shard_examples": 64,
}


def ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x]


def stats_us(ts: list[float]) -> dict:
    return {
        "mean_us": 1e6 * sum(ts) / len(ts),
        "p50_us": percentile_us(ts, 50),
        "p95_us": percentile_us(ts, 95),
        "n": len(ts),
    }


# ---- data -----------------------------------------------------------------------------
def draw_lengths(a, n: int, r_max: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, response) lengths: resampled from a real data set, or uniform; capped to the budgets."""
    if a.lengths:
        d = json.loads(Path(a.lengths).read_text())["lengths"]
        p, r = np.asarray(d["prompt"]), np.asarray(d["response"])
        j = rng.integers(0, len(p), n)
        p, r = p[j], r[j]
    else:
        p, r = rng.integers(1, a.p_max + 1, n), rng.integers(1, r_max + 1, n)
    return np.clip(p, 1, a.p_max).astype(np.int64), np.clip(r, 1, r_max).astype(np.int64)


def make_arrays(n: int, n_layers: int, p_max: int, r_max: int, d: int, plen: np.ndarray, rlen: np.ndarray, seed: int):
    """(n, L, P_max, D) and (n, L, R_max, D) fp16, zero past each length; 8 random blocks
    cycled (generating random numbers is not what we measure), each example marked."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((8, n_layers, p_max + r_max, d), dtype=np.float32).astype(np.float16)
    p = np.empty((n, n_layers, p_max, d), np.float16)
    r = np.empty((n, n_layers, r_max, d), np.float16)
    for e in range(n):
        p[e] = base[e % 8, :, :p_max]
        r[e] = base[e % 8, :, p_max:]
        p[e, :, plen[e] :] = 0
        r[e, :, rlen[e] :] = 0
        p[e, :, 0, 0] = r[e, :, 0, 0] = e % 2048  # exact in fp16: each example differs
    return p, r


# ---- writes: W processes, actstore against raw files -----------------------------------
def _write_store(w: int, n_w: int, store: str, kw: dict, p, r, plen, rlen, b: int, barrier) -> None:
    lo, hi = w * len(p) // n_w, (w + 1) * len(p) // n_w
    barrier.wait()
    with actstore.ShardWriter(store, shard=w, **kw) as wr:
        for i in range(lo, hi, b):
            j = min(i + b, hi)
            wr.append(prompt=p[i:j], response=r[i:j], lengths={"prompt": plen[i:j], "response": rlen[i:j]})


def _write_raw(w: int, n_w: int, folder: str, p, r, b: int, sync: bool, barrier) -> None:
    lo, hi = w * len(p) // n_w, (w + 1) * len(p) // n_w
    barrier.wait()
    with (
        open(f"{folder}/prompt-{w}.bin", "wb", buffering=0) as fp,
        open(f"{folder}/response-{w}.bin", "wb", buffering=0) as fr,
    ):
        for i in range(lo, hi, b):
            j = min(i + b, hi)
            fp.write(memoryview(p[i:j]).cast("B"))
            fr.write(memoryview(r[i:j]).cast("B"))
        if sync:
            os.fsync(fp.fileno())
            os.fsync(fr.fileno())


def run_procs(target, n_w: int, args: tuple) -> float:
    """Seconds from the moment all n_w forked processes are ready until the last one ends."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n_w + 1)
    procs = [ctx.Process(target=target, args=(w, n_w, *args, barrier)) for w in range(n_w)]
    for pr in procs:
        pr.start()
    barrier.wait()
    t0 = time.perf_counter()
    for pr in procs:
        pr.join()
    t = time.perf_counter() - t0
    bad = [pr.exitcode for pr in procs if pr.exitcode]
    if bad:
        raise RuntimeError(f"writer processes failed (exit codes {bad})")
    return t


def bench_writes(root: Path, kw: dict, p, r, plen, rlen, a) -> list[dict]:
    """Rows per W; leaves the W=1 store (root/store-1, finalized) and raw files (root/raw-1)."""
    nbytes = p.nbytes + r.nbytes
    rows = []
    for n_w in ints(a.writers):
        raw = root / f"raw-{n_w}"
        raw.mkdir()
        os.sync()
        t_raw = run_procs(_write_raw, n_w, (str(raw), p, r, a.write_batch, a.durability == "fsync"))
        store = root / f"store-{n_w}"
        os.sync()
        t_store = run_procs(_write_store, n_w, (str(store), kw, p, r, plen, rlen, a.write_batch))
        if n_w == 1:
            actstore.finalize(store)
        else:
            shutil.rmtree(store)
            shutil.rmtree(raw)
        rows.append(
            {
                "metric": "write",
                "writers": n_w,
                "bytes": nbytes,
                "MBps": nbytes / t_store / 1e6,
                "limit": "raw files, W processes",
                "limit_MBps": nbytes / t_raw / 1e6,
                "ratio": t_raw / t_store,
            }
        )
    return rows


# ---- reads -----------------------------------------------------------------------------
def timed(fn, queries) -> list[float]:
    out = []
    for i, l in queries:
        t0 = time.perf_counter()
        fn(i, l)
        out.append(time.perf_counter() - t0)
    return out


def bench_reads(store, raws: dict, lens: dict, zpaths: dict, queries: list[tuple[int, int]]) -> list[dict]:
    import zarr

    rows = []
    for seg in ("prompt", "response"):
        view, raw, ln = store.segment(seg), raws[seg], lens[seg]
        z = zarr.open_array(zpaths[seg], mode="r")
        for i, l in queries[:50]:  # correctness: the store returns the bytes written
            if not np.array_equal(view[i, l], raw[i, l, : ln[i]]):
                raise RuntimeError(f"{seg}[{i}, {l}] read back differs from the raw file")
        fns = {
            "actstore": lambda i, l: view[i, l],
            "memmap": lambda i, l: np.array(raw[i, l, : ln[i]]),
            "zarr": lambda i, l: z[i, l, : ln[i]],
        }
        for fn in (fns["actstore"], fns["memmap"]):
            timed(fn, queries)  # warm every page the timed loops touch
        got = {
            name: stats_us(timed(fn, queries if name != "zarr" else queries[: max(20, len(queries) // 10)]))
            for name, fn in fns.items()
        }
        lim = got["memmap"]
        rows.append(
            {
                "metric": f"read_{seg}",
                **got["actstore"],
                "limit": "np.memmap of a raw file",
                "limit_mean_us": lim["mean_us"],
                "limit_p50_us": lim["p50_us"],
                "limit_p95_us": lim["p95_us"],
                "ratio_p50": got["actstore"]["p50_us"] / lim["p50_us"],
                "zarr_python_p50_us": got["zarr"]["p50_us"],
                "zarr_python_mean_us": got["zarr"]["mean_us"],
            }
        )
    return rows


def bench_batches(store, raws: dict, a, seed: int) -> list[dict]:
    from actstore.torch import PairDataset

    rows = []
    ds0 = PairDataset(store)
    idx = list(ds0.sampler(batch_size=a.batch, k=2, seed=seed))
    lim = []
    for i in idx + idx:  # the second pass is timed (warm)
        t0 = time.perf_counter()
        x = [raws[s][i.examples[:, None], i.layers] for s in ("prompt", "response")]  # fancy indexing copies
        lim.append(time.perf_counter() - t0)
        del x
    lim = stats_us(lim[len(idx) :])
    for n_workers in ints(a.workers):
        ds = PairDataset(store)
        ts = []
        for rep in range(a.epochs):
            it = iter(
                ds.loader(
                    batch_size=a.batch,
                    k=2,
                    seed=seed + rep,
                    num_workers=n_workers,
                    multiprocessing_context="fork" if n_workers else None,
                    persistent_workers=False,
                )
            )
            next(it)  # workers started and the first batch read
            t0 = time.perf_counter()
            for x in it:
                t1 = time.perf_counter()
                ts.append(t1 - t0)
                t0 = t1
                del x
            del it
        if not ts:
            raise RuntimeError(f"--examples {len(store)} / --batch {a.batch}: give at least 2 batches an epoch")
        s = stats_us(ts)
        rows.append(
            {
                "metric": "batch",
                "workers": n_workers,
                "batch": [a.batch, 2],
                **s,
                "batches_per_s": 1e6 / s["mean_us"],
                "limit": "np.memmap fancy indexing, one process",
                "limit_mean_us": lim["mean_us"],
                "limit_p50_us": lim["p50_us"],
                "limit_p95_us": lim["p95_us"],
                "ratio_mean": s["mean_us"] / lim["mean_us"],
            }
        )
    return rows


# ---- one cell ----------------------------------------------------------------------------
def run_cell(root: Path, a, d: int, layout: str, r_max: int, t_chunk: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    plen, rlen = draw_lengths(a, a.examples, r_max, rng)
    p, r = make_arrays(a.examples, a.layers, a.p_max, r_max, d, plen, rlen, seed)
    kw = {
        "fsync": a.durability == "fsync",
        "layers": list(range(a.layers)),
        "d_model": d,
        "segments": {"prompt": a.p_max, "response": r_max},
        "t_chunk": {"prompt": t_chunk, "response": r_max},
    }
    if layout == "v3-sharded":
        kw.update(zarr_format=3, shard_examples=min(a.shard_examples, a.examples))
    cell = {
        "d_model": d,
        "layers": a.layers,
        "examples": a.examples,
        "layout": layout,
        "r_max": r_max,
        "t_chunk": t_chunk,
        "p_max": a.p_max,
        "prompt_chunk_bytes": t_chunk * d * 2,
        "response_chunk_bytes": r_max * d * 2,
    }
    rows = bench_writes(root, kw, p, r, plen, rlen, a)
    if a.parts == "write":
        shutil.rmtree(root / "store-1")
        shutil.rmtree(root / "raw-1")
        return [{**cell, **row} for row in rows]
    store = actstore.ActStore(root / "store-1")
    shape = {"prompt": p.shape, "response": r.shape}
    raws = {s: np.memmap(root / "raw-1" / f"{s}-0.bin", dtype=np.float16, mode="r", shape=shape[s]) for s in shape}
    del p, r
    queries = list(zip(rng.integers(0, a.examples, a.queries).tolist(), rng.integers(0, a.layers, a.queries).tolist()))
    shard0 = root / "store-1" / "shards" / "shard-00000.zarr"
    zpaths = {s: str(shard0 / keys.acts_array(s)) for s in shape}
    rows += bench_reads(store, raws, {"prompt": plen, "response": rlen}, zpaths, queries)
    rows += bench_batches(store, raws, a, seed)
    del raws, store
    shutil.rmtree(root / "store-1")
    shutil.rmtree(root / "raw-1")
    return [{**cell, **row} for row in rows]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="A tiny matrix (CI's benchmark run test); other options still apply."
    )
    ap.add_argument("--d-model", help=f"H values, comma-separated (default {FULL['d_model']}).")
    ap.add_argument("--layers", type=int, help=f"L (default {FULL['layers']}).")
    ap.add_argument("--examples", type=int, help=f"N per store (default {FULL['examples']}).")
    ap.add_argument("--r-max", help=f"R_max values (default {FULL['r_max']}); T_chunk_resp = R_max.")
    ap.add_argument("--t-chunk", help=f"T_chunk_prompt values (default {FULL['t_chunk']}).")
    ap.add_argument("--p-max", type=int, help=f"P_max (default {FULL['p_max']}).")
    ap.add_argument("--queries", type=int, help=f"random reads per segment and cell (default {FULL['queries']}).")
    ap.add_argument("--workers", help=f"DataLoader workers (default {FULL['workers']}).")
    ap.add_argument("--writers", help=f"writer processes (default {FULL['writers']}).")
    ap.add_argument("--batch", type=int, help=f"b, examples per training batch (default {FULL['batch']}).")
    ap.add_argument(
        "--shard-examples",
        type=int,
        help=f"examples per Zarr shard file, v3-sharded (default {FULL['shard_examples']}).",
    )
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="v2 (a file per chunk) and/or v3-sharded.")
    ap.add_argument("--epochs", type=int, default=2, help="DataLoader epochs timed per worker count.")
    ap.add_argument(
        "--durability",
        choices=["fsync", "none"],
        default="fsync",
        help="fsync: ShardWriter(fsync=True) against raw writes + fsync; none: both left in the page cache.",
    )
    ap.add_argument("--parts", choices=["all", "write"], default="all", help="write: the write scaling alone.")
    ap.add_argument("--write-batch", type=int, default=16, help="examples per append.")
    ap.add_argument("--lengths", default=None, help="spec_data.py results: draw token lengths from that data set.")
    ap.add_argument("--dir", default=None, help="Scratch folder (default: a temporary folder).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args()
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    layouts = [x for x in a.layouts.split(",") if x]
    if set(layouts) - set(LAYOUTS):
        ap.error(f"--layouts takes {list(LAYOUTS)}. Got {layouts}.")
    root = Path(tempfile.mkdtemp(prefix="bench-spec-", dir=a.dir))
    rows: list[dict] = []
    t_start = time.time()
    load = [os.getloadavg()]
    try:
        for d in ints(a.d_model):
            for layout in layouts:
                for r_max in ints(a.r_max):
                    for t_chunk in ints(a.t_chunk):
                        if t_chunk > a.p_max:
                            continue
                        cell = run_cell(root, a, d, layout, r_max, t_chunk, a.seed)
                        rows += cell
                        load.append(os.getloadavg())
                        by = {x["metric"] + str(x.get("workers", x.get("writers", ""))): x for x in cell}
                        if a.parts == "write":
                            print(
                                f"H={d} {layout} R_max={r_max} T_chunk={t_chunk}: "
                                + ", ".join(
                                    f"W={x['writers']} {x['MBps']:.0f} MB/s, raw {x['limit_MBps']:.0f} ({x['ratio']:.2f}x)"
                                    for x in cell
                                ),
                                flush=True,
                            )
                            continue
                        print(
                            f"H={d} {layout} R_max={r_max} T_chunk={t_chunk}: prompt p50 {by['read_prompt']['p50_us']:.0f} us "
                            f"({by['read_prompt']['ratio_p50']:.2f}x memmap), response p50 {by['read_response']['p50_us']:.0f} us "
                            f"({by['read_response']['ratio_p50']:.2f}x), batch w0 {by['batch0']['p50_us'] / 1e3:.1f} ms, "
                            f"write "
                            + ", ".join(
                                f"W={x['writers']} {x['MBps']:.0f} MB/s ({x['ratio']:.2f}x raw)"
                                for x in cell
                                if x["metric"] == "write"
                            ),
                            flush=True,
                        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = {
        k: getattr(a, k)
        for k in (
            "quick",
            "d_model",
            "layers",
            "examples",
            "r_max",
            "t_chunk",
            "p_max",
            "queries",
            "workers",
            "writers",
            "batch",
            "shard_examples",
            "layouts",
            "epochs",
            "write_batch",
            "durability",
            "parts",
            "lengths",
            "seed",
        )
    }
    path = save(
        "spec",
        {
            "params": params,
            "command": " ".join(sys.argv),
            "seconds": time.time() - t_start,
            "load_average": load,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    if not a.no_plot and a.parts == "all":
        from spec_plot import plot

        print(f"figure: {plot(rows, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
