"""Where a warm TokenStream epoch's time goes (used by bench_loaders.py): each stage run
alone, over a whole epoch of the same store, in CPU (thread) nanoseconds per token.

- seq_read: the reference, a sequential read of the raw file in 16 MiB blocks (one
  kernel copy from the page cache into a buffer that stays in the CPU cache);
- mapped path (one copy): `map_fill` (the reader thread: remembered rows, residency
  check, the window's row index) and `gather` (page cache -> batch buffer, one thread;
  `gather_2` is the wall time split over two threads);
- read path (two copies): `read_copy` (page cache -> window buffer, on the reader
  thread) and `window_gather` (window -> batch buffer).

The ceiling on C cores is C / (sum of a path's stages) tokens/s when every stage runs
beside the others and nothing else needs the cores (the training loop does).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from actstore.loaders.assemble import _numpy_view
from actstore.loaders.pipeline import TokenPipeline
from actstore.loaders.windows import WindowSlot, void_rows
from actstore.torch import TokenStream


def _parts(ts: TokenStream) -> TokenPipeline:
    """A stream's pipeline parts (no window of its own to read)."""
    for _ in ts:  # an epoch first: mappings and buffers as in a warm run
        pass
    pipe = TokenPipeline(ts, ts.plan(), range(0), 0, False, ts.spares)
    pipe.close()
    return pipe


def _path_costs(ts: TokenStream, fill) -> tuple[float, float, float]:
    """(fill, gather on one thread, gather wall with the stream's gather threads) seconds per epoch."""
    plan = ts.plan()
    pipe = _parts(ts)
    maker = pipe.maker
    t_fill = t_gather = t_wall = 0.0
    for j in range(plan.n_windows):
        w = plan.window(j)
        slot = WindowSlot()
        c0 = time.thread_time()
        fill(pipe, w, slot)
        t_fill += time.thread_time() - c0
        perm = plan.window_permutation(w)
        for b in range(w.n_batches):
            rows = perm[b * ts.batch_size : (b + 1) * ts.batch_size]
            out = maker.ring.take((len(rows), ts.d_model))
            dst = void_rows(_numpy_view(out))
            helper, maker.helper = maker.helper, None
            c0 = time.thread_time()
            maker.gather(slot, rows, dst)  # one thread
            t_gather += time.thread_time() - c0
            maker.helper = helper
            t0 = time.perf_counter()
            maker.gather(slot, rows, dst)  # the stream's gather threads
            t_wall += time.perf_counter() - t0
        slot.release()
    pipe.finish()
    return t_fill, t_gather, t_wall


def stage_costs(store, raw: Path, batch: int, repeats: int, sequential_read: Callable[[Path], float]) -> dict:
    """Medians over `repeats` epochs of each stage, in ns per token, and the ceilings
    (`sequential_read(raw)`: the reference's seconds, on one thread)."""
    mapped = TokenStream(store, batch_size=batch)
    read = TokenStream(store, batch_size=batch, mmap=False)
    n = mapped.n_tokens
    runs: dict[str, list[float]] = {
        k: [] for k in ("seq_read", "map_fill", "gather", "gather_2", "read_copy", "window_gather")
    }
    for _ in range(repeats):
        runs["seq_read"].append(sequential_read(raw))
        f, g, g2 = _path_costs(mapped, lambda p, w, s: p.mapped.fill(w, s))
        runs["map_fill"].append(f)
        runs["gather"].append(g)
        runs["gather_2"].append(g2)
        f, g, _ = _path_costs(read, lambda p, w, s: p.reads.fill(w, s))
        runs["read_copy"].append(f)
        runs["window_gather"].append(g)
    ns = {k: 1e9 * statistics.median(v) / n for k, v in runs.items()}
    cores = os.cpu_count() or 1
    one_copy, two_copies = ns["map_fill"] + ns["gather"], ns["read_copy"] + ns["window_gather"]
    return {
        "ns_per_token": {k: round(v, 1) for k, v in ns.items()},
        "cores": cores,
        "ceiling_vs_seq": {
            "mapped": round(ns["seq_read"] * cores / one_copy, 3),
            "read": round(ns["seq_read"] * cores / two_copies, 3),
        },
        "ceiling_tokens_per_s": {"mapped": cores * 1e9 / one_copy, "read": cores * 1e9 / two_copies},
    }
