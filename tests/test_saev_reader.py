"""actstore.open(saev_dir) (SaevStore), import-saev, link-run and the saev CLI commands."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from click.testing import CliRunner
from factory import text_store, vit_store
from saev_checks import dir_files

import actstore
from actstore.cli import main
from actstore.errors import ExampleIndexError, LayerNotFoundError
from actstore.saev import SaevFormatError, SaevOptionError, SaevStore, export_saev, import_saev, link_run, verify_saev


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reader")
    store = vit_store(tmp / "s", n=13, dtype="float16", cls=True)
    res = export_saev(store, tmp / "scratch" / "saev" / "shards", protocol="2.1", patches_per_shard=30, progress=False)
    return store, res


def test_actstore_opens_a_saev_directory_with_the_same_api(exported):
    store, res = exported
    s = actstore.open(res.path)
    assert isinstance(s, SaevStore)
    assert (len(s), s.layers, s.d_model, s.dtype, s.segments, s.protocol) == (
        13,
        (2, 5),
        8,
        "float32",
        ("tokens",),
        "2.1",
    )
    for ex in range(13):
        for layer in (2, 5):
            x = s[ex, layer]
            assert x.dtype == np.float32 and x.shape == (5, 8) and not x.flags.writeable
            np.testing.assert_array_equal(x, store[ex, layer].astype(np.float32))
            np.testing.assert_array_equal(s.segment("tokens")[ex, layer], x)
    np.testing.assert_array_equal(s[-1, 2], store[12, 2].astype(np.float32))
    out = np.zeros((6, 8), np.float32)
    assert s.read_into(4, 5, "tokens", out) == 5
    np.testing.assert_array_equal(out[:5], store[4, 5].astype(np.float32))
    assert s.lengths(3) == {"tokens": 5}
    np.testing.assert_array_equal(s.field("tokens_len"), np.full(13, 5))
    lab = s.field("tokens_token_labels")  # label 0 at the CLS token, then labels.bin
    np.testing.assert_array_equal(lab[:, 1:], store.field("tokens_token_labels")[:, 1:])
    assert (lab[:, 0] == 0).all()
    m = s.meta
    assert (m["model_id"], m["family"], m["cls_token"], m["saev_hash"], m["n_examples"]) == (
        "facebook/dinov2-small",
        "dinov2",
        True,
        res.hash,
        13,
    )
    s2 = pickle.loads(pickle.dumps(s))
    np.testing.assert_array_equal(s2[7, 5], s[7, 5])


def test_saev_reader_errors(exported, tmp_path):
    _, res = exported
    s = actstore.open(res.path)
    with pytest.raises(ExampleIndexError, match=r"example 13 is out of range: this store holds 13 examples"):
        s[13, 2]
    with pytest.raises(LayerNotFoundError, match=r"layer 3 is not stored; this store holds layers \[2, 5\]"):
        s[0, 3]
    with pytest.raises(KeyError, match="no per-sample field 'label'"):
        s.field("label")
    import shutil

    d = tmp_path / "saev" / "shards" / res.hash
    shutil.copytree(res.path, d)
    os.chmod(d / "acts000002.bin", 0o644)
    os.truncate(d / "acts000002.bin", 10)
    with pytest.raises(
        SaevFormatError,
        match=r"acts000002.bin has 10 bytes, expected 960 \(full-size shard\); run `actstore verify-saev",
    ):
        actstore.open(d)
    os.chmod(d / "metadata.json", 0o644)
    (d / "metadata.json").write_text(json.dumps({"protocol": "1.1"}))
    with pytest.raises(
        SaevFormatError,
        match=r"is not a valid saev shard directory: metadata.json: protocol must be one of \['2.0', '2.1'\]. Got '1.1'.",
    ):
        actstore.open(d)


@pytest.mark.parametrize("protocol", ["2.0", "2.1"])
def test_import_then_export_reproduces_the_directory(tmp_path, protocol):
    store = vit_store(
        tmp_path / "s",
        n=11,
        dtype="float32",
        cls=True,
        attrs={"family": "clip", "data": {"__class__": "ImageFolder", "root": "/img"}},
    )
    root = tmp_path / "a" / "saev" / "shards"
    first = export_saev(store, root, protocol=protocol, patches_per_shard=30, progress=False)
    back = import_saev(first.path, tmp_path / "imported", progress=False)
    assert (len(back), back.layers, back.dtype) == (11, (2, 5), "float32")
    for ex in range(11):
        np.testing.assert_array_equal(back[ex, 5], store[ex, 5])
    again = export_saev(
        back, tmp_path / "b" / "saev" / "shards", protocol=protocol, patches_per_shard=30, progress=False
    )
    assert again.hash == first.hash
    assert dir_files(again.path) == dir_files(first.path)


def test_import_to_float16_and_refuse_existing(tmp_path):
    store = vit_store(tmp_path / "s", n=5, labels=False, cls=False)
    res = export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False)
    back = import_saev(res.path, tmp_path / "st", dtype="float16", progress=False)
    assert back.dtype == "float16" and not back.config.token_labels
    np.testing.assert_array_equal(back[4, 2], store[4, 2])
    with pytest.raises(actstore.ShardExistsError, match="shard 0 of .* already exists"):
        import_saev(res.path, tmp_path / "st", dtype="float16", progress=False)


def test_link_run_creates_the_layout_and_is_idempotent(tmp_path, monkeypatch, exported):
    _, res = exported
    data = tmp_path / "images"
    data.mkdir()
    run = tmp_path / "nfs" / "saev" / "runs" / "run1"
    out = link_run(run, train_shards=res.path, val_shards=res.path, dataset=data)
    assert out == run
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "inference", "links"]
    links = {p.name: os.readlink(p) for p in (run / "links").iterdir()}
    assert links == {
        "train-shards": str(res.path),
        "val-shards": str(res.path),
        "shards": str(res.path),
        "train-dataset": str(data),
        "dataset": str(data),
    }
    assert (run / "links" / "shards" / "metadata.json").is_file()
    assert link_run(run, train_shards=res.path, val_shards=res.path, dataset=data) == run  # rerun: no change
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SaevOptionError, match=f"train-dataset already points to {data}, not {other}; use a new run id"):
        link_run(run, train_shards=res.path, dataset=other)
    # Defaults: bare names resolve under $SAEV_NFS and $SAEV_SCRATCH.
    monkeypatch.setenv("SAEV_NFS", str(tmp_path / "nfs"))
    monkeypatch.setenv("SAEV_SCRATCH", str(res.path.parents[2]))
    assert link_run("run2", train_shards=res.hash) == tmp_path / "nfs" / "saev" / "runs" / "run2"
    assert os.readlink(tmp_path / "nfs" / "saev" / "runs" / "run2" / "links" / "train-shards") == str(res.path)
    with pytest.raises(SaevOptionError, match="is not a saev shard directory"):
        link_run("run3", train_shards="0000ffff")


def test_cli_export_verify_import_link(tmp_path, monkeypatch):
    store = text_store(tmp_path / "s", n=7)
    r = CliRunner()
    dump = tmp_path / "scratch" / "saev" / "shards"
    args = [
        "export-saev",
        str(store.path),
        "--out",
        str(dump),
        "--protocol",
        "2.1",
        "--family",
        "clip",
        "--dataset",
        "/data/text",
        "--patches-per-shard",
        "40",
        "--layers",
        "3",
        "--segments",
        "response,prompt",
        "--special",
        "keep",  # text_store's random labels are not token kinds: every real token
        "--quiet",
    ]
    res = r.invoke(main, args)
    assert res.exit_code == 0, res.output
    path = res.stdout.strip().splitlines()[-1]
    md = json.loads(open(os.path.join(path, "metadata.json")).read())
    n = sum(store.lengths(ex)["response"] + store.lengths(ex)["prompt"] for ex in range(len(store)))  # real tokens only
    assert (md["layers"], md["content_tokens_per_example"], md["family"], md["n_examples"]) == ([3], 1, "clip", n)
    shards = -(-n // 40)
    again = r.invoke(main, args[:-1])  # (--quiet would leave out the summary)
    assert again.exit_code == 0 and f"exists, verified: {n} examples in {shards} shards (protocol 2.1)" in again.stderr
    ok = r.invoke(main, ["verify-saev", path, "--values"])
    assert ok.exit_code == 0 and ok.stdout.strip() == f"ok: protocol 2.1, {n} examples in {shards} shards"
    os.chmod(os.path.join(path, "labels.bin"), 0o644)
    labels = open(os.path.join(path, "labels.bin"), "rb").read()
    os.truncate(os.path.join(path, "labels.bin"), 3)
    bad = r.invoke(main, ["verify-saev", path])
    assert bad.exit_code == 1
    assert bad.stdout.splitlines() == [f"labels.bin: 3 bytes, expected {n} (n_examples {n} x 1 content tokens, uint8)"]
    err = r.invoke(main, ["export-saev", str(store.path), "-o", str(tmp_path / "x"), "--special", "keep", "--quiet"])
    assert err.exit_code == 1
    assert err.stderr == (
        "actstore: error: 2 export options need a value: a text store ('HuggingFaceTB/SmolLM2-135M') has no saev "
        "family: saev's protocol 2.0 lists only the vision families ['clip', 'siglip', 'dinov2']; pass one as a label "
        "(--family, e.g. clip: the shards read the same whichever is named), the model stays named in ckpt; and the "
        "store does not record its dataset root (attrs['dataset']); pass --dataset, the absolute path of the original "
        "data set (saev links it for visuals)\n"
    )
    with open(os.path.join(path, "labels.bin"), "wb") as f:  # as exported (its checksum sidecar says so)
        f.write(labels)
    imp = r.invoke(main, ["import-saev", path, str(tmp_path / "imported")])
    assert imp.exit_code == 0 and imp.stdout.strip() == f"imported {n} examples in {tmp_path / 'imported'}".replace(
        " in ", " into "
    )
    monkeypatch.setenv("SAEV_NFS", str(tmp_path / "nfs"))
    lr = r.invoke(main, ["link-run", "r1", "--train-shards", path])
    assert lr.exit_code == 0 and lr.stdout.strip() == str(tmp_path / "nfs" / "saev" / "runs" / "r1")
    assert verify_saev(path).problems == []


@pytest.mark.parametrize("size", ["full", "empty"])
def test_a_trailing_empty_shard_as_saev_writes_it_opens_imports_and_verifies(tmp_path, size):
    store = vit_store(tmp_path / "s", n=6)
    res = export_saev(
        store, tmp_path / "d", patches_per_shard=3 * 2 * 5, progress=False
    )  # 3 examples per shard: 2 full shards
    path = res.path
    entries = json.loads((path / "shards.json").read_text())
    key = "n_ex" if res.protocol == "2.0" else "n_examples"
    assert [e[key] for e in entries] == [3, 3]
    for f in (path, path / "shards.json"):
        os.chmod(f, 0o755 if f == path else 0o644)
    (path / "shards.json").write_text(json.dumps([*entries, {"name": "acts000002.bin", key: 0}]))
    with open(path / "acts000002.bin", "wb") as f:  # saev's writer makes this extra file
        f.truncate((path / "acts000000.bin").stat().st_size if size == "full" else 0)
    assert verify_saev(path, values=True).problems == []
    saev = SaevStore(path)
    assert len(saev) == 6 and np.array_equal(
        saev[5, store.layers[0]], np.asarray(store[5, store.layers[0]], np.float32)
    )
    imported = import_saev(path, tmp_path / "imported", progress=False)
    assert len(imported) == 6
    (path / "shards.json").write_text(json.dumps([*entries, {"name": "acts000002.bin", key: 1}]))  # not empty: an error
    assert any("lists 3 shards" in p for p in verify_saev(path).problems)
