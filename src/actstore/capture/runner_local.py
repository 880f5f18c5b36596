"""--workers N (--runner local): N writer processes on this machine (spawned), each writing
one shard, their progress and results sent back over a queue."""

from __future__ import annotations

import os
import queue
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from actstore.capture.capture_bar import CaptureBar
from actstore.capture.loop import RecordResult
from actstore.capture.options import CaptureOptions
from actstore.capture.ranks import bar_total
from actstore.errors import CaptureError


def run_workers(o: CaptureOptions, n: int, run_shard: Callable[..., RecordResult]) -> list[RecordResult]:
    """Start `o.workers` writer processes, each running `run_shard` (actstore.capture.run) on its rank."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # torch and threads: never fork a process that runs torch
    q = ctx.Queue()
    threads = o.threads or max(1, (os.cpu_count() or 1) // o.workers)
    wo = replace(o, threads=threads, progress=False)
    procs = [
        ctx.Process(target=_worker_main, args=(wo, r, q, run_shard), name=f"actstore-writer-{r}")
        for r in range(o.workers)
    ]
    total = bar_total(o, n)
    if o.progress:
        print(f"starting {o.workers} writer processes (each loads {o.model}) ...", file=sys.stderr, flush=True)
    for p in procs:
        p.start()
    bar = CaptureBar(total=total, desc=f"{o.workers} writers", disable=not o.progress)
    results: dict[int, RecordResult] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < o.workers:
            try:
                msg = q.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(procs):  # a writer killed from outside sends nothing
                    if not p.is_alive() and r not in results and r not in errors and q.empty():
                        errors[r] = f"died without a word (exit code {p.exitcode}); rerun with --resume"
                continue
            if msg[0] == "progress":
                bar.update(*msg[1:])
            elif msg[0] == "io":
                bar.io(msg[2], who=msg[1])
            elif msg[0] == "done":
                results[msg[1]] = msg[2]
            else:
                errors[msg[1]] = msg[2]
    finally:
        bar.close()
        for p in procs:
            p.join(timeout=None if not errors else 5)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        by_msg: dict[str, list[int]] = {}
        for r, m in sorted(errors.items()):
            by_msg.setdefault(m, []).append(r)
        raise CaptureError(
            "; ".join(f"writer{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_msg.items())
        )
    return [results[r] for r in range(o.workers)]


def _worker_main(o: CaptureOptions, rank: int, q: Any, run_shard: Callable[..., RecordResult]) -> None:
    """Entry point of a writer process: write one shard, report progress and the result."""
    try:
        res = run_shard(o, rank, o.workers, progress=_QueueProgress(q, rank))
        q.put(("done", rank, res))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        q.put(("error", rank, str(e) or type(e).__name__))


class _QueueProgress:
    def __init__(self, q: Any, rank: int):
        self.q = q
        self.rank = rank

    def update(self, examples: int, tokens: int, nbytes: int) -> None:
        self.q.put(("progress", examples, tokens, nbytes))

    def io(self, stats: Any) -> None:
        self.q.put(("io", self.rank, stats))
