"""Scale benchmark (issue 26): what each store-wide operation costs as a store grows in
writer shards and in examples, in seconds and in object-store requests.

Stores of tiny activations (1 layer, 4 tokens, d_model 8), so that the cost measured is
the per-shard and per-example bookkeeping, not moving data:
- shards: stores of 1, 100, 1,000 (and, given --shards, 10,000) writer shards of a few
  examples each. One shard is written by a ShardWriter; the others are byte copies of it
  with their shard number rewritten (a writer per shard would spend the run writing);
- examples: one writer shard of 10^4 .. 10^6 (10^7 with --examples) examples, written.

Times, for each store: finalize, open (ActStore), info, verify (fast and deep), cp to a
local folder, export-saev's plan, TokenStream's plan and its first batch. The figure of
merit is the cost per shard (per example) at the largest size against the same at 100
shards (10^4 examples): linear operations stay near 1x.

Requests: the same operations on moto's S3 server (tests/s3server.py, in this process on
127.0.0.1) behind a counting proxy (tests/faultproxy.py with no faults), for stores of
--s3-shards writer shards, and the requests of one ShardWriter writing a one-commit shard.

Run: .venv/bin/python benchmarks/bench_scale.py [--shards 1,100,1000,10000] [--plot out.png]
Figures come from one run on one machine; docs/benchmarks.md shows them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import save  # noqa: E402

LAYERS, TOKENS, D_MODEL = [0], 4, 8
OPS = ("finalize", "open", "info", "verify", "verify_deep", "cp", "saev_plan", "token_plan", "token_first_batch")


def _writer_kw(a: argparse.Namespace, examples: int) -> dict:
    kw = {
        "layers": LAYERS,
        "d_model": D_MODEL,
        "tokens": TOKENS,
        "model_id": "bench/tiny",
        "attrs": {"dataset": "/bench/data", "cls_token": False, "family": "dinov2"},
        "fields": {"label": "int64"},
    }
    if a.zarr_format == 3:
        kw.update(zarr_format=3, shard_examples=min(examples, a.shard_examples))
    elif a.zarr_format == 2:
        kw.update(zarr_format=2)
    return kw


def write_shard(path: str, shard: int, n: int, a: argparse.Namespace, batch: int = 65536) -> float:
    """One writer shard of n tiny examples; returns the seconds it took."""
    import actstore

    rng = np.random.default_rng(shard)
    t0 = time.perf_counter()
    with actstore.ShardWriter(path, shard=shard, **_writer_kw(a, n)) as w:
        for i in range(0, n, batch):
            b = min(batch, n - i)
            w.append(
                rng.standard_normal((b, len(LAYERS), TOKENS, D_MODEL)).astype(np.float16),
                fields={"label": np.arange(i, i + b)},
            )
    return time.perf_counter() - t0


def clone_shards(root: Path, n_shards: int) -> None:
    """Shards 1..n-1 as byte copies of shard 0, with the shard number in their records rewritten."""
    from actstore.layout import keys

    src = root / keys.shard_prefix(0)
    for s in range(1, n_shards):
        dst = root / keys.shard_prefix(s)
        shutil.copytree(src, dst)
        for rel in ("meta/commit.json", ".zattrs", ".zmetadata", "zarr.json"):
            f = dst / rel
            if not f.exists():
                continue
            doc = json.loads(f.read_text())
            _renumber(doc, s)
            f.write_text(json.dumps(doc))


def _renumber(doc: dict, s: int) -> None:
    """Set the shard number a shard's records hold: the commit record's `shard`, the root
    attributes' `actstore.shard` (format 2 `.zattrs`, in `.zmetadata` too; format 3 `zarr.json`)."""
    if isinstance(doc.get("shard"), int):
        doc["shard"] = s
    for v in doc.values():
        if isinstance(v, dict):
            if isinstance(v.get("actstore"), dict) and "shard" in v["actstore"]:
                v["actstore"]["shard"] = s
            else:
                _renumber(v, s)


def operations(url: str, work: str) -> dict[str, Callable[[], object]]:
    """Each measured operation on the finalized store at `url` (cp writes under `work`)."""
    import actstore
    from actstore.copy import copy_store
    from actstore.read.info import store_info
    from actstore.saev.plan import make_plan
    from actstore.torch import TokenStream
    from actstore.verify import verify_store

    def cp() -> object:
        dst = os.path.join(work, "cp")
        shutil.rmtree(dst, ignore_errors=True)
        r = copy_store(url, dst, verify=False)
        shutil.rmtree(dst, ignore_errors=True)
        return r

    def token_first_batch() -> object:
        ts = TokenStream(actstore.ActStore(url), batch_size=64, seed=0, threads=1)
        it = iter(ts)
        b = next(it)
        del it
        ts.discard_read_ahead()
        return b

    return {
        "finalize": lambda: actstore.finalize(url),
        "open": lambda: actstore.ActStore(url),
        "info": lambda: store_info(url),
        "verify": lambda: _ok(verify_store(url)),
        "verify_deep": lambda: _ok(verify_store(url, deep=True)),
        "cp": cp,
        "saev_plan": lambda: make_plan(actstore.ActStore(url)),
        "token_plan": lambda: TokenStream(actstore.ActStore(url), batch_size=64, seed=0, threads=1).plan(0),
        "token_first_batch": token_first_batch,
    }


def _ok(report: object) -> object:
    if not report.ok:  # type: ignore[attr-defined]
        raise RuntimeError(f"the benchmark's store fails verification: {report}")
    return report


def time_ops(url: str, work: str, ops: tuple[str, ...], repeats: int) -> dict[str, float]:
    fns = operations(url, work)
    out = {}
    for name in ops:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fns[name]()
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    return out


def shard_scaling(a: argparse.Namespace, work: Path) -> list[dict]:
    rows = []
    for n in a.shards:
        root = work / f"shards-{n}"
        shutil.rmtree(root, ignore_errors=True)
        write_shard(str(root), 0, a.shard_size, a)
        t0 = time.perf_counter()
        clone_shards(root, n)
        build = time.perf_counter() - t0
        times = time_ops(str(root), str(work), a.ops, a.repeats)
        rows.append({"shards": n, "examples": n * a.shard_size, "build_s": build, "seconds": times})
        print(f"{n:>6} shards: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    return rows


def example_scaling(a: argparse.Namespace, work: Path) -> list[dict]:
    rows = []
    for n in a.examples:
        root = work / f"examples-{n}"
        shutil.rmtree(root, ignore_errors=True)
        write_s = write_shard(str(root), 0, n, a)
        times = time_ops(str(root), str(work), a.ops, a.repeats)
        rows.append({"examples": n, "write_s": write_s, "seconds": times})
        print(
            f"{n:>9} examples: write {write_s:.2f} s  " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()),
            flush=True,
        )
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _count(proxy: object, since: int) -> dict:
    reqs = proxy.requests[since:]  # type: ignore[attr-defined]
    by = collections.Counter(m for m, _ in reqs)
    return {"total": len(reqs), **dict(sorted(by.items()))}


def request_counts(a: argparse.Namespace, work: Path) -> dict:
    """Requests per operation on moto (through a counting proxy), per store size."""
    import s3server
    from faultproxy import FaultProxy

    out: dict = {"stores": []}
    with s3server.moto_server() as endpoint, FaultProxy(endpoint, fail=0, drop_request=0, drop_response=0) as proxy:
        old = s3server.apply_env(s3server.s3_env(proxy.url))
        try:
            bucket = s3server.create_bucket(endpoint)
            n0 = len(proxy.requests)
            write_shard(f"s3://{bucket}/writer", 0, a.shard_size, a)
            out["writer_one_commit"] = _count(proxy, n0)
            print(f"one-commit writer shard on S3: {out['writer_one_commit']}", flush=True)
            for n in a.s3_shards:
                root = work / f"s3src-{n}"
                shutil.rmtree(root, ignore_errors=True)
                write_shard(str(root), 0, a.shard_size, a)
                clone_shards(root, n)
                import actstore
                from actstore.copy import copy_store

                actstore.finalize(str(root))
                url = f"s3://{bucket}/store-{n}"
                n0 = len(proxy.requests)
                copy_store(str(root), url, verify=False)
                row = {"shards": n, "upload": _count(proxy, n0)}
                fns = operations(url, str(work))
                for name in a.ops:
                    n0 = len(proxy.requests)
                    fns[name]()
                    row[name] = _count(proxy, n0)
                out["stores"].append(row)
                print(
                    f"{n:>6} shards on S3, requests: "
                    + "  ".join(f"{k} {row[k]['total']}" for k in ("upload", *a.ops)),
                    flush=True,
                )
                shutil.rmtree(root, ignore_errors=True)
        finally:
            s3server.restore_env(old)
    return out


def growth(rows: list[dict], unit: str, base: int) -> dict[str, float]:
    """Cost per unit at the largest size over cost per unit at `base` (1.0: linear)."""
    by = {r[unit]: r for r in rows}
    if base not in by or len(by) < 2:
        return {}
    top = max(by)
    return {op: (by[top]["seconds"][op] / top) / (by[base]["seconds"][op] / base) for op in by[top]["seconds"]}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, unit, label in (
        (axes[0], "shard_rows", "shards", "writer shards"),
        (axes[1], "example_rows", "examples", "examples"),
    ):
        rows = result.get(key) or []
        if not rows:
            continue
        xs = [r[unit] for r in rows]
        for op in rows[0]["seconds"]:
            ax.loglog(xs, [r["seconds"][op] for r in rows], marker="o", label=op)
        ax.loglog(xs, [max(rows[0]["seconds"].values()) * x / xs[0] for x in xs], "k:", label="linear")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("actstore: cost of store-wide operations against store size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=ints, default=[1, 100, 1000])
    ap.add_argument("--shard-size", type=int, default=4, help="examples per writer shard in the shard-scaling stores")
    ap.add_argument("--examples", type=ints, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--s3-shards", type=ints, default=[1, 10, 100])
    ap.add_argument(
        "--zarr-format", type=int, choices=(2, 3), default=None, help="the layout (default: the writer's default)"
    )
    ap.add_argument(
        "--shard-examples", type=int, default=65536, help="examples per Zarr shard file with --zarr-format 3"
    )
    ap.add_argument(
        "--ops",
        type=lambda s: tuple(x for x in s.split(",") if x),
        default=OPS,
        help=f"operations timed, of {','.join(OPS)}",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where stores are built (default: a temporary folder)")
    ap.add_argument("--plot", default=None, help="write a log-log plot (PNG) here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=a.dir))
    try:
        result: dict = {
            "shape": {"layers": len(LAYERS), "tokens": TOKENS, "d_model": D_MODEL, "shard_size": a.shard_size},
            "zarr_format": a.zarr_format,
        }
        result["shard_rows"] = shard_scaling(a, work) if a.shards else []
        result["example_rows"] = example_scaling(a, work) if a.examples else []
        result["growth_per_shard"] = growth(
            result["shard_rows"], "shards", 100 if 100 in a.shards else min(a.shards or [1])
        )
        result["growth_per_example"] = growth(result["example_rows"], "examples", min(a.examples or [1]))
        result["requests"] = request_counts(a, work) if a.s3_shards else {}
        for k in ("growth_per_shard", "growth_per_example"):
            print(k, {op: round(v, 2) for op, v in result[k].items()})
        if a.plot:
            plot(result, a.plot)
        print("wrote", save("scale", result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
