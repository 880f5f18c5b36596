"""record() of several widths and of two models into one aligned family, from tiny Llamas
built from configs: each site equals an independent computation through the model, model
B's member equals a capture of B alone bit for bit, and aligned streams pair the same token."""

from __future__ import annotations

import re
from pathlib import Path

import forked
import numpy as np
import pytest

import actstore
import actstore.torch
from actstore.errors import CaptureError, LayerNotFoundError, StoreNotFoundError
from actstore.inputs.models import LoadedModel

pytestmark = pytest.mark.torch

SITE_IN = "model.layers.1.post_attention_layernorm"  # the MLP's normalised input
SITE_OUT = "blocks.1.hook_mlp_out"
SITE_POST = "model.layers.1.mlp.act_fn"  # the MLP's hidden activations, d_mlp wide
RESID = "blocks.1.hook_resid_post"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_transcoder.py"


def _batches(vocab: int, n: int = 3):
    import torch

    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (2, 7), generator=gen) for _ in range(n)]


def test_sites_of_three_kinds_make_a_family_of_two_widths(tmp_path):
    import torch
    from capture_support import tiny_llama

    model, tok = tiny_llama(layers=2)
    batches = _batches(len(tok))
    results = actstore.record(model, batches, tmp_path / "fam", layers=[SITE_IN, SITE_OUT, SITE_POST], dtype="float32")
    assert [r.n_written for r in results] == [6, 6]
    actstore.finalize(tmp_path / "fam")
    fam = actstore.open(tmp_path / "fam")
    assert [(m.name, m.width, m.sites) for m in fam.family.members] == [
        ("d32", 32, (SITE_IN, SITE_OUT)),
        ("d64", 64, (SITE_POST,)),
    ]
    mlp = model.model.layers[1].mlp
    for ex in (0, 5):
        x_in = torch.from_numpy(fam[ex, SITE_IN])
        with torch.no_grad():  # the stored sites against the model's own MLP applied to the stored input
            np.testing.assert_allclose(fam[ex, SITE_OUT], mlp(x_in).numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(
                fam[ex, SITE_POST], mlp.act_fn(mlp.gate_proj(x_in)).numpy(), rtol=1e-5, atol=1e-6
            )
        np.testing.assert_array_equal(fam.token_ids(ex), batches[ex // 2][ex % 2].numpy())
    fam.check_aligned()
    # Sites of one width stay one ordinary store: nothing about it changes.
    actstore.record(model, batches, tmp_path / "one", layers=[SITE_IN, SITE_OUT], dtype="float32")
    assert (tmp_path / "one" / "actstore.json").exists() and not (tmp_path / "one" / "family.json").exists()


def test_two_models_on_the_same_tokens(tmp_path):
    from capture_support import tiny_llama

    a, tok = tiny_llama(layers=2, seed=0)
    b, _ = tiny_llama(layers=2, seed=1)
    batches = _batches(len(tok))
    actstore.record([a, b], batches, tmp_path / "fam", layers=[RESID, SITE_OUT], dtype="float16")
    actstore.finalize(tmp_path / "fam")
    actstore.record(b, batches, tmp_path / "b", layers=[RESID, SITE_OUT], dtype="float16")
    actstore.finalize(tmp_path / "b")
    fam = actstore.open(tmp_path / "fam")
    assert [(m.name, m.model) for m in fam.family.members] == [("m0-d32", 0), ("m1-d32", 1)]
    # Model B's member is a capture of B alone, bit for bit: every data file of its shard.
    ours = tmp_path / "fam" / "members" / "m1-d32" / "shards" / "shard-00000.zarr" / "arrays"
    alone = tmp_path / "b" / "shards" / "shard-00000.zarr" / "arrays"
    files = sorted(p.relative_to(alone) for p in alone.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    for rel in files:
        assert (ours / rel).read_bytes() == (alone / rel).read_bytes(), rel
    assert not np.array_equal(fam[0, (0, RESID)], fam[0, (1, RESID)])  # two models, two answers
    with pytest.raises(LayerNotFoundError, match=r"site 'blocks.1.hook_resid_post' is recorded from 2 models"):
        fam[0, RESID]
    # A crosscoder's stream: row i of both tensors is the same token (example, position).
    stream = actstore.torch.TokenStream.aligned(
        tmp_path / "fam", layers=[(0, RESID), (1, RESID)], batch_size=5, return_index=True, seed=3
    )
    rows = 0
    for batch in stream:
        xa, xb = batch["acts"]
        for i, (ex, t) in enumerate(zip(batch["example"].tolist(), batch["token"].tolist())):
            np.testing.assert_array_equal(xa[i].numpy(), fam[ex, (0, RESID)][t].astype(np.float32))
            np.testing.assert_array_equal(xb[i].numpy(), fam[ex, (1, RESID)][t].astype(np.float32))
        rows += len(xa)
    assert rows == 6 * 7


def test_models_of_other_tokenizers_are_refused_before_writing(tmp_path):
    from capture_support import make_tokenizer, tiny_llama

    a, tok = tiny_llama(layers=2, seed=0)
    b, _ = tiny_llama(layers=2, seed=1)
    other = make_tokenizer()
    other.add_tokens(["zebra-token"])
    lm_a = LoadedModel(model=a, forward=a, modality="text", model_id="a", tokenizer=tok)
    lm_b = LoadedModel(model=b, forward=b, modality="text", model_id="b", tokenizer=other)
    with pytest.raises(CaptureError, match=r"models 0 \(a\) and 1 \(b\) do not share a tokenizer \(vocabularies of"):
        actstore.record([lm_a, lm_b], _batches(len(tok)), tmp_path / "fam", layers=[RESID])
    assert not (tmp_path / "fam").exists()


def test_a_stream_of_one_site_and_sites_of_several_widths(tmp_path):
    from capture_support import tiny_llama

    model, tok = tiny_llama(layers=2)
    actstore.record(model, _batches(len(tok)), tmp_path / "fam", layers=[SITE_OUT, SITE_POST], dtype="float32")
    actstore.finalize(tmp_path / "fam")
    fam = actstore.open(tmp_path / "fam")
    (x,) = list(actstore.torch.TokenStream(tmp_path / "fam", layers=SITE_POST, batch_size=64, shuffle=False))
    assert x.shape == (42, 64)
    np.testing.assert_array_equal(x[:7].numpy(), fam[0, SITE_POST])
    with pytest.raises(LayerNotFoundError, match=r"lie in different members .*'blocks.1.hook_mlp_out': width 32, "):
        actstore.torch.TokenStream(tmp_path / "fam", layers=[SITE_OUT, SITE_POST])
    with pytest.raises(
        LayerNotFoundError,
        match=r"is a family: name the sites to read, layers=\[...\]; it holds \[.blocks.1.hook_mlp_out., .model.layers.1.mlp.act_fn.\]",
    ):
        actstore.torch.TokenStream(tmp_path / "fam")


def test_transcoder_example_trains_on_an_aligned_stream(tmp_path):
    proc = forked.run(EXAMPLE, "--steps", "60", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    err = float(re.search(r"aligned: max \|mlp\(x_in\) - x_out\| = ([0-9.e+-]+) over 256 tokens", out).group(1))
    assert err < 1e-5
    fvus = [float(m) for m in re.findall(r"^step +\d+ +epoch \d+ +fvu ([0-9.]+)", out, re.M)]
    assert len(fvus) == 2 and fvus[-1] < 0.3 and fvus[-1] < fvus[0] / 3
    assert "d64: 64 x ['model.layers.1.mlp.act_fn']" in out


def test_write_with_two_models_makes_one_family(tmp_path):
    from capture_support import SENTENCES, save_llama, write_jsonl
    from factory import cli

    a = save_llama(tmp_path / "a", layers=2, seed=0)
    b = save_llama(tmp_path / "b", layers=2, seed=1)
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES])
    job = ("--data", data, "--layers", "1", "--p-max", "7", "--batch-size", "4", "--quiet")
    cli("write", tmp_path / "fam", "--model", a, "--model", b, *job)
    cli("write", tmp_path / "b-alone", "--model", b, *job)
    fam, alone = actstore.open(tmp_path / "fam"), actstore.ActStore(tmp_path / "b-alone")
    assert [(m.name, m.model_id) for m in fam.family.members] == [("m0-d32", str(a)), ("m1-d32", str(b))]
    assert len(fam) == len(alone) == len(SENTENCES)
    for ex in range(len(alone)):
        np.testing.assert_array_equal(fam[ex, (1, RESID)], alone[ex, RESID])
        np.testing.assert_array_equal(fam[ex, (str(b), RESID)], alone[ex, RESID])
        np.testing.assert_array_equal(fam.token_ids(ex), alone.token_ids(ex))
    res = cli("info", tmp_path / "fam")
    assert f"member m1-d32: width 32, model 1 ({b}), float16" in res.output
    assert f"  site {RESID:<44} width 32, layer 1" in res.output


def test_write_with_sites_of_several_widths_makes_a_family(tmp_path):
    import torch
    from capture_support import SENTENCES, save_llama, tiny_llama, write_jsonl
    from factory import cli

    folder = save_llama(tmp_path / "m", layers=2)
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": s} for s in SENTENCES])
    job = ("--model", folder, "--data", data, "--p-max", "7", "--batch-size", "4", "--quiet", "--dtype", "float32")
    cli("write", tmp_path / "fam", *job, "--layers", f"{SITE_IN},{SITE_OUT},{SITE_POST}")
    fam = actstore.open(tmp_path / "fam")
    assert [(m.name, m.sites) for m in fam.family.members] == [("d32", (SITE_IN, SITE_OUT)), ("d64", (SITE_POST,))]
    # One width stays one ordinary store.
    cli("write", tmp_path / "one", *job, "--layers", f"{SITE_IN},{SITE_OUT}")
    one = actstore.ActStore(tmp_path / "one")
    assert not (tmp_path / "one" / "family.json").exists()
    mlp = tiny_llama(layers=2)[0].model.layers[1].mlp  # the saved model's weights (same seed)
    for ex in range(len(one)):
        np.testing.assert_array_equal(fam[ex, SITE_OUT], one[ex, SITE_OUT])
        with torch.no_grad():
            post = mlp.act_fn(mlp.gate_proj(torch.from_numpy(fam[ex, SITE_IN]))).numpy()
        np.testing.assert_allclose(fam[ex, SITE_POST], post, rtol=1e-5, atol=1e-6)


def test_a_refused_family_write_leaves_nothing_and_a_member_never_written_is_named(tmp_path):
    """Bad --data fails before the family's record is written; a family whose capture
    stopped before a member was written says which member, and how to go on."""
    from capture_support import save_llama
    from factory import cli

    a = save_llama(tmp_path / "a", layers=2, seed=0)
    b = save_llama(tmp_path / "b", layers=2, seed=1)
    res = cli(
        "write", tmp_path / "fam", "--model", a, "--model", b, "--data", "embedded:nope", "--layers", "1", ok=False
    )
    assert res.exit_code == 1 and "no embedded data 'nope'" in res.output
    assert not (tmp_path / "fam").exists()
    import dataclasses

    from actstore.layout.family import Family, Member
    from actstore.write.family import create_family

    member = Member(name="d32", model=0, model_id=str(a), sites=("blocks.1.hook_resid_post",), width=32)
    create_family(
        tmp_path / "half",
        Family((member, dataclasses.replace(member, name="d64", width=64, sites=("blocks.1.mlp.hook_post",)))),
    )
    with pytest.raises(StoreNotFoundError, match=r"member d32 \(blocks.1.hook_resid_post\) was never written"):
        actstore.open(tmp_path / "half")
