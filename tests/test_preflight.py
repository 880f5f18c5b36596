"""`actstore write` checks what it can before any model loads (docs/capture.md, "Errors"):
each case fails fast, names the problem, never loads the model and leaves the store as it was."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

import actstore
from actstore.capture import run as run_mod
from actstore.cli import main
from test_capture_support import PAIRS, make_images, save_dinov2, save_llama, write_jsonl


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    llama, dino = save_llama(d / "llama", layers=3), save_dinov2(d / "dino", layers=3)
    make_images(d / "imgs", n=3)
    data = write_jsonl(d / "p.jsonl", PAIRS)
    res = CliRunner().invoke(main, ["write", str(d / "s.store"), "--model", str(llama), "--data", str(data), "--layers", "0,1", "--quiet"])
    assert res.exit_code == 0, res.output
    return {"llama": llama, "dino": dino, "imgs": d / "imgs", "data": data, "store": d / "s.store"}


@pytest.mark.parametrize(
    "case, message",
    [
        ("resume_layers", "--resume of {store}: the store holds layers [0, 1], not [0, 2]; resume with --layers 0,1"),
        ("resume_dtype", "--resume of {store}: the store holds float16, not float32; resume with --dtype float16"),
        ("resume_model", "--resume of {store}: the store was captured from '{llama}', not '{dino}'; resume with --model {llama}"),
        ("generate_images", "--generate makes responses for prompts; --data holds images"),
        ("modality", "model {llama} takes text input but --data {imgs} holds image examples"),
        ("layer", "layer -4 does not exist: {llama} has 3 blocks, so layers 0..2 (or -3..-1) exist; names: "
                  "blocks.N.hook_resid_pre|hook_resid_post|hook_mlp_out|hook_attn_out, or module paths"),
    ],
)
def test_checked_before_the_model_loads(env, monkeypatch, case, message):
    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "load_model", no_model)
    store, args = env["store"], ["--model", env["llama"], "--data", env["data"], "--layers", "0,1"]
    if case == "resume_layers":
        args[5] = "0,2"
    elif case == "resume_dtype":
        args += ["--dtype", "float32"]
    elif case == "resume_model":
        args[1] = env["dino"]
        args[3] = env["imgs"]
    elif case == "generate_images":
        args = ["--model", env["dino"], "--data", env["imgs"], "--layers", "0", "--generate", "4"]
    elif case == "modality":
        args[3] = env["imgs"]
    elif case == "layer":
        args[5] = "0,-4"
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    target = store if case.startswith("resume") else env["store"].parent / f"new-{case}.store"
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["write", str(target), *map(str, args), "--resume", "--quiet"])
    assert time.monotonic() - t0 < 5  # (the bar is two seconds; generous for a loaded CI machine)
    assert res.exit_code == 1
    assert res.output.strip() == "actstore: error: " + message.format(**{k: str(v) for k, v in env.items()}), res.output
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    assert len(actstore.ActStore(store)) == len(PAIRS)
