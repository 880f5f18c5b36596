"""Benchmark: saev export throughput against a plain sequential write of the same float32
bytes, measured in the same run, and the exporter's peak RSS.

    .venv/bin/python benchmarks/bench_export.py --gb 3 --budget 100000

Builds a float16 ViT-like store (T=257 tokens, d_model=768, 2 layers) of about --gb GB,
then alternates, --repeat times: (a) write the export's float32 byte count to one file
with os.write from a 16 MiB buffer and fsync it; (b) `export_saev` in a fresh process
(which also reads the store, converts it, writes sparse-padded shards and fsyncs each).
Both time from the first byte to durable data; os.sync() runs before each. The export
process reports its own peak RSS (VmHWM). Prints a markdown table and a JSON line, and
writes bench-results/export.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402

CHILD = r"""
import json, resource, sys, time
from actstore.saev import export_saev
store, dump, budget, workers, fsync = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
r0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
res = export_saev(store, dump, patches_per_shard=budget, workers=workers, fsync=fsync, progress=sys.stderr.isatty())
dt = time.perf_counter() - t
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": dt, "cpu": cpu, "bytes": res.nbytes, "n_shards": res.n_shards, "peak_rss": hwm, "path": str(res.path)}))
"""


def build_store(path: Path, gb: float, tokens: int, d_model: int, layers: int) -> int:
    from tqdm import tqdm

    import actstore

    ex_bytes = layers * tokens * d_model * 2
    n = max(1, int(gb * 1e9 // ex_bytes))
    batch = 64
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, layers, tokens, d_model), dtype=np.float32).astype(np.float16)
    with actstore.ShardWriter(
        path,
        layers=list(range(6, 6 + layers)),
        d_model=d_model,
        tokens=tokens,
        model_id="facebook/dinov2-base",
        attrs={"cls_token": True, "dataset": "/datasets/bench"},
    ) as w:
        with tqdm(total=n, unit="ex", desc="build store") as bar:
            done = 0
            while done < n:
                b = min(batch, n - done)
                w.append(x[:b])
                done += b
                bar.update(b)
    actstore.finalize(path)
    return n


def plain_write(path: Path, nbytes: int, *, fsync: bool = True) -> tuple[float, float]:
    """(seconds, CPU seconds) to write `nbytes` to a new file sequentially (and fsync it)."""
    buf = memoryview(np.ones(16 * 2**20 // 4, dtype=np.float32)).cast("B")
    os.sync()  # start from a clean page cache state: earlier runs' dirty pages written
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left:
        left -= os.write(fd, buf[: min(len(buf), left)])
    if fsync:
        os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    path.unlink()
    return dt, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def export_once(store: Path, dump: Path, budget: int, workers: int, *, fsync: bool = True) -> dict:
    os.sync()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(store), str(dump), str(budget), str(workers), str(int(fsync))],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    shutil.rmtree(dump)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=3.0, help="store size in GB (float16)")
    ap.add_argument("--budget", type=int, default=100_000, help="patches_per_shard (small: many shards)")
    ap.add_argument("--tokens", type=int, default=257)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.dir))
    try:
        store = work / "store"
        n = build_store(store, args.gb, args.tokens, args.d_model, args.layers)
        nbytes = n * args.layers * args.tokens * args.d_model * 4
        plain, cached, exports, exports_nf, plain_cpu = [], [], [], [], []
        for _ in range(args.repeat):
            dt, cpu = plain_write(work / "plain.bin", nbytes)
            plain.append(nbytes / dt)
            plain_cpu.append(cpu)
            exports.append(export_once(store, work / "dump", args.budget, args.workers))
            dt, cpu = plain_write(work / "plain.bin", nbytes, fsync=False)
            cached.append(nbytes / dt)
            plain_cpu.append(cpu)
            exports_nf.append(export_once(store, work / "dump", args.budget, args.workers, fsync=False))
        exp_rates = [e["bytes"] / e["seconds"] for e in exports]
        nf_rates = [e["bytes"] / e["seconds"] for e in exports_nf]
        ratio = statistics.median(exp_rates) / statistics.median(plain)
        peak = max(e["peak_rss"] for e in exports + exports_nf)
        result = {
            "store_gb": round(n * args.layers * args.tokens * args.d_model * 2 / 1e9, 2),
            "n_examples": n,
            "export_gb": round(nbytes / 1e9, 2),
            "n_shards": exports[0]["n_shards"],
            "budget": args.budget,
            "plain_write_gbps": [round(r / 1e9, 3) for r in plain],
            "export_gbps": [round(r / 1e9, 3) for r in exp_rates],
            "plain_write_no_fsync_gbps": [round(r / 1e9, 3) for r in cached],
            "export_no_fsync_gbps": [round(r / 1e9, 3) for r in nf_rates],
            "ratio": round(ratio, 3),
            "ratio_no_fsync": round(statistics.median(nf_rates) / statistics.median(cached), 3),
            "plain_cpu_s_per_gb": round(statistics.median(plain_cpu) / (nbytes / 1e9), 3),
            "export_cpu_s_per_gb": round(statistics.median(e["cpu"] for e in exports + exports_nf) / (nbytes / 1e9), 3),
            "load_average": os.getloadavg()[0],
            "peak_rss_mib": round(peak / 2**20, 1),
            "workers": args.workers,
        }
        print("| measure | value |\n|---|---|")
        print(
            f"| store (float16) | {result['store_gb']} GB, {n} examples x {args.layers} layers x {args.tokens} tokens x {args.d_model} |"
        )
        print(
            f"| export (float32) | {result['export_gb']} GB in {result['n_shards']} shards (patches_per_shard {args.budget}) |"
        )
        print(f"| plain sequential write + fsync | {', '.join(f'{r:.3f}' for r in result['plain_write_gbps'])} GB/s |")
        print(
            f"| export_saev (read + convert + write + fsync) | {', '.join(f'{r:.3f}' for r in result['export_gbps'])} GB/s |"
        )
        print(f"| export / plain write, both with fsync (medians) | {result['ratio']:.2f}x |")
        print(
            f"| plain sequential write, no fsync | {', '.join(f'{r:.3f}' for r in result['plain_write_no_fsync_gbps'])} GB/s |"
        )
        print(f"| export_saev --no-fsync | {', '.join(f'{r:.3f}' for r in result['export_no_fsync_gbps'])} GB/s |")
        print(f"| export / plain write, both without fsync (medians) | {result['ratio_no_fsync']:.2f}x |")
        print(
            f"| CPU seconds per GB written: plain write / export (medians) | {result['plain_cpu_s_per_gb']} / {result['export_cpu_s_per_gb']} |"
        )
        print(f"| export peak RSS | {result['peak_rss_mib']} MiB |")
        print(f"| load average at the end | {result['load_average']:.1f} |")
        print(json.dumps(result))
        print(f"wrote {save('export', result)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
