"""Every benchmark script runs to its end on a tiny input and writes its results file
with the sizes it was given (the figures themselves are measured on a quiet machine,
never asserted here: docs/benchmarks.md). A benchmark that no longer runs against the
current API fails here instead of on the next measurement campaign."""

from __future__ import annotations

import json
import os
from pathlib import Path

import forked
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
]  # every benchmark script in a subprocess; they capture and stream with torch

ROOT = Path(__file__).resolve().parents[1]


def run_bench(name: str, args: list[str], tmp_path: Path, timeout: int = 300, script: str | None = None) -> dict:
    """Run benchmarks/bench_<name>.py (or benchmarks/<script>.py) in tmp_path (its results go to tmp_path/bench-results)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }
    # forked with torch imported (tests/forked.py), not a fresh interpreter: 2-3 s less a script
    r = forked.run(
        ROOT / "benchmarks" / f"{script or 'bench_' + name}.py", *args, cwd=tmp_path, env=env, timeout=timeout
    )
    assert r.returncode == 0, f"bench_{name}.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    files = sorted((tmp_path / "bench-results").glob("*.json"))
    assert files, f"bench_{name}.py wrote no results: {r.stdout[-2000:]}"
    return json.loads(files[-1].read_text())


def positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def test_bench_store(tmp_path):
    d = run_bench(
        "store",
        [
            "--examples",
            "40",
            "--tokens",
            "9",
            "--d-model",
            "16",
            "--batch",
            "10",
            "--write-repeats",
            "1",
            "--queries",
            "20",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    n, layers, t, dm = d["shape"]
    assert (layers, t, dm) == (2, 9, 16) and n >= 40
    for layout in ("v2", "v3-sharded"):
        w = d["layouts"][layout]["write"]
        assert w["bytes"] == n * layers * t * dm * 2 and positive(w["ratio_vs_raw"], w["raw_MBps"]), w


def test_bench_breakdown(tmp_path):
    d = run_bench("breakdown", ["--block-mb", "1", "--repeats", "1"], tmp_path)
    assert d["bytes"] >= 2**20 * 0.7 and len(d["ns_per_byte"]) >= 7, d
    assert positive(d["disk_ns_per_byte"], d["serial_ratio"], d["pipelined_ratio"])
    assert positive(*(v for k, v in d["ns_per_byte"].items() if "writeback" not in k)), d["ns_per_byte"]


def test_bench_saelens(tmp_path):
    d = run_bench(
        "saelens",
        ["--tokens", "3000", "--d-model", "32", "--repeats", "2", "--settle", "0", "--dir", str(tmp_path)],
        tmp_path,
    )
    assert d["bytes"] == d["tokens"] * 32 * 4 and d["tokens"] > 2000
    assert len(d["export_s"]) == len(d["raw_s"]) == 2 and positive(d["ratio"])


def test_bench_remote(tmp_path):
    d = run_bench(
        "remote",
        [
            "--examples",
            "8",
            "--tokens",
            "9",
            "--d-model",
            "16",
            "--batch",
            "4",
            "--shard-examples",
            "4",
            "--queries",
            "5",
            "--upload-repeats",
            "1",
            "--repeats",
            "1",
            "--threads",
            "4",
        ],
        tmp_path,
    )
    data = 8 * 2 * 9 * 16 * 2  # the shard files' activations, plus their indexes
    assert data < d["store_bytes"] < data + 1024, d["store_bytes"]
    assert positive(d["upload"]["ratio"], d["random_read"]["ratio"])
    assert positive(*(v["next_epoch_ratio"] for v in d["token_stream"].values()))


def test_bench_distributed(tmp_path):
    d = run_bench(
        "distributed",
        [
            "--examples",
            "24",
            "--workers",
            "1,2",
            "--repeats",
            "1",
            "--d-model",
            "32",
            "--model-layers",
            "2",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert [r["writers"] for r in d["rows"]] == [1, 2] and positive(*(r["examples_per_s"] for r in d["rows"]))
    written = {w: sum(run["bytes"] for run in runs) for w, runs in d["runs"].items()}
    assert len(set(written.values())) == 1 and min(written.values()) > 0, (
        written
    )  # the same store, whatever the writers


@pytest.mark.parametrize("extra", [[], ["--zarr-format", "3", "--shard-examples", "2"]], ids=["v2", "v3-sharded"])
def test_bench_capture(tmp_path, extra):
    d = run_bench(  # two batches of the embedded DINOv2 (two shards of the v3 store)
        "capture",
        ["--examples", "4", "--batch-size", "2", "--layers", "0-1", "--repeats", "1", "--dir", str(tmp_path), *extra],
        tmp_path,
    )
    assert d["examples"] == 4 and d["layers"] == [0, 1]
    assert d["bytes_written"] == 4 * 2 * 257 * 384 * 2 and positive(d["ratio_median_of_pairs"])


def test_bench_gpu_replay_and_model_mode_on_the_cpu(tmp_path):
    """bench_gpu.py's --replay (the GPU regime on any machine) and its model mode on a tiny
    Llama: every cell measured against a raw write of the same bytes."""
    common = ["--batch-size", "2", "--seq-len", "16", "--batches", "2", "--repeats", "1", "--dir", str(tmp_path)]
    d = run_bench("gpu", ["--replay", "--d-model", "32", "--layers", "0,1", *common], tmp_path)
    assert d["mode"] == "replay" and len(d["cells"]) == 4  # float16 and bfloat16 outputs x statistics on, off
    for c in d["cells"]:
        assert c["bytes"] == 2 * 2 * 2 * 16 * 32 * 2 and positive(c["ratio_raw_over_record"], c["record_GBps"])
    d = run_bench(
        "gpu", ["--shape", "tiny", "--layers", "1,-1", "--model-dtype", "float32", "--stats", "on", *common], tmp_path
    )
    (c,) = d["cells"]
    assert (
        c["layers"] == [1, 3] and c["d_model"] == 64 and positive(c["record_over_forward"], c["forward_tokens_per_s"])
    )


def test_bench_loaders(tmp_path):
    d = run_bench(
        "loaders",
        [
            "--examples",
            "40",
            "--tokens",
            "9",
            "--d-model",
            "16",
            "--pair-batch",
            "8",
            "--token-batch",
            "64",
            "--repeats",
            "1",
            "--saev-batch",
            "64",
            "--saev-buffer",
            "2",
            "--saev-batches",
            "2",
            "--knob-mb",
            "1",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert d["shape"] == [40, 2, 9, 16] and d["pairs"]["bytes"] == 8 * 2 * 9 * 16 * 2
    cold = d["tokens"]["cold"]
    assert positive(cold["seq"], cold["f16"], cold["f32"]) and positive(*d["token_stages"]["ns_per_token"].values())
    assert positive(d["saev_design"]["tokens_per_s"]) and d["knob"][0]["buffer_mb"] == 1.0


def test_bench_export(tmp_path):
    d = run_bench(
        "export",
        [
            "--gb",
            "0.002",
            "--budget",
            "100",
            "--tokens",
            "9",
            "--d-model",
            "16",
            "--repeat",
            "1",
            "--workers",
            "1",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert d["n_examples"] > 0 and d["budget"] == 100 and d["workers"] == 1
    assert positive(d["ratio"], *d["plain_write_gbps"], *d["export_gbps"])


def test_bench_features(tmp_path):
    d = run_bench(
        "features",
        [
            "--examples",
            "40",
            "--tokens",
            "8",
            "--d-model",
            "16",
            "--expansion",
            "2",
            "--repeats",
            "1",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert d["tokens"] == 320 and d["features_sae"] == 32 and len(d["runs"]) == 1
    assert positive(d["neurons_ratio_median"], d["sae_ratio_median"], d["peak_bytes"]["half"], d["peak_bytes"]["full"])
    assert positive(d["neurons_kernel_ns_per_value"]["1"], d["neurons_kernel_ns_per_value"]["all"])


def test_bench_spec(tmp_path):
    """The spec's matrix at --quick size: one row per measurement, every cell's parameters."""
    d = run_bench(
        "spec",
        [
            "--quick",
            "--r-max",
            "8,16",
            "--t-chunk",
            "8,16",
            "--workers",
            "0,2",
            "--writers",
            "1,2",
            "--queries",
            "30",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    rows = d["rows"]
    cells = {(r["layout"], r["r_max"], r["t_chunk"]) for r in rows}
    assert cells == {(lay, r, t) for lay in ("v2", "v3-sharded") for r in (8, 16) for t in (8, 16)}
    for r in rows:
        assert (r["d_model"], r["layers"], r["examples"], r["p_max"]) == (32, 2, 16, 32), r
        assert r["prompt_chunk_bytes"] == r["t_chunk"] * 32 * 2 and r["response_chunk_bytes"] == r["r_max"] * 32 * 2
    per_cell = {}
    for r in rows:
        per_cell.setdefault((r["layout"], r["r_max"], r["t_chunk"]), []).append(
            (r["metric"], r.get("workers", r.get("writers")))
        )
    assert all(
        sorted(v, key=str)
        == sorted(
            [("write", 1), ("write", 2), ("read_prompt", None), ("read_response", None), ("batch", 0), ("batch", 2)],
            key=str,
        )
        for v in per_cell.values()
    ), per_cell
    for r in rows:
        if r["metric"] == "write":
            assert r["bytes"] == 16 * 2 * (32 + r["r_max"]) * 32 * 2 and positive(
                r["MBps"], r["limit_MBps"], r["ratio"]
            ), r
        else:
            assert (
                positive(r["mean_us"], r["p50_us"], r["p95_us"], r["limit_mean_us"], r["limit_p50_us"])
                and r["p95_us"] >= r["p50_us"]
            ), r
        if r["metric"].startswith("read_"):
            assert r["n"] == 30 and positive(r["zarr_python_p50_us"]), r
    assert (tmp_path / "bench-results" / "spec.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spec_data(tmp_path):
    """spec_data.py on a tiny config-built Llama: the lengths it stores, their quantiles and
    what each truncation policy loses, recomputed here from the lengths."""
    import numpy as np
    from capture_support import save_llama

    model = save_llama(tmp_path / "llama", layers=2)
    d = run_bench(
        "spec_data",
        [
            "--examples",
            "12",
            "--generate",
            "4",
            "--model",
            str(model),
            "--layers",
            "0",
            "--batch-size",
            "4",
            "--dir",
            str(tmp_path),
        ],
        tmp_path,
        script="spec_data",
    )
    p, r = np.asarray(d["lengths"]["prompt"]), np.asarray(d["lengths"]["response"])
    assert d["n_examples"] == len(p) == len(r) == 12 and d["r_max_stored"] == 4 and d["p_max_stored"] == p.max()
    assert r.min() >= 1 and r.max() <= 4 and d["responses_at_generation_cap"] == int((r == 4).sum())
    assert (
        0 <= d["capped_responses_looping"] <= d["responses_at_generation_cap"] and d["other_responses_looping"] == 0
    )  # 4 words cannot loop
    assert d["prompt_len"]["p50"] == np.quantile(p, 0.5) and d["response_len"]["p99"] == np.quantile(r, 0.99)
    fixed64 = next(x for x in d["prompt_policies"] if x["policy"] == "fixed 64")
    assert fixed64["truncated_examples"] == int((p > 64).sum())
    assert abs(fixed64["lost_tokens_fraction"] - (1 - np.minimum(p, 64).sum() / p.sum())) < 1e-12
    q1 = next(x for x in d["response_policies"] if x["policy"] == "quantile 1.0")
    assert q1["budget"] == r.max() and q1["truncated_examples"] == 0 and q1["lost_tokens_fraction"] == 0


def test_bench_import(tmp_path):
    d = run_bench(
        "import",
        ["--files", "2", "--seqs", "4", "--seq-len", "16", "--d-model", "8", "--repeats", "1", "--dir", str(tmp_path)],
        tmp_path,
    )
    assert d["activault"]["tokens"] == d["saelens"]["tokens"] == 2 * 4 * 16
    assert d["aligned"]["layers"] == 3 and d["aligned"]["vectors"] == 8 * 8 * 3
    assert positive(d["activault"]["ratio"], d["saelens"]["ratio"], d["aligned"]["ratio"])


def test_bench_scale(tmp_path):
    d = run_bench(
        "scale",
        [
            "--shards",
            "1,3",
            "--shard-size",
            "2",
            "--examples",
            "40",
            "--s3-shards",
            "1,2",
            "--dir",
            str(tmp_path),
            "--plot",
            str(tmp_path / "scale.png"),
        ],
        tmp_path,
    )
    assert [r["shards"] for r in d["shard_rows"]] == [1, 3] and [r["examples"] for r in d["example_rows"]] == [40]
    ops = {"finalize", "open", "info", "verify", "verify_deep", "cp", "saev_plan", "token_plan", "token_first_batch"}
    assert all(
        set(r["seconds"]) == ops and positive(*r["seconds"].values()) for r in d["shard_rows"] + d["example_rows"]
    )
    assert set(d["growth_per_shard"]) == ops and positive(*d["growth_per_shard"].values())
    req = d["requests"]
    assert 0 < req["writer_one_commit"]["total"] and [s["shards"] for s in req["stores"]] == [1, 2]
    assert all(s["open"]["total"] == 1 for s in req["stores"])  # the manifest alone
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_views(tmp_path):
    """bench_views.py at toy sizes: the view, the index in chromium, the delphi writer and the
    vision site (the demo's store needs the embedded ViT: its own run)."""
    args = ["--features", "64", "--examples", "16", "--tokens", "16", "--d-model", "16", "--index-features", "2000"]
    args += ["--delphi-tokens", "8192", "--delphi-latents", "256", "--vit-examples", "6", "--vit-d-model", "16"]
    args += ["--only", "view", "--only", "index", "--only", "delphi", "--only", "vit"]
    res = run_bench("views", args, tmp_path)
    v, d, vit = res["view"], res["delphi"], res["vit"]
    assert v["features"] == 64 and positive(v["view_s"], v["bytes_on_disk_per_feature"], v["raw_write_same_bytes_s"])
    assert res["index"]["features"] == 2000 and positive(res["index"]["first_draw_ms"])
    assert d["nonzeros"] == int(4096 * 256 * 0.01) * 2 and positive(d["ours_s"], d["ratio_vs_ready_arrays"])
    assert vit["tokens"] == 6 * 257 and vit["images"] == 6 and positive(vit["view_s"], vit["bytes_on_disk_per_feature"])


def test_bench_gpu_read(tmp_path):
    """The CPU parts of the GPU read benchmark: loader-fed training against resident batches,
    the loader alone, the feature pass on the CPU, the follow stream's latency."""
    args = ["--tokens", "8192", "--d-models", "32", "--features", "128", "--workers", "0,1", "--train-workers", "0"]
    args += ["--batch", "256", "--expansion", "2", "--k", "4", "--repeats", "1", "--cpu-feature-tokens", "2048"]
    d = run_bench("gpu_read", args + ["--follow-blocks", "3", "--follow-gap", "0.1", "--dir", str(tmp_path)], tmp_path)
    assert d["device"] == "cpu" and d["follow"]["blocks"] == 3 and len(d["follow"]["latency_s"]) == 3
    assert d["follow"]["tokens"] == 3 * 8 * 128 and positive(d["follow"]["max_s"])
    part = d["d32"]
    (train,) = part["train"]
    assert train["tokens"] == 8192 and train["features"] == 64 and positive(train["ratio_median"])
    assert [r["workers"] for r in part["loader_alone"]] == [0, 1]
    assert positive(*(r["tokens_per_s"] for r in part["loader_alone"]))
    (feat,) = part["features"]
    assert feat["features"] == 128 and feat["cpu_tokens"] == 2048 and "gpu_s" not in feat and positive(feat["cpu_s"])


def test_bench_online(tmp_path):
    """bench_online.py: a consumer against an offline epoch, a spooled writer against a
    plain one (every consumer got every token: the script checks it)."""
    args = ["--tokens", "512", "--d-model", "32", "--batch-size", "2", "--seq-len", "16", "--commit-bytes", "2048"]
    args += ["--train-batch", "64", "--buffer-bytes", "4096", "--repeats", "1", "--dir", str(tmp_path)]
    d = run_bench("online", args, tmp_path)
    assert d["tokens"] == 512 and d["write"]["capture_bytes"] == 512 * 2 * 32 * 2
    assert positive(
        d["read"]["consumer_over_offline"], d["write"]["spooled_over_plain"], d["write"]["spooled_over_followed"]
    )
