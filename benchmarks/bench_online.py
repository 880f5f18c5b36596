"""Online capture and training (issue 41): a durable consumer against an offline epoch, and
a spooled writer against a plain one, with a forward that costs nothing (bench_gpu.py's
ReplayModel: the capture pipeline alone sets the pace).

1. Consumer throughput: a store of --tokens tokens x 2 layers is captured and finalized;
   then, alternately, --repeats times: an offline epoch of layer 0 (TokenStream(store)) and
   a named consumer reading layer 0 of the same store (TokenStream.follow(store,
   consumer=..., ack="yielded"): the writer has kept up, every block is there). Same
   batch size and buffer. Headline: the median of consumer / offline tokens per second.
2. Writer throughput: record() of the same batches into a plain store, and into a spool of
   --budget-fraction of the capture's bytes while two consumers (layers 0 and 1, threads
   of this process, ack="yielded") read it; alternately, --repeats times. Headline: the
   median of spooled / plain tokens per second. A third figure, plain with the same two
   consumers following it (no names, nothing removed), separates the consumers' CPU from
   the spool's own cost.
Every store has a spool's layout (Zarr 3, one file per example: shard_examples=None), so
that the runs write the same files.

Run: python benchmarks/bench_online.py --dir /dev/shm
Results: bench-results/online.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_gpu import ReplayModel  # noqa: E402
from common import save  # noqa: E402

import actstore  # noqa: E402
from actstore.torch import TokenStream  # noqa: E402


def batches(a) -> list[torch.Tensor]:
    n = a.tokens // (a.batch_size * a.seq_len)
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (a.batch_size, a.seq_len), generator=g) for _ in range(n)]


def capture(model, data, store: Path, a, spool: int | None = None) -> float:
    t0 = time.perf_counter()
    actstore.record(
        model,
        data,
        store,
        layers=[0, 1],
        commit_bytes=a.commit_bytes,
        writer_nice=0,
        shard_examples=None,  # a spool's layout (one file per example), plain or not: the same files
        **({"spool": spool} if spool else {}),
    )
    return time.perf_counter() - t0


def epoch(stream) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(len(x) for x in stream)
    return time.perf_counter() - t0, n


def read_side(a, folder: Path, model, data) -> dict:
    store = folder / "store"
    capture(model, data, store, a)
    actstore.finalize(store)
    opts = dict(layers=[0], batch_size=a.train_batch, buffer_bytes=a.buffer_bytes)
    offline, online = [], []
    epoch(TokenStream(store, **opts))  # warm: the page cache, the imports
    for i in range(a.repeats):
        dt, n = epoch(TokenStream(store, **opts))
        offline.append(n / dt)
        dt, n2 = epoch(TokenStream.follow(store, consumer=f"bench{i}", ack="yielded", **opts))
        assert n2 == n, (n, n2)
        online.append(n2 / dt)
    shutil.rmtree(store)
    return {
        "offline_tokens_per_s": offline,
        "consumer_tokens_per_s": online,
        "consumer_over_offline": statistics.median(c / o for c, o in zip(online, offline)),
    }


def with_consumers(store: Path, named: bool, a) -> tuple[list[threading.Thread], list[int]]:
    counts = [0, 0]

    def read(i: int) -> None:
        kw = dict(layers=[i], batch_size=a.train_batch, buffer_bytes=a.buffer_bytes, poll_s=0.02)
        s = (
            TokenStream.follow(store, consumer=f"l{i}", ack="yielded", **kw)
            if named
            else TokenStream.follow(store, **kw)
        )
        for x in s:
            counts[i] += len(x)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    return threads, counts


def write_side(a, folder: Path, model, data) -> dict:
    nbytes = a.tokens * 2 * a.d_model * 2
    budget = int(nbytes * a.budget_fraction)
    plain, spooled, followed = [], [], []
    for i in range(a.repeats):
        dt = capture(model, data, folder / f"p{i}", a)
        plain.append(a.tokens / dt)
        shutil.rmtree(folder / f"p{i}")
        for named, out in ((True, spooled), (False, followed)):
            store = folder / f"{'s' if named else 'f'}{i}"
            threads, counts = with_consumers(store, named, a)
            dt = capture(model, data, store, a, spool=budget if named else None)
            out.append(a.tokens / dt)
            actstore.finalize(store)
            for t in threads:
                t.join()
            assert counts == [a.tokens, a.tokens], counts
            shutil.rmtree(store)
    return {
        "budget_bytes": budget,
        "capture_bytes": nbytes,
        "plain_tokens_per_s": plain,
        "spooled_tokens_per_s": spooled,
        "plain_followed_tokens_per_s": followed,
        "spooled_over_plain": statistics.median(s / p for s, p in zip(spooled, plain)),
        "followed_over_plain": statistics.median(f / p for f, p in zip(followed, plain)),
        "spooled_over_followed": statistics.median(s / f for s, f in zip(spooled, followed)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--batch-size", type=int, default=8, help="capture batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--commit-bytes", type=int, default=4 << 20)
    ap.add_argument("--train-batch", type=int, default=4096)
    ap.add_argument("--buffer-bytes", type=int, default=16 << 20)
    ap.add_argument("--budget-fraction", type=float, default=0.25, help="the spool's budget / the capture's bytes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["read", "write"], default=None)
    a = ap.parse_args()
    model = ReplayModel(2, a.batch_size, a.seq_len, a.d_model, torch.float16, "cpu")
    data = batches(a)
    a.tokens = len(data) * a.batch_size * a.seq_len
    result = {
        "command": "python benchmarks/bench_online.py " + " ".join(sys.argv[1:]),
        "tokens": a.tokens,
        "d_model": a.d_model,
    }
    folder = Path(tempfile.mkdtemp(prefix="bench-online-", dir=a.dir))
    try:
        if a.only in (None, "read"):
            result["read"] = r = read_side(a, folder, model, data)
            save("online", result)
            print(
                f"consumer / offline epoch: {r['consumer_over_offline']:.2f}x (tokens/s, median of {a.repeats})",
                flush=True,
            )
        if a.only in (None, "write"):
            result["write"] = w = write_side(a, folder, model, data)
            path = save("online", result)
            print(
                f"writer spooled (budget {w['budget_bytes'] / 1e6:.0f} MB of {w['capture_bytes'] / 1e6:.0f} MB, two consumers) "
                f"/ plain: {w['spooled_over_plain']:.2f}x; plain followed by two plain follow streams / plain: "
                f"{w['followed_over_plain']:.2f}x; spooled / plain followed: {w['spooled_over_followed']:.2f}x",
                flush=True,
            )
            print(f"-> {path}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
