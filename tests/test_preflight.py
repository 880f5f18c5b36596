"""`actstore write` checks what it can before any model loads (docs/capture.md, "Errors"):
each case fails fast, names the problem, never loads the model (nor imports torch) and
leaves the store as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from capture_support import PAIRS, SENTENCES, make_images, save_dinov2, save_llama, write_jsonl
from click.testing import CliRunner

import actstore
from actstore.capture import run as run_mod
from actstore.cli import main


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    llama, dino = save_llama(d / "llama", layers=3), save_dinov2(d / "dino", layers=3)
    make_images(d / "imgs", n=3)
    data = write_jsonl(d / "p.jsonl", PAIRS)
    texts = write_jsonl(d / "t.jsonl", [{"text": s} for s in SENTENCES])
    (d / "fifomodel").mkdir()
    os.mkfifo(d / "fifomodel" / "config.json")  # would block a reader forever
    bad = d / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": broken\n', encoding="utf-8")
    for store, layers, extra in (
        ("s.store", "0,1", []),
        ("named.store", "blocks.1.hook_resid_post,model.layers.0.mlp", []),
        ("packed.store", "1", ["--pack", "--context", "8"]),
    ):
        src = texts if extra or store == "named.store" else data
        res = CliRunner().invoke(
            main,
            ["write", str(d / store), "--model", str(llama), "--data", str(src), "--layers", layers, "--quiet", *extra],
        )
        assert res.exit_code == 0, res.output
    return {
        "llama": llama,
        "dino": dino,
        "imgs": d / "imgs",
        "data": data,
        "texts": texts,
        "bad": bad,
        "store": d / "s.store",
        "named": d / "named.store",
        "packed": d / "packed.store",
        "dir": d,
        "fifomodel": d / "fifomodel",
    }


# (case, store it runs on (None: a new one), the arguments after STORE, the one-line message)
CASES = [
    (
        "resume_layers",
        "store",
        ["--model", "{llama}", "--data", "{data}", "--layers", "0,2", "--resume"],
        "--resume of {store}: the store holds layers [0, 1], not [0, 2]; resume with --layers 0,1",
    ),
    (
        "resume_dtype",
        "store",
        ["--model", "{llama}", "--data", "{data}", "--layers", "0,1", "--dtype", "float32", "--resume"],
        "--resume of {store}: the store holds float16, not float32; resume with --dtype float16",
    ),
    (
        "resume_model",
        "store",
        ["--model", "{dino}", "--data", "{imgs}", "--layers", "0,1", "--resume"],
        "--resume of {store}: the store was captured from '{llama}', not '{dino}'; resume with --model {llama}",
    ),
    (
        "resume_names",
        "named",
        [
            "--model",
            "{llama}",
            "--data",
            "{texts}",
            "--layers",
            "blocks.1.hook_resid_post,blocks.0.hook_mlp_out",
            "--resume",
        ],
        "--resume of {named}: the store holds layers [1, 'model.layers.0.mlp'], not ['blocks.1.hook_resid_post', 'blocks.0.hook_mlp_out']; "
        "resume with --layers 1,model.layers.0.mlp",
    ),
    (
        "resume_negative",
        "named",
        ["--model", "{llama}", "--data", "{texts}", "--layers", "-1,model.layers.0.mlp", "--resume"],
        "--resume of {named}: the store holds layers [1, 'model.layers.0.mlp'], not [-1, 'model.layers.0.mlp']; "
        "resume with --layers 1,model.layers.0.mlp",
    ),
    (
        "resume_packing",
        "packed",
        ["--model", "{llama}", "--data", "{texts}", "--layers", "1", "--pack", "--context", "16", "--resume"],
        "--resume of {packed}: the store holds a corpus captured with --pack --context 8; resume with the same options",
    ),
    (
        "generate_images",
        None,
        ["--model", "{dino}", "--data", "{imgs}", "--layers", "0", "--generate", "4"],
        "--generate makes responses for prompts; {dino} is an image model",
    ),
    (
        "generate_given_response",
        None,
        ["--model", "{llama}", "--data", "{data}", "--layers", "0", "--generate", "4"],
        "--generate makes each prompt's response, but {data}:1 gives one: leave out --generate to capture the given "
        'responses, or remove the "response" fields to generate them',
    ),
    (
        "pack_images",
        None,
        ["--model", "{dino}", "--data", "{imgs}", "--layers", "0", "--pack", "--context", "8"],
        "--pack and --chunk take a language model; {dino} is an image model",
    ),
    (
        "modality",
        None,
        ["--model", "{llama}", "--data", "{imgs}", "--layers", "0,1"],
        "model {llama} takes text input but --data {imgs} holds image examples",
    ),
    (
        "layer",
        None,
        ["--model", "{llama}", "--data", "{data}", "--layers", "0,-4"],
        "layer -4 does not exist: {llama} has 3 blocks, so layers 0..2 (or -3..-1) exist; names: "
        "blocks.N.hook_resid_pre|hook_attn_out|attn.hook_z|hook_resid_mid|hook_mlp_in|mlp.hook_post|hook_mlp_out|hook_resid_post, or module paths",
    ),
    (
        "module_path",
        None,
        ["--model", "{llama}", "--data", "{data}", "--layers", "model.layers.3.mlp"],
        "model.layers.3.mlp does not exist: {llama} has 3 blocks, so layers 0..2 (or -3..-1) exist; names: "
        "blocks.N.hook_resid_pre|hook_attn_out|attn.hook_z|hook_resid_mid|hook_mlp_in|mlp.hook_post|hook_mlp_out|hook_resid_post, or module paths",
    ),
    (
        "fifo_config",
        None,
        ["--model", "{fifomodel}", "--data", "{data}", "--layers", "0"],
        "{fifomodel}/config.json is a FIFO (named pipe), not a file: a model folder holds its config.json as a regular file "
        "(pass a saved model folder, a hub id or embedded:...)",
    ),
    (
        "bad_line",
        None,
        ["--model", "{llama}", "--data", "{bad}", "--layers", "0"],
        "{bad}:3: not valid JSON (Expecting value: line 1 column 10 (char 9))",
    ),
    (
        "not_writable",
        "unwritable",
        ["--model", "{llama}", "--data", "{data}", "--layers", "0"],
        "cannot write to {data}/x.store: {data} is a file, not a folder; give a path under a folder",
    ),
]


def _args(env, store_key, args, case):
    fmt = {k: str(v) for k, v in env.items()}
    target = {None: env["dir"] / f"new-{case}.store", "unwritable": f"{env['data']}/x.store"}.get(store_key) or env.get(
        store_key
    )
    return str(target), [a.format(**fmt) for a in args]


@pytest.mark.parametrize("case, store_key, args, message", CASES, ids=[c[0] for c in CASES])
def test_checked_before_the_model_loads(env, monkeypatch, case, store_key, args, message):
    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "load_model", no_model)
    store = env["store"]
    before = sorted(p.relative_to(env["dir"]) for p in env["dir"].rglob("*"))
    target, argv = _args(env, store_key, args, case)
    res = CliRunner().invoke(main, ["write", target, *argv, "--quiet"])
    assert res.exit_code == 1
    assert res.output.strip() == "actstore: error: " + message.format(**{k: str(v) for k, v in env.items()}), res.output
    assert (
        sorted(p.relative_to(env["dir"]) for p in env["dir"].rglob("*")) == before
    )  # nothing written, nothing removed
    assert len(actstore.ActStore(store)) == len(PAIRS)


# What makes these checks fast (well under the two seconds; docs/benchmarks.md has the
# times) is that they run before torch, transformers or any model is imported, checked here
# in a fresh interpreter, without timing anything.
PROBE = """import contextlib, io, json, sys
from actstore.cli import main
for argv in json.loads(sys.argv[1]):  # one case after another; torch must stay unimported through all
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps([code, sorted(m for m in ("torch", "transformers", "skimage") if m in sys.modules), err.getvalue()]))
"""


def test_the_checks_run_before_torch_is_imported(env):
    """One fresh interpreter runs the cases one after another: after each, torch, transformers
    and skimage are still not imported."""
    runs = []
    for case, store_key, args, _ in CASES[::2] + [CASES[-1]]:
        target, argv = _args(env, store_key, args, case)
        runs.append((case, ["write", target, *argv, "--quiet"]))
    generate = ["--model", "embedded:dinov2-s14", "--data", "embedded:images", "--layers", "0", "--generate", "2"]
    runs.append(("generate", ["write", str(env["dir"] / "x.store"), *generate]))
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([argv for _, argv in runs])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    got = [json.loads(line) for line in res.stdout.strip().splitlines()]
    assert len(got) == len(runs), (res.stdout, res.stderr[-2000:])
    for (case, _), (code, imported, err) in zip(runs, got):
        assert (code, imported) == (1, []), (case, err)
        assert err.startswith("actstore: error: "), (case, err)


def test_the_first_given_response_is_found_in_every_pair_source(tmp_path):
    """--generate's refusal names the first record that gives a response: a jsonl line, a
    datasets row, a file of a glob; --max-examples that stops before it lets --generate run."""
    import datasets

    from actstore.inputs.data import load_source

    rows = [{"prompt": "a"}, {"prompt": "b", "response": None}, {"prompt": "c", "response": "x"}, {"prompt": "d"}]
    one = write_jsonl(tmp_path / "one.jsonl", rows)
    src = load_source(str(one))
    assert src.kind == "pair" and src.given_response == (2, f"{one}:3")
    assert src.limit(2).given_response is None and src.limit(3).given_response == (2, f"{one}:3")
    assert load_source(str(write_jsonl(tmp_path / "none.jsonl", rows[:2]))).given_response is None
    (tmp_path / "g").mkdir()
    write_jsonl(tmp_path / "g" / "a.jsonl", rows[:2])
    write_jsonl(tmp_path / "g" / "b.jsonl", rows)
    assert load_source(str(tmp_path / "g" / "*.jsonl")).given_response == (4, f"{tmp_path / 'g' / 'b.jsonl'}:3")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"prompt": r["prompt"], "response": r.get("response")} for r in rows]).save_to_disk(
        str(folder)
    )
    assert load_source(str(folder)).given_response == (2, f"{folder} row 2 (column 'response')")
    folder2 = tmp_path / "ds2"
    datasets.Dataset.from_list([{"prompt": "a", "response": None}]).save_to_disk(str(folder2))
    assert load_source(str(folder2)).given_response is None
