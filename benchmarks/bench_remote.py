"""Object-storage benchmark (issue 13): a store on S3 against plain obstore on the same bytes.

moto's S3 server runs in this process on 127.0.0.1; every client runs in a child process
(moto holds the GIL of the process it runs in). Figures, each a ratio within one run:
- upload: ShardWriter to s3:// (Zarr shard files uploaded whole, in the background) vs
  plain `obstore.put` of the same bytes as objects of the same sizes (8 in flight);
- random (example, layer) reads, p50: ActStore over the URL vs a plain range GET of the
  same bytes;
- TokenStream over the URL (float16; the first epoch of a fresh process, and the next)
  vs a plain sequential GET of the store's activation objects in the same process, in
  the default order and with runs of one shard file (run_bytes).

Run: .venv/bin/python benchmarks/bench_remote.py [--examples N] [--shard-examples S]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import s3server  # noqa: E402  (tests/s3server.py: moto's server on 127.0.0.1)
from common import add_store_shape_args, save  # noqa: E402


def _write_store(url: str, a: argparse.Namespace) -> float:
    import actstore

    rng = np.random.default_rng(0)
    batch = rng.standard_normal((a.batch, a.layers, a.tokens, a.d_model)).astype(np.float16)
    t0 = time.perf_counter()
    with actstore.ShardWriter(
        url,
        layers=list(range(a.layers)),
        d_model=a.d_model,
        tokens=a.tokens,
        zarr_format=3,
        shard_examples=a.shard_examples,
    ) as w:
        for _ in range(a.examples // a.batch):
            w.append(batch)
    actstore.finalize(url)
    return time.perf_counter() - t0


def _plain_puts(url: str, sizes: list[int]) -> float:
    from concurrent.futures import ThreadPoolExecutor

    import obstore
    from obstore.store import from_url

    store = from_url(url)
    blob = np.random.default_rng(1).bytes(max(sizes))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: obstore.put(store, f"plain/{i}", blob[: sizes[i]]), range(len(sizes))))
    return time.perf_counter() - t0


def _random_reads(url: str, a: argparse.Namespace) -> dict:
    import obstore

    import actstore
    from actstore.storage import open_storage

    st = actstore.ActStore(url)
    rng = np.random.default_rng(2)
    n = len(st)
    qs = [(int(rng.integers(n)), int(rng.integers(a.layers))) for _ in range(a.queries)]
    for ex, layer in qs[:20]:  # warm the shard-file indexes, as a long-running reader has them
        st[ex, layer]
    t_store = []
    for ex, layer in qs:
        t0 = time.perf_counter()
        st[ex, layer]
        t_store.append(time.perf_counter() - t0)
    # The same bytes by plain range GETs: the offset of (ex, layer) inside its shard file.
    storage = open_storage(url)
    shard = storage.child("shards/shard-00000.zarr")
    S, nb = a.shard_examples, a.tokens * a.d_model * 2
    t_plain = []
    for ex, layer in qs:
        key = f"arrays/tokens_activations/c/{ex // S}/0/0/0"
        off = ((ex % S) * a.layers + layer) * nb
        t0 = time.perf_counter()
        obstore.get_range(shard.store, key, start=off, length=nb)
        t_plain.append(time.perf_counter() - t0)
    return {"store_p50_ms": 1e3 * float(np.median(t_store)), "plain_p50_ms": 1e3 * float(np.median(t_plain))}


def _stream(url: str, a: argparse.Namespace, run_bytes: int) -> dict:
    """In a fresh process: a plain sequential GET of every activation object, then two
    epochs of one TokenStream (the first also reads each shard file's index)."""
    import obstore

    import actstore
    from actstore.storage import open_storage
    from actstore.torch import TokenStream

    shard = open_storage(url).child("shards/shard-00000.zarr")
    keys = sorted(e.key for e in shard.list("arrays/tokens_activations/c"))
    t0 = time.perf_counter()
    nbytes = sum(len(obstore.get(shard.store, k).bytes()) for k in keys)
    t_plain = time.perf_counter() - t0
    ts = TokenStream(actstore.ActStore(url), batch_size=4096, seed=0, threads=a.threads, run_bytes=run_bytes)
    t_epochs = []
    for _ in range(2):
        t0 = time.perf_counter()
        n_tokens = sum(len(b) for b in ts)
        t_epochs.append(time.perf_counter() - t0)
        ts.discard_read_ahead()  # the next epoch reads its first window itself, timed
    return {"tokens": n_tokens, "epoch_s": t_epochs, "plain_get_s": t_plain, "bytes": nbytes}


def _stream_ratios(runs: list[dict]) -> dict:
    """Medians over the runs of each epoch's ratio to the plain GET measured beside it."""
    med = statistics.median
    return {
        "first_epoch_ratio": med(r["plain_get_s"] / r["epoch_s"][0] for r in runs),
        "next_epoch_ratio": med(r["plain_get_s"] / r["epoch_s"][1] for r in runs),
        "first_epoch_tokens_per_s": med(r["tokens"] / r["epoch_s"][0] for r in runs),
        "plain_mb_per_s": med(r["bytes"] / r["plain_get_s"] / 1e6 for r in runs),
        "pairs": [[round(r["plain_get_s"] / t, 3) for t in r["epoch_s"]] for r in runs],
    }


def _child(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_shape_args(ap, examples=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shard-examples", type=int, default=64)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--upload-repeats", type=int, default=5, help="interleaved (ShardWriter, plain put) upload pairs")
    ap.add_argument(
        "--threads",
        type=int,
        default=32,
        help="TokenStream reader threads (object stores want many requests in flight)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="TokenStream runs (each a fresh process beside its own plain GET)"
    )
    a = ap.parse_args()
    with s3server.moto_server() as endpoint:
        s3server.apply_env(s3server.s3_env(endpoint))
        bucket = s3server.create_bucket(endpoint)
        from actstore.storage import open_storage

        # Upload: interleaved pairs (a store written through ShardWriter, then plain puts
        # of the same object sizes), each pair sharing the moment's load; the median pair.
        writes, puts = [], []
        for r in range(a.upload_repeats):
            url = f"s3://{bucket}/bench-{r}.store"
            writes.append(_child(_write_store, url, a))
            sizes = [e.size for e in open_storage(url).list() if "/tokens_activations/c/" in e.key]
            puts.append(_child(_plain_puts, url, sizes))
            if r + 1 < a.upload_repeats:
                open_storage(url).delete_prefix("")
        pairs = sorted(zip(writes, puts), key=lambda wp: wp[1] / wp[0])
        t_write, t_put = pairs[len(pairs) // 2]
        reads = _child(_random_reads, url, a)
        file_bytes = a.shard_examples * a.layers * a.tokens * a.d_model * 2  # one shard file's units: one run
        streams = {
            name: [_child(_stream, url, a, run) for _ in range(a.repeats)]
            for name, run in (("default", 0), ("runs", file_bytes))
        }
    total = sum(sizes)
    res = {
        "store_bytes": total,
        "upload": {
            "actstore_s": t_write,
            "plain_put_s": t_put,
            "ratio": t_put / t_write,
            "pair_ratios": [round(p / w, 3) for w, p in zip(writes, puts)],
        },
        "random_read": {**reads, "ratio": reads["store_p50_ms"] / reads["plain_p50_ms"]},
        "token_stream": {name: _stream_ratios(runs) for name, runs in streams.items()},
        "load_average": os.getloadavg()[0],
    }
    print(
        f"store on moto S3: {a.examples} examples x {a.layers} layers x {a.tokens} x {a.d_model} fp16 ({total / 1e6:.0f} MB), "
        f"Zarr shard files of {a.shard_examples} examples"
    )
    print(
        f"upload (median of {a.upload_repeats} pairs {res['upload']['pair_ratios']}): actstore {total / t_write / 1e6:.0f} MB/s, "
        f"plain obstore put {total / t_put / 1e6:.0f} MB/s -> {res['upload']['ratio']:.2f}x (target >= 0.8x)"
    )
    print(
        f"random (ex, layer) read p50: actstore {reads['store_p50_ms']:.2f} ms, plain range GET {reads['plain_p50_ms']:.2f} ms "
        f"-> {res['random_read']['ratio']:.2f}x (target <= 1.5x)"
    )
    for name, d in res["token_stream"].items():
        what = "default order (run_bytes=0)" if name == "default" else "runs of one shard file (run_bytes)"
        print(
            f"TokenStream over the URL, {what}: first epoch of a process {d['first_epoch_tokens_per_s'] / 1e6:.3f}M tokens/s "
            f"({d['first_epoch_ratio']:.2f}x), next epoch {d['next_epoch_ratio']:.2f}x a plain sequential GET at "
            f"{d['plain_mb_per_s']:.0f} MB/s (medians of {a.repeats} interleaved pairs; target >= 0.7x)"
        )
    print("results:", save("remote", res))


if __name__ == "__main__":
    main()
