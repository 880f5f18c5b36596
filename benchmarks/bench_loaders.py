"""Training loaders benchmark (issue 6): every figure against its limit, measured in one
run on the same data.

Data: a fp16 ViT-like store (default 2000 examples x 2 layers x 257 tokens x 768), a raw
file with the same bytes in (N, L, T, D) order, and its saev export (float32 shards).

1. PairDataset, a batch of 256 examples x 2 random layers:
   - warm: against np.memmap fancy indexing of the raw file (raw[ex[:, None], layers]);
   - cold (page cache dropped with posix_fadvise DONTNEED on every file before each
     batch): against a thread pool (same thread count) pread-ing the same chunk files
     into a preallocated buffer.
2. TokenStream, one whole epoch, tokens/s: against a sequential read of the raw file in
   16 MiB blocks (cold and warm), and against saev's shuffled loader design over the
   exported shards (reimplemented below: I/O threads in a manager process copy runs of
   examples, token by token, out of memory-mapped float32 shards into a shared reservoir;
   the consumer draws each batch token by token under the reservoir's lock).
3. The shuffle knob: for several buffer sizes, with and without runs, window memory,
   tokens/s cold and warm, and how many distinct examples a batch mixes (inverse Simpson
   index; the same for a perfect shuffle is given).

Run: .venv/bin/python benchmarks/bench_loaders.py [--examples 2000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import add_store_shape_args, drop_cache, save  # noqa: E402
from token_stages import stage_costs  # noqa: E402

import actstore  # noqa: E402
from actstore.torch import PairDataset, TokenStream  # noqa: E402

BLOCK = 16 * 2**20
warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on a 2-core machine, on purpose


# ---- data ---------------------------------------------------------------------------
def build(root: Path, n: int, n_layers: int, tokens: int, d_model: int) -> tuple[actstore.ActStore, Path]:
    """The store and a raw file holding the same bytes (cycled random batches)."""
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((50, n_layers, tokens, d_model), dtype=np.float32).astype(np.float16) for _ in range(8)]
    raw = root / "raw.bin"
    # The chunk-file layout: the benchmark drops and reads its chunk files by name.
    with (
        actstore.ShardWriter(
            root / "store", layers=list(range(n_layers)), d_model=d_model, tokens=tokens, zarr_format=2
        ) as w,
        open(raw, "wb") as f,
    ):
        for i in range(0, n, 50):
            b = pool[(i // 50) % len(pool)][: n - i]
            w.append(b)
            f.write(memoryview(b).cast("B"))
    actstore.finalize(root / "store")
    os.sync()
    return actstore.ActStore(root / "store"), raw


def drop_all(*paths: Path) -> None:
    for p in paths:
        drop_cache(p)


def warm(*paths: Path) -> None:
    buf = bytearray(BLOCK)
    for p in paths:
        for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


# ---- 1. PairDataset -------------------------------------------------------------------
def chunk_paths(store: actstore.ActStore, exs: np.ndarray, lays: np.ndarray) -> list[str]:
    out = []
    for ex, row in zip(exs.tolist(), lays.tolist()):
        pos, local = store.index.locate(ex)
        lay = store._shard(pos).io["tokens"]
        out.extend(lay.chunk_path(local, store.layers.index(layer), 0) for layer in row)
    return out


def pread_batch(pool: ThreadPoolExecutor, paths: list[str], out: np.ndarray, threads: int) -> None:
    """The limit: whole-chunk preads of the same files into a preallocated buffer."""
    flat = out.reshape(len(paths), -1).view(np.uint8)

    def job(i0: int, i1: int) -> None:
        for i in range(i0, i1):
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [flat[i]], 0)
            finally:
                os.close(fd)

    step = -(-len(paths) // threads)
    for f in [pool.submit(job, i, min(i + step, len(paths))) for i in range(0, len(paths), step)]:
        f.result()


def bench_pairs(store, raw_path, root, n, n_layers, tokens, d_model, b, k, threads, repeats) -> dict:
    raw = np.memmap(raw_path, dtype=np.float16, mode="r", shape=(n, n_layers, tokens, d_model))
    ds = PairDataset(store, threads=threads)
    idx = [next(iter(ds.sampler(batch_size=b, k=k, seed=seed))) for seed in range(1, repeats + 1)]  # full batches
    check = ds[idx[0]]
    assert np.array_equal(check["acts"].numpy(), raw[idx[0].examples[:, None], idx[0].layers]), "store != raw bytes"
    del check
    pool = ThreadPoolExecutor(threads)
    out = np.empty((b, k, tokens, d_model), np.float16)
    t = {"memmap_warm": [], "pairs_warm": [], "pread_cold": [], "pairs_cold": [], "memmap_cold": []}
    warm(root)
    for e in range(0, n, 64):  # map every page of the memmap once: its steady state in a training run
        np.add.reduce(raw[e : e + 64], axis=None)
    for i in idx:  # warm: every page is cached
        t0 = time.perf_counter()
        x = raw[i.examples[:, None], i.layers]  # fancy indexing copies into a new array
        t["memmap_warm"].append(time.perf_counter() - t0)
        del x
        t0 = time.perf_counter()
        x = ds[i]
        t["pairs_warm"].append(time.perf_counter() - t0)
        del x
    del raw  # pages mapped into this process cannot be dropped from the page cache
    for i in idx:  # cold: every file dropped from the page cache before each batch
        paths = chunk_paths(store, i.examples, i.layers)
        # A fresh memmap each time: pages mapped into this process cannot be dropped.
        fresh = lambda: np.memmap(raw_path, dtype=np.float16, mode="r", shape=(n, n_layers, tokens, d_model))  # noqa: E731
        for name, fn in (
            ("pread_cold", lambda: pread_batch(pool, paths, out[: len(i.examples)], threads)),
            ("pairs_cold", lambda: ds[i]),
            ("memmap_cold", lambda: fresh()[i.examples[:, None], i.layers]),
        ):
            drop_all(root / "store", raw_path)
            t0 = time.perf_counter()
            x = fn()
            t[name].append(time.perf_counter() - t0)
            del x
    pool.shutdown()
    med = {name: statistics.median(v) for name, v in t.items()}
    nbytes = b * k * tokens * d_model * 2
    return {
        "batch": [b, k, tokens, d_model],
        "bytes": nbytes,
        "batches": len(idx),
        "threads": threads,
        "median_ms": {name: round(1e3 * v, 1) for name, v in med.items()},
        "warm_vs_memmap": med["pairs_warm"] / med["memmap_warm"],
        "cold_vs_pread": med["pairs_cold"] / med["pread_cold"],
    }


def bench_pair_workers(store, b, k, threads, batches) -> dict:
    """Batches/s through a DataLoader with 0, 2 and 4 workers (warm)."""
    out = {}
    for w in (0, 2, 4):
        ds = PairDataset(store, threads=threads)
        dl = ds.loader(batch_size=b, k=k, seed=2, num_workers=w, multiprocessing_context="fork" if w else None)
        it = iter(dl)
        next(it)  # workers started
        t0 = time.perf_counter()
        got = 0
        for _ in range(batches):
            try:
                x = next(it)
            except StopIteration:
                break
            got += 1
            del x
        out[w] = got / (time.perf_counter() - t0)
        del it
    return out


# ---- 2. TokenStream -------------------------------------------------------------------
def sequential_read(path: Path) -> float:
    buf = bytearray(BLOCK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


FIRST_BATCH: dict[int, float] = {}


def epoch_rate(ts: TokenStream, num_workers: int = 0) -> float:
    """Tokens/s of one whole epoch (from asking for the first batch to the last)."""
    n = 0
    t0 = time.perf_counter()
    for x in ts.loader(num_workers=num_workers, multiprocessing_context="fork" if num_workers else None):
        if not n:
            FIRST_BATCH[id(ts)] = time.perf_counter() - t0
        n += len(x)
    dt = time.perf_counter() - t0
    assert n == ts.n_tokens
    return n / dt


def bench_tokens(store, root: Path, raw: Path, n_tokens: int, batch: int, threads: int, repeats: int) -> dict:
    """Whole epochs, tokens/s, cold then warm, each stream reused across epochs as in training
    (its first, untimed epoch allocates its buffers and maps the store's files). Every
    repeat runs the sequential read and each stream back to back; `*_vs_seq` is the
    median of the per-repeat ratios (pairs that shared the machine's load)."""
    streams = {
        "f16": (TokenStream(store, batch_size=batch, threads=threads), 0),
        "f16_read": (TokenStream(store, batch_size=batch, threads=threads, mmap=False), 0),
        "f32": (TokenStream(store, batch_size=batch, threads=threads, dtype=torch.float32), 0),
        "f16_w2": (TokenStream(store, batch_size=batch, threads=threads), 2),
        "f16_runs": (TokenStream(store, batch_size=batch, threads=threads, run_bytes=4 * 2**20), 0),
    }
    for ts, w in streams.values():
        if not w:
            epoch_rate(ts, w)
    out = {}
    for cond, reps in (("cold", repeats), ("warm", repeats)):
        if cond == "warm":
            warm(root / "store", raw)
            for ts, w in streams.values():  # the cold runs released every stream: map the store again, untimed
                if not w:
                    epoch_rate(ts, w)
        runs: dict[str, list[float]] = {k: [] for k in ("seq", *streams)}
        first: list[float] = []
        for _ in range(reps):
            for name in runs:
                if cond == "cold":
                    for ts, _ in streams.values():
                        # Cold means nothing of the store in memory: not the window a stream
                        # read ahead, nor the pages its mappings hold (mapped pages cannot
                        # be dropped from the page cache).
                        ts.release()
                    drop_all(root / "store", raw)
                if name == "seq":
                    runs[name].append(n_tokens / sequential_read(raw))
                else:
                    ts, w = streams[name]
                    runs[name].append(epoch_rate(ts, w))
                    if name == "f16":
                        first.append(FIRST_BATCH[id(ts)])
        d = out[cond] = {k: statistics.median(v) for k, v in runs.items()}
        d["f16_first_batch_s"] = statistics.median(first)
        for k in streams:
            d[f"{k}_vs_seq"] = statistics.median(a / b for a, b in zip(runs[k], runs["seq"]))
            d[f"{k}_pairs"] = [round(a / b, 3) for a, b in zip(runs[k], runs["seq"])]
    first = streams["f16"][0]
    out["window_tokens"] = first.window_batches * batch
    out["run_units"] = first.run
    for ts, _ in streams.values():
        ts.release()
    return out


# ---- saev's shuffled loader design, reimplemented for the comparison -------------------
class Reservoir:
    """Shared-memory pool of token vectors: producers put runs under one lock; the consumer
    takes each batch's tokens one at a time at random (swap with the tail) under that lock."""

    def __init__(self, capacity: int, d_model: int, seed: int):
        self.data = torch.empty((capacity, d_model), dtype=torch.float32).share_memory_()
        self.meta = torch.empty((capacity, 2), dtype=torch.int32).share_memory_()
        self.size = mp.Value("L", 0)
        self.lock = mp.Lock()
        self.free = mp.Semaphore(capacity)
        self.full = mp.Semaphore(0)
        self.rng = np.random.default_rng(seed)

    def put(self, xs: torch.Tensor, meta: torch.Tensor) -> None:
        n = len(xs)
        for _ in range(n):
            self.free.acquire()
        with self.lock:
            s = self.size.value
            self.data[s : s + n].copy_(xs)
            self.meta[s : s + n].copy_(meta)
            self.size.value = s + n
        for _ in range(n):
            self.full.release()

    def get(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(bsz):
            self.full.acquire()
        out_x = torch.empty((bsz, self.data.shape[1]), dtype=self.data.dtype)
        out_m = torch.empty((bsz, 2), dtype=self.meta.dtype)
        with self.lock:
            for i in range(bsz):
                r = int(self.rng.integers(self.size.value))
                out_x[i].copy_(self.data[r])
                out_m[i].copy_(self.meta[r])
                last = self.size.value - 1
                if r != last:
                    self.data[r].copy_(self.data[last])
                    self.meta[r].copy_(self.meta[last])
                self.size.value -= 1
        for _ in range(bsz):
            self.free.release()
        return out_x, out_m


def _saev_io_thread(shards_dir, shard_shape, counts, layer_i, work, reservoir, chunk, stop) -> None:
    while not stop.is_set():
        shard = work.get()
        if shard is None:
            return
        mm = np.memmap(Path(shards_dir) / f"acts{shard:06d}.bin", mode="r", dtype=np.float32, shape=shard_shape)
        offset = shard * shard_shape[0]
        for start in range(0, counts[shard], chunk):
            end = min(start + chunk, counts[shard])
            for t in range(shard_shape[2]):  # one token position of a run of examples at a time
                acts = torch.from_numpy(np.ascontiguousarray(mm[start:end, layer_i, t]))
                meta = torch.full((end - start, 2), t, dtype=torch.int32)
                meta[:, 0] = offset + torch.arange(start, end)
                reservoir.put(acts, meta)
                if stop.is_set():
                    return


def _saev_manager(shards_dir, shard_shape, counts, layer_i, reservoir, n_threads, chunk, seed, stop) -> None:
    import queue

    work: queue.Queue = queue.Queue()
    for s in np.random.default_rng(seed).permutation(len(counts)):
        work.put(int(s))
    for _ in range(n_threads):
        work.put(None)
    tstop = threading.Event()
    threads = [
        threading.Thread(
            target=_saev_io_thread,
            args=(shards_dir, shard_shape, counts, layer_i, work, reservoir, chunk, tstop),
            daemon=True,
        )
        for _ in range(n_threads)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not stop.is_set():
        time.sleep(0.05)
    tstop.set()


def bench_saev_design(
    saev_dir: Path, layer_i: int, batch_size: int, buffer_batches: int, n_threads: int, batches: int
) -> dict:
    store = actstore.open(saev_dir)
    g = store.geometry
    counts = [int(c) for c in g.shard_counts()]
    chunk = min(1024, math.ceil(batch_size * buffer_batches / n_threads))
    ctx = mp.get_context("fork")
    t_start = time.perf_counter()
    reservoir = Reservoir(buffer_batches * batch_size, g.d_model, seed=0)
    stop = ctx.Event()
    proc = ctx.Process(
        target=_saev_manager,
        args=(str(saev_dir), g.shard_shape, counts, layer_i, reservoir, n_threads, chunk, 0, stop),
        daemon=True,
    )
    proc.start()
    try:
        x, _ = reservoir.get(batch_size)
        first = time.perf_counter() - t_start
        t0 = time.perf_counter()
        for _ in range(batches):
            x, meta = reservoir.get(batch_size)
        dt = time.perf_counter() - t0
    finally:
        stop.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return {
        "tokens_per_s": batches * batch_size / dt,
        "first_batch_s": first,
        "batch_size": batch_size,
        "reservoir_tokens": buffer_batches * batch_size,
        "threads": n_threads,
        "batches_timed": batches,
    }


# ---- 3. the shuffle knob -----------------------------------------------------------------
def inverse_simpson(ids: np.ndarray) -> float:
    """Effective number of distinct sources in a batch (= len(ids) when all distinct)."""
    _, c = np.unique(ids, return_counts=True)
    p = c / c.sum()
    return float(1.0 / (p * p).sum())


def bench_knob(store, store_dir: Path, layer, batch_size, sizes_mb, threads, probe_batches) -> list[dict]:
    """For each buffer size, without runs (default) and with runs of 4 MiB: window memory,
    tokens/s cold and warm, and the examples a batch mixes (inverse Simpson index)."""
    rows = []
    t_max = store.config.segments[0].t_max
    rng = np.random.default_rng(0)
    ideal = statistics.mean(
        inverse_simpson(rng.choice(len(store) * t_max, batch_size, replace=False) // t_max) for _ in range(20)
    )
    for mb in sizes_mb:
        for run_bytes in (0, 4 * 2**20):
            kw = dict(
                layers=[layer],
                batch_size=batch_size,
                buffer_bytes=int(mb * 2**20),
                threads=threads,
                run_bytes=run_bytes,
            )
            ts = TokenStream(store, **kw)
            epoch_rate(ts)  # first epoch: allocates its buffers
            ts.release()  # cold: no window read ahead, no mapped pages (which could not be dropped)
            drop_all(store_dir)
            cold = epoch_rate(ts)
            warm_rate = epoch_rate(ts)
            ts.release()
            mix = []
            for i, b in enumerate(TokenStream(store, return_index=True, **kw)):
                mix.append(inverse_simpson(b["example"].numpy()))
                if i + 1 == probe_batches:
                    break
            win_tokens = ts.window_batches * batch_size
            rows.append(
                {
                    "buffer_mb": mb,
                    "run_units": ts.run,
                    "window_tokens": win_tokens,
                    "examples_per_window": win_tokens / t_max,
                    "window_memory_mb": round((ts.prefetch + 2) * win_tokens * store.d_model * 2 / 2**20, 1),
                    "tokens_per_s_cold": cold,
                    "tokens_per_s_warm": warm_rate,
                    "examples_mixed_per_batch": statistics.mean(mix),
                    "perfect_shuffle": ideal,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_store_shape_args(ap)
    ap.add_argument("--pair-batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--token-batch", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument(
        "--repeats", type=int, default=5, help="PairDataset batches timed (median) and epochs per TokenStream figure"
    )
    ap.add_argument("--saev-batch", type=int, default=16384)
    ap.add_argument("--saev-buffer", type=int, default=16, help="reservoir size in batches (saev's default is 64)")
    ap.add_argument("--saev-batches", type=int, default=6)
    ap.add_argument("--knob-mb", default="8,32,128,512")
    ap.add_argument("--dir", default=None, help="where to put the temporary data (default: a temp dir)")
    ap.add_argument(
        "--only", choices=["tokens"], default=None, help="run only the TokenStream figures and the stage breakdown"
    )
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="actstore-bench-loaders-"))
    res: dict = {}
    try:
        n, L, T, D = a.examples, a.layers, a.tokens, a.d_model
        t0 = time.perf_counter()
        store, raw = build(root, n, L, T, D)
        from actstore.saev import export_saev

        saev_dir = (
            None
            if a.only
            else export_saev(
                store,
                root / "saev",
                protocol="2.0",
                family="dinov2",
                ckpt="bench/random",
                dataset="/bench",
                cls="none",
                fsync=False,
                progress=False,
            ).path
        )
        os.sync()
        nbytes = n * L * T * D * 2
        print(
            f"data: {n} examples x {L} layers x {T} tokens x {D} (fp16 {nbytes / 1e9:.2f} GB; saev float32 "
            f"{2 * nbytes / 1e9:.2f} GB), built in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        res["shape"] = [n, L, T, D]

        if a.only is None:
            res["pairs"] = p = bench_pairs(store, raw, root, n, L, T, D, a.pair_batch, a.k, a.threads, a.repeats)
            print(
                f"PairDataset {a.pair_batch}x{a.k} ({p['bytes'] / 1e6:.0f} MB), median ms: {p['median_ms']}; "
                f"warm {p['warm_vs_memmap']:.2f}x memmap, cold {p['cold_vs_pread']:.2f}x pread",
                flush=True,
            )
            res["pair_workers_batches_per_s"] = pw = bench_pair_workers(
                store, a.pair_batch, a.k, a.threads, 2 * a.repeats
            )
            print(f"PairDataset through a DataLoader, warm batches/s by workers: {pw}", flush=True)

        res["tokens"] = tok = bench_tokens(store, root, raw, n * L * T, a.token_batch, a.threads, a.repeats)
        for c in ("cold", "warm"):
            d = tok[c]
            print(
                f"TokenStream {c} (load {os.getloadavg()[0]:.1f}), tokens/s: sequential read {d['seq'] / 1e6:.2f}M; "
                f"stream float16 {d['f16'] / 1e6:.2f}M ({d['f16_vs_seq']:.2f}x, pairs {d['f16_pairs']}), "
                f"read path (mmap=False) {d['f16_read'] / 1e6:.2f}M ({d['f16_read_vs_seq']:.2f}x), "
                f"float32 {d['f32'] / 1e6:.2f}M ({d['f32_vs_seq']:.2f}x), "
                f"2 DataLoader workers {d['f16_w2'] / 1e6:.2f}M ({d['f16_w2_vs_seq']:.2f}x), "
                f"runs of 4 MiB {d['f16_runs'] / 1e6:.2f}M ({d['f16_runs_vs_seq']:.2f}x)",
                flush=True,
            )
        warm(root / "store", raw)
        res["token_stages"] = st = stage_costs(store, raw, a.token_batch, a.repeats, sequential_read)
        print(
            f"TokenStream warm, CPU ns per token of each stage alone (load {os.getloadavg()[0]:.1f}): {st['ns_per_token']}; "
            f"ceiling on {st['cores']} cores vs the sequential read: mapped {st['ceiling_vs_seq']['mapped']:.2f}x, "
            f"read {st['ceiling_vs_seq']['read']:.2f}x",
            flush=True,
        )
        if a.only is not None:
            print(f"results: {save('loaders', res)}")
            return
        layer = store.layers[0]
        drop_all(saev_dir)
        sv = bench_saev_design(saev_dir, 0, a.saev_batch, a.saev_buffer, 4, a.saev_batches)
        one = {}
        ts = TokenStream(store, layers=[layer], batch_size=a.saev_batch, threads=a.threads, dtype=torch.float32)
        epoch_rate(ts)  # first epoch: allocates its buffers
        for c in ("cold", "warm"):
            if c == "cold":
                ts.release()  # its mapped pages could not be dropped
                drop_all(root / "store")
            one[c] = epoch_rate(ts)
        sv["stream_one_layer_float32"] = one
        sv["stream_vs_saev"] = {c: one[c] / sv["tokens_per_s"] for c in one}
        res["saev_design"] = sv
        print(
            f"saev shuffled-loader design (layer {layer}, batch {a.saev_batch}): {sv['tokens_per_s'] / 1e3:.1f}K tok/s "
            f"(first batch after {sv['first_batch_s']:.1f} s); TokenStream same layer float32: cold "
            f"{one['cold'] / 1e6:.2f}M ({sv['stream_vs_saev']['cold']:.0f}x), warm {one['warm'] / 1e6:.2f}M "
            f"({sv['stream_vs_saev']['warm']:.0f}x)",
            flush=True,
        )

        sizes = [float(x) for x in a.knob_mb.split(",")]
        res["knob"] = knob = bench_knob(store, root / "store", layer, a.token_batch, sizes, a.threads, 20)
        for r in knob:
            print(
                f"buffer {r['buffer_mb']:g} MiB, runs of {r['run_units']} units: window {r['window_tokens']} tokens "
                f"({r['examples_per_window']:.0f} examples), memory {r['window_memory_mb']} MiB, "
                f"{r['tokens_per_s_cold'] / 1e6:.2f}M tok/s cold, {r['tokens_per_s_warm'] / 1e6:.2f}M warm, "
                f"examples mixed per batch {r['examples_mixed_per_batch']:.0f} (perfect shuffle {r['perfect_shuffle']:.0f})",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"results: {save('loaders', res)}")


if __name__ == "__main__":
    main()
