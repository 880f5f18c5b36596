"""What the capture-time site checks cost (actstore.capture.proof): a capture of TransformerLens
sites of one block of the embedded SmolLM2-135M, its check timed inside the same run.

The check runs once, on the first batch, before anything is stored: one forward pass of at
most 4 rows that reads every site of the recorded blocks, plus at most 2 padded rows run
alone. Its cost is fixed, so its share falls with the capture's length; this prints it for
a capture of `--batches` batches of `--batch` x `--tokens` random token ids (all rows of one
length: no padded rows) and for one with rows of several lengths.

    python benchmarks/bench_site_checks.py --batches 16 --batch 8 --tokens 256

Prints, per case: the capture's wall time, the check's, and capture / (capture - check),
the run's time against the same run without the check.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

SITES = [f"blocks.3.hook_{s}" for s in ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")]
SITES.append("blocks.3.attn.hook_z")  # 9 heads x 64 = 576 wide: the same width as the others


def run(root: Path, batches: list, lm, padded: bool) -> dict:
    import actstore
    from actstore.capture import proof

    real, spent = proof.before_capture, []

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return real(*args, **kw)
        finally:
            spent.append(time.perf_counter() - t0)

    proof.before_capture = timed
    try:
        t0 = time.perf_counter()
        actstore.record(lm, batches, root, layers=SITES)
        total = time.perf_counter() - t0
    finally:
        proof.before_capture = real
    check = sum(spent)
    return {"padded": padded, "capture_s": total, "check_s": check, "ratio": total / (total - check)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()

    import torch

    from actstore.inputs.models import load_model

    lm = load_model("embedded:smollm2-135m", torch_dtype="float32")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 40000, (args.batch, args.tokens), generator=g) for _ in range(args.batches)]
    plain = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]
    ragged = []
    for x in ids:  # rows of several lengths: the check also runs padded rows alone
        mask = torch.ones_like(x)
        mask[1, args.tokens // 2 :] = 0
        ragged.append({"input_ids": x, "attention_mask": mask})
    with tempfile.TemporaryDirectory() as d:
        for name, batches in (("one length", plain), ("several lengths", ragged)):
            out = run(Path(d) / name.replace(" ", "-"), batches, lm, name != "one length")
            print(
                f"{name:>16}: capture {out['capture_s']:.1f} s, check {out['check_s']:.2f} s, "
                f"capture / (capture - check) = {out['ratio']:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
