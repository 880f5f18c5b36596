"""export-saelens benchmark (issue 15): the export's throughput against a plain write of the
same bytes (the float32 activations as one raw file, + fsync) in the same run.

A synthetic store of --tokens real tokens (d_model --d-model, float16, two padded
segments, token ids) is exported with its layer as float32 rows of --context tokens;
the raw write writes the same number of float32 bytes. The two alternate --repeats times;
the median of the adjacent pairs' ratios is reported, after one untimed export (imports).

Run: .venv/bin/python benchmarks/bench_saelens.py [--tokens 400000] [--d-model 576] [--repeats 3] [--dir DIR] [--shard-examples S]
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

import actstore  # noqa: E402
from actstore.saelens import export_saelens  # noqa: E402
from actstore.storage.durable import syncfs  # noqa: E402


def make_store(path: Path, tokens: int, d: int, **layout) -> actstore.ActStore:
    rng = np.random.default_rng(0)
    P, R = 96, 32
    n = tokens // ((P + R) * 3 // 4)  # lengths average about 3/4 of the segments
    with actstore.ShardWriter(
        path, layers=[8], d_model=d, segments={"prompt": P, "response": R}, token_ids=True, **layout
    ) as w:
        for s in range(0, n, 64):
            b = min(64, n - s)
            w.append(
                prompt=rng.standard_normal((b, 1, P, d)).astype(np.float16),
                response=rng.standard_normal((b, 1, R, d)).astype(np.float16),
                lengths={"prompt": rng.integers(P // 2, P + 1, b), "response": rng.integers(R // 2, R + 1, b)},
                token_ids={"prompt": rng.integers(0, 49152, (b, P)), "response": rng.integers(0, 49152, (b, R))},
            )
    actstore.finalize(path)
    return actstore.ActStore(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds of rest (after a syncfs) before each timed step: this VM's disk takes a burst of about 1 GB fast, then slows until it has drained",
    )
    ap.add_argument(
        "--shard-examples",
        type=int,
        default=None,
        help="store the data in Zarr format 3 shard files of S examples (default: format 2 chunk files)",
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-saelens-", dir=args.dir))
    try:
        layout = {"zarr_format": 3, "shard_examples": args.shard_examples} if args.shard_examples else {}
        store = make_store(root / "s.store", args.tokens, args.d_model, **layout)
        n_tok = sum(sum(store.lengths(i).values()) for i in range(len(store)))
        nbytes = n_tok * args.d_model * 4
        buf = np.random.default_rng(1).standard_normal(nbytes // 4).astype(np.float32)
        # Warm up: the first export imports torch and datasets (seconds on a loaded machine),
        # a one-time cost, not the export's throughput.
        export_saelens(store, root / "warm", layer=8, context_size=args.context, progress=False)
        shutil.rmtree(root / "warm")
        exp, raw = [], []

        def settle() -> None:  # the last step's deleted files and dirty pages do not reach into the next
            syncfs(root)
            time.sleep(args.settle)

        def timed_export(r: int) -> None:
            settle()
            t0 = time.perf_counter()
            export_saelens(store, root / f"out{r}", layer=8, context_size=args.context, progress=False)
            exp.append(time.perf_counter() - t0)
            shutil.rmtree(root / f"out{r}")

        def timed_raw(r: int) -> None:
            settle()
            t0 = time.perf_counter()
            with open(root / "raw.bin", "wb", buffering=0) as f:
                f.write(memoryview(buf).cast("B"))
                os.fsync(f.fileno())
            raw.append(time.perf_counter() - t0)
            (root / "raw.bin").unlink()

        for r in range(args.repeats):  # interleaved pairs, the order alternating
            for step in (timed_export, timed_raw) if r % 2 == 0 else (timed_raw, timed_export):
                step(r)
        ratio = statistics.median(r / e for e, r in zip(exp, raw))
        print(
            f"export-saelens: {n_tok:,} tokens x {args.d_model} (float32 rows of {args.context}), {nbytes / 2**20:.0f} MiB, "
            f"store {'shard files of %d examples' % args.shard_examples if args.shard_examples else 'chunk files (format 2)'}"
        )
        print(
            f"  export {statistics.median(exp):.2f} s ({n_tok / statistics.median(exp) / 1e6:.2f} M tokens/s), "
            f"raw write + fsync {statistics.median(raw):.2f} s"
        )
        print(f"  ratio (raw time / export time, median of pairs): {ratio:.2f}x")
        print(
            f"results: {save('saelens', {'tokens': n_tok, 'bytes': nbytes, 'export_s': exp, 'raw_s': raw, 'ratio': ratio})}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
