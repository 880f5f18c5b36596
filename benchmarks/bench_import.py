"""Import and aligned-stream benchmark (issue 25), each a ratio against a baseline in the same run.

- import-activault vs its own library's read plus a raw write of the same bytes: every
  megabatch `torch.load(weights_only=True)`-ed and its states and input ids written to one
  raw file (no fsync on either side; a syncfs and a rest before each timed step).
- import-saelens vs `datasets.load_from_disk` read in record batches as numpy plus a raw
  write of the same bytes.
- An aligned TokenStream of k layers vs k independent single-layer TokenStreams over the
  same layers, one epoch each (warm page cache): vectors per second, aligned / independent.

Ratios: baseline time / import time (>= 0.7 is the target) and independent time / aligned
time (>= 0.8). Steps alternate --repeats times; the median of the adjacent pairs' ratios.

Run: .venv/bin/python benchmarks/bench_import.py [--files 6] [--seqs 64] [--seq-len 256] [--d-model 512] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

import actstore  # noqa: E402
from actstore.importers import import_activault, import_saelens  # noqa: E402
from actstore.saelens import export_saelens  # noqa: E402
from actstore.storage.durable import syncfs  # noqa: E402
from actstore.torch import TokenStream  # noqa: E402


def write_activault(hook: Path, files: int, seqs: int, T: int, d: int) -> int:
    hook.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    size = 0
    for k in range(files):
        states = torch.randn(seqs, T, d, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 50_000, (seqs, T), generator=g)
        buf = io.BytesIO()
        torch.save({"states": states, "input_ids": ids, "tensor_bytes": states.numel() * 2 + ids.numel() * 8}, buf)
        (hook / f"{k:08x}-0000--{k + 1}_0.saved.pt").write_bytes(buf.getvalue())
        size = len(buf.getvalue())
    (hook / "metadata.json").write_text(
        json.dumps(
            {
                "batch_size": seqs,
                "sequence_length": T,
                "dtype": "torch.bfloat16",
                "d_in": d,
                "batches_per_file": 1,
                "shape": [seqs, T, d],
                "input_ids_shape": [seqs, T],
                "bytes_per_file": size,
            }
        )
    )
    return files * seqs * T


def baseline_activault(hook: Path, out: Path) -> None:
    with open(out, "wb") as f:
        for p in sorted(hook.glob("*.pt")):
            obj = torch.load(p, weights_only=True, map_location="cpu")
            f.write(obj["states"].view(torch.int16).numpy().tobytes())
            f.write(obj["input_ids"].to(torch.int32).numpy().tobytes())


def baseline_saelens(src: Path, out: Path, hook: str) -> None:
    import datasets

    ds = datasets.load_from_disk(str(src)).with_format("numpy")
    with open(out, "wb") as f:
        for i in range(0, len(ds), 256):
            rows = ds[i : i + 256]
            f.write(np.ascontiguousarray(rows[hook]).tobytes())
            f.write(np.ascontiguousarray(rows["token_ids"]).tobytes())


def pairs(root: Path, repeats: int, a, b) -> tuple[list[float], list[float]]:
    ta, tb = [], []

    def timed(fn, acc, r):
        syncfs(root)
        time.sleep(0.5)
        t0 = time.perf_counter()
        fn(r)
        acc.append(time.perf_counter() - t0)

    for r in range(repeats):
        for fn, acc in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            timed(fn, acc, r)
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=6)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3, help="k, the aligned stream's layers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-import-", dir=args.dir))
    res: dict = {}
    try:
        # ---- Activault ----
        hook = root / "run" / "models.layers.4.mlp"
        n_tok = write_activault(hook, args.files, args.seqs, args.seq_len, args.d_model)
        import_activault(hook, root / "warm.store", progress=False)  # imports, first-touch
        shutil.rmtree(root / "warm.store")
        imp, base = pairs(
            root,
            args.repeats,
            lambda r: import_activault(hook, root / f"a{r}.store", progress=False),
            lambda r: baseline_activault(hook, root / f"raw{r}.bin"),
        )
        res["activault"] = {
            "tokens": n_tok,
            "import_s": imp,
            "baseline_s": base,
            "ratio": statistics.median(b / i for i, b in zip(imp, base)),
        }
        # ---- SAELens ----
        st = actstore.ActStore(root / "a0.store")
        export_saelens(st, root / "sl", layer=4, context_size=args.seq_len, progress=False)
        import_saelens(root / "sl", root / "warm2.store", progress=False)
        shutil.rmtree(root / "warm2.store")
        hook_name = json.loads((root / "sl" / "saelens_config.json").read_text())["hook_name"]
        imp, base = pairs(
            root,
            args.repeats,
            lambda r: import_saelens(root / "sl", root / f"s{r}.store", progress=False),
            lambda r: baseline_saelens(root / "sl", root / f"sraw{r}.bin", hook_name),
        )
        res["saelens"] = {
            "tokens": n_tok,
            "import_s": imp,
            "baseline_s": base,
            "ratio": statistics.median(b / i for i, b in zip(imp, base)),
        }
        # ---- aligned stream ----
        k = args.layers
        rng = np.random.default_rng(0)
        n_ex = max(8, n_tok // args.seq_len)
        with actstore.ShardWriter(
            root / "k.store", layers=list(range(k)), d_model=args.d_model, tokens=args.seq_len // 2
        ) as w:
            for s in range(0, n_ex, 16):
                w.append(
                    rng.standard_normal((min(16, n_ex - s), k, args.seq_len // 2, args.d_model)).astype(np.float16)
                )
        actstore.finalize(root / "k.store")
        ks = actstore.ActStore(root / "k.store")

        def aligned(_r: int) -> None:
            for _ in TokenStream.aligned(ks, layers=list(range(k)), batch_size=4096, seed=0, threads=4):
                pass

        def independent(_r: int) -> None:
            for layer in range(k):
                for _ in TokenStream(ks, layers=[layer], batch_size=4096, seed=0, threads=4):
                    pass

        aligned(0)  # warm page cache
        ta, ti = pairs(root, args.repeats, aligned, independent)
        res["aligned"] = {
            "layers": k,
            "vectors": len(ks) * (args.seq_len // 2) * k,
            "aligned_s": ta,
            "independent_s": ti,
            "ratio": statistics.median(i / a for a, i in zip(ta, ti)),
        }
        for name in ("activault", "saelens"):
            r = res[name]
            print(
                f"import-{name}: {r['tokens']:,} tokens x {args.d_model}: import {statistics.median(r['import_s']):.2f} s, "
                f"baseline {statistics.median(r['baseline_s']):.2f} s, ratio (baseline / import) {r['ratio']:.2f}x"
            )
        r = res["aligned"]
        print(
            f"aligned stream of {k} layers: {statistics.median(r['aligned_s']):.2f} s, {k} independent streams "
            f"{statistics.median(r['independent_s']):.2f} s, ratio (independent / aligned) {r['ratio']:.2f}x"
        )
        print(f"results: {save('import', res)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
