"""A real prompt/response data set for the logger spec's open questions (issue 27).

Builds --examples prompts from Python's own help topics (`pydoc_data.topics`, shipped with
Python): for each topic a short question about it and questions about paragraphs of its
text (so prompt lengths range from a line to a page, as in real QA logs), then
`actstore write` lets the embedded SmolLM2-135M-Instruct answer each one greedily
(`--chat-template --generate N`) and stores prompt and response activations with no
prompt truncation (budget = the longest prompt) and a response budget of N. The store's
true lengths give the answers docs/spec-answers.md reports: the length distributions
(median/p95/p99), what each truncation policy (fixed constants or quantiles) loses and
pads, and how many answers the generation cap cut. Results: bench-results/spec-data.json
(and the lengths, for `bench_spec.py --lengths`).

Run: .venv/bin/python benchmarks/spec_data.py [--examples 240] [--generate 128] [--dir DIR]
     [--model embedded:smollm2-135m] [--analyse STORE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

SHORT = "What does the Python `{topic}` topic cover? Answer briefly."
ABOUT = "Here is a passage from the Python language reference:\n\n{para}\n\nIn one or two sentences, what does it say?"
FIXED_P = (64, 128, 256, 512)
FIXED_R = (32, 64, 128)
QUANTILES = (0.9, 0.95, 0.99, 1.0)


def build_prompts(n: int, seed: int = 0) -> list[dict]:
    """Up to n deterministic prompts: a short question per topic, then paragraph questions."""
    from actstore.inputs.embedded import pydoc_topics

    rng = np.random.default_rng(seed)
    topics = pydoc_topics()
    short = [{"id": f"{t}/q", "prompt": SHORT.format(topic=t)} for t, _ in topics]
    paras = []
    for t, text in topics:
        ps = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 40]
        for j in rng.permutation(len(ps))[:3].tolist():
            paras.append({"id": f"{t}/p{j}", "prompt": ABOUT.format(para=ps[j])})
    rng.shuffle(paras)
    out = short[: max(1, n // 3)] + paras
    return sorted(out[:n], key=lambda r: r["id"])


def quantiles(x: np.ndarray) -> dict:
    return {
        "n": int(len(x)),
        "min": int(x.min()),
        "mean": float(x.mean()),
        "p50": float(np.quantile(x, 0.5)),
        "p90": float(np.quantile(x, 0.9)),
        "p95": float(np.quantile(x, 0.95)),
        "p99": float(np.quantile(x, 0.99)),
        "max": int(x.max()),
    }


def policy(x: np.ndarray, budget: int) -> dict:
    """What a budget of `budget` tokens keeps, loses and pads on lengths x."""
    kept = np.minimum(x, budget)
    return {
        "budget": int(budget),
        "truncated_examples": int((x > budget).sum()),
        "truncated_fraction": float((x > budget).mean()),
        "lost_tokens_fraction": float(1 - kept.sum() / x.sum()),
        "padding_fraction": float(1 - kept.sum() / (budget * len(x))),
    }


def policies(x: np.ndarray, fixed: tuple[int, ...]) -> list[dict]:
    rows = [{"policy": f"fixed {b}", **policy(x, b)} for b in fixed]
    rows += [{"policy": f"quantile {q}", **policy(x, int(np.quantile(x, q, method="higher")))} for q in QUANTILES]
    return rows


def loops(text: str, n: int = 6, times: int = 3) -> bool:
    """True when some run of n words repeats at least `times` times (a greedy decoding loop)."""
    w = text.split()
    grams = Counter(" ".join(w[i : i + n]) for i in range(len(w) - n + 1))
    return bool(grams) and grams.most_common(1)[0][1] >= times


def analyse(store_path: Path, generate: int) -> dict:
    """Length distributions and truncation policies from a prompt/response store."""
    import actstore

    store = actstore.ActStore(store_path)
    p = np.asarray(store.segment("prompt").lengths(), np.int64)
    r = np.asarray(store.segment("response").lengths(), np.int64)
    seg = store.meta["segments"]
    capped = r >= generate if generate else np.zeros(len(r), bool)
    looping = np.asarray([loops(t) for t in store.texts("response")], bool)
    # The prompt budget was the longest prompt, so no prompt was cut; a response of exactly
    # `generate` tokens without EOS was cut by generation (its true length is unknown).
    return {
        "n_examples": len(store),
        "model_id": store.meta["model_id"],
        "d_model": store.d_model,
        "p_max_stored": seg["prompt"]["t_max"],
        "r_max_stored": seg["response"]["t_max"],
        "generate": generate,
        "responses_at_generation_cap": int(capped.sum()) if generate else None,
        "capped_responses_looping": int((capped & looping).sum()),
        "other_responses_looping": int((~capped & looping).sum()),
        "prompt_len": quantiles(p),
        "response_len": quantiles(r),
        "total_len": quantiles(p + r),
        "prompt_policies": policies(p, FIXED_P),
        "response_policies": policies(r, FIXED_R),
        "lengths": {"prompt": p.tolist(), "response": r.tolist()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=240)
    ap.add_argument("--generate", type=int, default=128, help="Response budget: greedy answers of up to N tokens.")
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--layers", default="0,15,29", help="Model layers stored (the lengths do not depend on them).")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dir", default=None, help="Scratch folder (default: a temporary folder).")
    ap.add_argument("--keep", default=None, help="Keep the store here instead of deleting it.")
    ap.add_argument("--analyse", default=None, help="Only analyse an existing prompt/response STORE.")
    a = ap.parse_args()
    if a.analyse:
        res = analyse(Path(a.analyse), a.generate)
        print(f"results: {save('spec-data', res)}")
        return
    from actstore.capture import CaptureOptions, write

    scratch = Path(tempfile.mkdtemp(prefix="spec-data-", dir=a.dir))
    try:
        data = scratch / "prompts.jsonl"
        prompts = build_prompts(a.examples)
        data.write_text("".join(json.dumps(r) + "\n" for r in prompts))
        out = Path(a.keep) if a.keep else scratch / "qa.store"
        t0 = time.perf_counter()
        s = write(
            CaptureOptions(
                store=str(out),
                model=a.model,
                data=str(data),
                layers=tuple(int(x) for x in a.layers.split(",")),
                batch_size=a.batch_size,
                chat_template=True,
                generate=a.generate,
                p_quantile=1.0,
                r_max=a.generate,
            )
        )
        res = analyse(out, a.generate)
        res.update(
            {
                "capture_seconds": time.perf_counter() - t0,
                "prompt_source": "pydoc_data.topics (short questions + paragraph questions)",
                "write_summary": {k: v for k, v in s.items() if isinstance(v, (int, float, str))},
                "load_average": os.getloadavg(),
            }
        )
        pl, rl = res["prompt_len"], res["response_len"]
        print(
            f"{res['n_examples']} examples in {res['capture_seconds']:.0f} s; prompt tokens p50 {pl['p50']:.0f} p95 {pl['p95']:.0f} "
            f"p99 {pl['p99']:.0f} max {pl['max']}; response p50 {rl['p50']:.0f} p95 {rl['p95']:.0f} p99 {rl['p99']:.0f} max {rl['max']} "
            f"({res['responses_at_generation_cap']} at the cap of {a.generate})"
        )
        print(f"results: {save('spec-data', res)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
