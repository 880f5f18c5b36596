"""Bad inputs that failed the wrong way (issue 35), each on both layouts (Zarr format 3 with
Zarr shards, format 2 chunk files): metadata edited in both of its copies (a Zarr shard
index made big-endian or moved, a shape of 10**13 examples), a store path under a regular
file, a FIFO where a text file belongs, names the store does not hold, huge integers. Each
gets its own error from the project's tree, at once (every call under a watchdog), and
nothing written before changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hostile import everything, outcome, run_cli, same

import actstore
from actstore.errors import (
    ActstoreError,
    CorruptStoreError,
    FieldNotFoundError,
    SaevOptionError,
    StorageAccessError,
)
from actstore.verify import verify_store

SH0 = "shards/shard-00000.zarr"
LAYOUTS = {"v3-sharded": {"zarr_format": 3, "shard_examples": 4}, "v2": {"zarr_format": 2}}
SAEV_OPTIONS = {"family": "clip", "ckpt": "probe/model", "dataset": "/data/probe"}  # what the store does not record


def _store(path: Path, layout: str) -> Path:
    rng = np.random.default_rng(0)
    with actstore.ShardWriter(
        path,
        layers=[0, 2],
        d_model=4,
        segments={"prompt": 5, "response": 3},
        texts=["prompt"],
        fields={"label": "int16"},
        token_labels=True,
        stats=True,
        **LAYOUTS[layout],
    ) as w:
        n = 6
        w.append(
            prompt=rng.standard_normal((n, 2, 5, 4)).astype(np.float16),
            response=rng.standard_normal((n, 2, 3, 4)).astype(np.float16),
            lengths={"prompt": rng.integers(1, 6, n), "response": rng.integers(0, 4, n)},
            token_labels={"prompt": rng.integers(0, 9, (n, 5)), "response": rng.integers(0, 9, (n, 3))},
            texts={"prompt": [f"question {i}" for i in range(n)]},
            fields={"label": np.arange(n)},
        )
    actstore.finalize(path)
    return path


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture
def store(tmp_path, layout):
    return _store(tmp_path / "s", layout)


def _edit_everywhere(store: Path, array: str, fn) -> int:
    """Edit an array's own metadata and the shard's consolidated copy alike (a careful
    forger); returns how many documents were edited."""
    edited = 0
    own = [store / SH0 / "arrays" / array / n for n in ("zarr.json", ".zarray")]
    for p in own:
        if p.exists():
            doc = json.loads(p.read_text())
            fn(doc)
            p.write_text(json.dumps(doc))
            edited += 1
    for name, inner in (("zarr.json", "consolidated_metadata"), (".zmetadata", None)):
        p = store / SH0 / name
        if not p.exists():
            continue
        doc = json.loads(p.read_text())
        table = (doc.get(inner) or {}).get("metadata") if inner else doc.get("metadata")
        for key in table or {}:
            if key in (f"arrays/{array}", f"arrays/{array}/.zarray"):
                fn(table[key])
                edited += 1
        p.write_text(json.dumps(doc))
    return edited


def _refused_everywhere(store: Path, says: str) -> None:
    """Fast verify names the problem; every read gives the project's error naming it (or, for
    reads that do not touch the array, the values as written)."""
    rep = outcome(verify_store, store)[1]
    assert not rep.ok and any(says in p.message for p in rep.errors), [p.message for p in rep.errors]
    kind, got = outcome(everything, store)
    assert kind == "error" and isinstance(got, CorruptStoreError) and says in str(got), got
    code, out = run_cli("verify", str(store))
    assert code == 1 and says in out


def test_a_zarr_shard_index_edited_to_big_endian_is_refused(tmp_path):
    store = _store(tmp_path / "s", "v3-sharded")

    def big(meta):
        meta["codecs"][0]["configuration"]["index_codecs"][0]["configuration"]["endian"] = "big"

    assert _edit_everywhere(store, "prompt_activations", big) == 2
    _refused_everywhere(store, "a Zarr shard index 'big' endian at 'end'")


def test_a_zarr_shard_index_moved_to_the_start_is_refused(tmp_path):
    store = _store(tmp_path / "s", "v3-sharded")

    def start(meta):
        meta["codecs"][0]["configuration"]["index_location"] = "start"

    assert _edit_everywhere(store, "response_activations", start) == 2
    _refused_everywhere(store, "'little' endian at 'start'")


def test_activations_edited_to_big_endian_are_refused(store, layout):
    def big(meta):
        if "dtype" in meta:  # format 2
            meta["dtype"] = ">f2"
        else:
            meta["codecs"][0]["configuration"]["codecs"][0]["configuration"]["endian"] = "big"

    assert _edit_everywhere(store, "prompt_activations", big) == 2
    _refused_everywhere(store, "dtype >f2; the store config says <f2")


@pytest.mark.parametrize("array", ["prompt_activations", "prompt_len", "label"])
def test_a_shape_of_ten_trillion_examples_in_both_copies_is_refused(store, array):
    def huge(meta):
        meta["shape"][0] = 10**13

    assert _edit_everywhere(store, array, huge) == 2
    _refused_everywhere(store, "10000000000000 examples; the shard is complete with 6")


def test_a_writer_path_under_a_regular_file_is_refused_and_the_file_kept(tmp_path, layout):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    kind, e = outcome(
        lambda: actstore.ShardWriter(f / "store", layers=[0], d_model=4, tokens=3, **LAYOUTS[layout]),
        what="ShardWriter under a file",
    )
    assert kind == "error" and isinstance(e, StorageAccessError) and isinstance(e, OSError)
    assert str(e) == (
        f"cannot create the folder {f}/store: {f} is a file, not a folder; choose a path whose folders are "
        "folders (nothing was written there)"
    )
    assert f.read_text() == "x"
    code, out = run_cli("import-saev", str(tmp_path), str(f / "deeper" / "store"))
    assert code in (1, 2) and "Traceback" not in out


def test_names_the_store_does_not_hold(store):
    st = actstore.ActStore(store)
    for call, names in (
        (lambda: st.field("nope"), "['sample_key', 'label', 'prompt_len', 'response_len', 'prompt_token_labels', "),
        (lambda: st.texts("nope"), "it has ['prompt'] (store.texts(name))"),
    ):
        kind, e = outcome(call)
        assert kind == "error" and isinstance(e, FieldNotFoundError) and isinstance(e, KeyError)
        assert "'nope'" in str(e) and names in str(e) and str(store) in str(e)
    assert list(st.texts("prompt")) == [f"question {i}" for i in range(6)]


def test_sample_and_texts_on_a_fifo_text_file_give_the_error_not_a_hang(store):
    before = actstore.ActStore(store).sample(1)
    text = store / SH0 / "text" / "prompt.jsonl"
    text.unlink()
    os.mkfifo(text)
    st = actstore.ActStore(store)
    for call in (lambda: st.sample(1), lambda: list(st.texts("prompt"))):
        kind, e = outcome(call, limit=5.0, what="a FIFO text file")
        assert kind == "error" and isinstance(e, CorruptStoreError)
        assert (
            str(e)
            == f"{text} is a FIFO (named pipe) where a file belongs; the store is damaged (run `actstore verify`)"
        )
    assert np.array_equal(st[1, 0], actstore.ActStore(store)[1, 0]) and before["lengths"] == st.lengths(1)


@pytest.mark.parametrize("budget", [10**12, 2**62])
def test_export_saev_with_a_huge_budget_fails_at_once(store, tmp_path, budget):
    kind, e = outcome(
        lambda: actstore.export_saev(
            actstore.ActStore(store),
            tmp_path / "d" / "saev" / "shards",
            patches_per_shard=budget,
            progress=False,
            **SAEV_OPTIONS,
        ),
        limit=5.0,
        what="export-saev with a huge budget",
    )
    assert kind == "error" and isinstance(e, SaevOptionError)
    assert f"patches_per_shard {budget} makes every shard file" in str(e) and "at most 1,099,511,627,776 bytes" in str(
        e
    )
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").rglob("acts*.bin"))
    code, out = run_cli(
        "export-saev",
        str(store),
        str(tmp_path / "e" / "saev" / "shards"),
        "--patches-per-shard",
        str(budget),
        *(f"--{k}={v}" for k, v in SAEV_OPTIONS.items()),
    )

    assert code == 1 and "makes every shard file" in out


def test_verify_of_a_store_whose_manifest_is_damaged_never_calls_its_statistics_safe_to_delete(store):
    stats = [p.name for p in store.glob("stats-*.npz")]
    assert stats
    (store / "manifest.json").write_text("{")
    rep = verify_store(store)
    about = [p.message for p in rep.problems if p.kind == "stale-stats"]
    assert about and all("safe to delete" not in m and "keep it" in m for m in about), about
    assert any(p.kind == "manifest" for p in rep.errors)


def test_verify_of_a_shard_whose_commit_record_is_damaged_never_calls_its_statistics_safe_to_delete(store):
    (store / SH0 / "meta" / "commit.json").write_text("[")
    rep = verify_store(store)
    about = [p.message for p in rep.problems if p.kind == "stale-stats"]
    assert about and all("safe to delete" not in m for m in about), about


def test_before_and_after_a_refused_input_the_store_reads_as_written(store, tmp_path):
    built = everything(store)
    for args in (
        [
            "export-saev",
            str(store),
            str(tmp_path / "x" / "saev" / "shards"),
            "--patches-per-shard",
            str(10**12),
            "--family",
            "clip",
        ],
        ["info", str(store)],
    ):
        run_cli(*args)
    assert same(everything(store), built)


@pytest.mark.torch  # --bias loads torch
def test_a_bias_file_that_is_not_an_npy_array_or_does_not_fit_is_named(tmp_path):
    from actstore.errors import EncoderError
    from actstore.features.encoders.sources import load_directions

    W = tmp_path / "W.npy"
    np.save(W, np.ones((4, 3), np.float32))
    for content, says in (
        (b"", "is not a readable .npy file of (F,) values"),
        (b"not an array", "is not a readable .npy file of (F,) values"),
    ):
        bias = tmp_path / "bias.npy"
        bias.write_bytes(content)
        with pytest.raises(EncoderError, match=f"--bias {bias} {says}".replace("(", r"\(").replace(")", r"\)")):
            load_directions(W, bias)
    np.save(tmp_path / "b5.npy", np.ones(5, np.float32))
    with pytest.raises(EncoderError, match=rf"the bias in {tmp_path}/b5.npy has 5 values but .* of {W} has F=3"):
        load_directions(W, tmp_path / "b5.npy")
    np.save(tmp_path / "b3.npy", np.arange(3, dtype=np.float32))
    enc = load_directions(W, tmp_path / "b3.npy")
    assert enc.b.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.torch  # loads torch
def test_weights_only_loading_is_refused_with_a_torch_older_than_2_6(tmp_path, monkeypatch):
    import torch
    from import_sources import ACTIVAULT_HOOK as HOOK
    from import_sources import write_hook

    from actstore.errors import ActivaultFormatError, EncoderError
    from actstore.features.encoders.sources import _torch_state
    from actstore.importers import import_activault

    write_hook(tmp_path, n_files=1)
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.5.1"))
    with pytest.raises(ActivaultFormatError, match=r"torch 2\.5\.1 is older than 2\.6, .*CVE-2025-32434.*\.saved\.pt"):
        import_activault(tmp_path / "run" / HOOK, tmp_path / "s", progress=False)
    with pytest.raises(EncoderError, match=r"torch 2\.5\.1 is older than 2\.6.*sae\.pt is not loaded"):
        _torch_state(tmp_path / "sae.pt")
    assert isinstance(ActivaultFormatError("x"), ActstoreError)
