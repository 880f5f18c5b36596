"""export_saev: every exported vector equals the store's value in float32, read with the
seed's offset formula; options; idempotence, overwrite, atomicity; clear errors."""

from __future__ import annotations

import json
import os
import stat
import warnings

import numpy as np
import pytest
from factory import text_store, vit_store
from saev_checks import expected_labels, expected_rows, seed_read_vector

import actstore
from actstore.errors import LayerNotFoundError, SegmentNotFoundError
from actstore.saev import SaevExistsError, SaevOptionError, export_saev, verify_saev
from actstore.saev import pipeline as pipeline_mod

CASES = [
    # (kind, dtype, protocol, options, store options)
    ("vit", "float16", "2.0", {"patches_per_shard": 30}, {"cls": True}),
    ("vit", "bfloat16", "2.1", {"patches_per_shard": 42, "layers": [5]}, {"cls": False}),
    ("vit", "float32", "2.0", {"patches_per_shard": 20, "cls": "drop"}, {"cls": True, "t_chunk": 2}),
    ("vit", "float32", "2.1", {"patches_per_shard": 40, "layers": [5, 2]}, {"cls": True, "n_shards": 3}),
    ("vit", "float16", "2.0", {"patches_per_shard": 50}, {"cls": True, "zarr_format": 3, "shard_examples": 4}),
]
# Stores with padded (text) segments: real tokens only, packed tokens_per_example (default 1) to an example.
# keep_special: every real token (text_store's labels 1..8 would leave none under the default content mask;
# tests/test_default_mask.py covers that default).
LLM_CASES = [
    (
        "float32",
        "2.1",
        {"patches_per_shard": 50, "family": "clip", "dataset": "/datasets/text", "keep_special": True},
        {},
    ),
    (
        "float16",
        "2.0",
        {
            "patches_per_shard": 17,
            "family": "clip",
            "dataset": "/d",
            "segments": ["response"],
            "tokens_per_example": 3,
            "keep_special": True,
        },
        {"t_chunk": 3},
    ),
    (
        "bfloat16",
        "2.0",
        {
            "patches_per_shard": 60,
            "family": "siglip",
            "dataset": "/d",
            "segments": ["response", "prompt"],
            "layers": [3],
            "tokens_per_example": 4,
            "keep_special": True,
        },
        {},
    ),
]


@pytest.mark.parametrize("dtype,protocol,opts,sopts", LLM_CASES)
def test_text_stores_export_real_tokens_only_packed(tmp_path, dtype, protocol, opts, sopts):
    store = text_store(tmp_path / "store", dtype=dtype, **sopts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = export_saev(store, _dump(tmp_path, protocol), protocol=protocol, progress=False, **opts)
    assert verify_saev(res.path, values=True).problems == []
    md = json.loads((res.path / "metadata.json").read_text())
    layers, segments = opts.get("layers", list(store.layers)), opts.get("segments", list(store.segments))
    T = opts.get("tokens_per_example", 1)
    assert md["cls_token"] is False and md["patches_per_ex" if protocol == "2.0" else "content_tokens_per_example"] == T
    stream = {
        layer: np.concatenate(
            [np.asarray(store.segment(s)[ex, layer], np.float32) for ex in range(len(store)) for s in segments]
        )
        for layer in layers
    }
    n_tokens = len(stream[layers[0]])
    n = n_tokens // T
    assert md["n_ex" if protocol == "2.0" else "n_examples"] == n
    assert (n_tokens % T != 0) == any("do not fill an exported example" in str(w.message) for w in caught)
    for i in range(n):
        for layer in layers:
            got = np.stack([seed_read_vector(res.path, i, layer, t) for t in range(T)])
            np.testing.assert_array_equal(got, stream[layer][i * T : (i + 1) * T])  # no padding, in store order
    offsets = np.fromfile(res.path / "example_offsets.bin", dtype="<i8")
    lengths = [sum(store.lengths(ex)[s] for s in segments) for ex in range(len(store))]
    assert offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    labels = np.fromfile(res.path / "labels.bin", dtype=np.uint8).reshape(n, T)
    lab_stream = np.concatenate(
        [store.field(f"{s}_token_labels")[ex, : store.lengths(ex)[s]] for ex in range(len(store)) for s in segments]
    )
    np.testing.assert_array_equal(labels.reshape(-1), lab_stream[: n * T])


def _dump(tmp_path, protocol):
    return tmp_path / "scratch" / "saev" / "shards" if protocol == "2.1" else tmp_path / "dump"


@pytest.mark.parametrize("kind,dtype,protocol,opts,sopts", CASES)
def test_every_vector_equals_the_store_in_float32(tmp_path, kind, dtype, protocol, opts, sopts):
    make = vit_store if kind == "vit" else text_store
    store = make(tmp_path / "store", dtype=dtype, **sopts)
    res = export_saev(store, _dump(tmp_path, protocol), protocol=protocol, progress=False, **opts)
    assert verify_saev(res.path, values=True).problems == []
    md = json.loads((res.path / "metadata.json").read_text())
    layers = opts.get("layers", list(store.layers))
    segments = opts.get("segments", list(store.segments))
    cls = opts.get("cls") or ("keep" if sopts.get("cls") else "none")
    assert md["layers"] == layers and md["cls_token"] == (cls == "keep") and md["protocol"] == protocol
    T = (md["patches_per_ex"] if protocol == "2.0" else md["content_tokens_per_example"]) + md["cls_token"]
    S = opts["patches_per_shard"] // (T * len(layers))
    n = len(store)
    assert n % S != 0, "the case must leave a short last shard"
    for ex in range(n):
        for layer in layers:
            want = expected_rows(store, ex, layer, segments, cls)
            assert want.shape == (T, store.d_model)
            got = np.stack([seed_read_vector(res.path, ex, layer, t) for t in range(T)])
            np.testing.assert_array_equal(got, want)
    # The last file is full size; its count is in shards.json only.
    entries = json.loads((res.path / "shards.json").read_text())
    key = "n_ex" if protocol == "2.0" else "n_examples"
    assert [e[key] for e in entries] == [S] * (n // S) + [n % S]
    for e in entries:
        assert (res.path / e["name"]).stat().st_size == S * len(layers) * T * store.d_model * 4
        assert stat.S_IMODE((res.path / e["name"]).stat().st_mode) == 0o444
    labels = np.fromfile(res.path / "labels.bin", dtype=np.uint8).reshape(n, T - md["cls_token"])
    np.testing.assert_array_equal(labels, expected_labels(store, segments, cls))


def test_last_shard_padding_is_sparse(tmp_path):
    store = vit_store(tmp_path / "s", n=3, d_model=256, tokens=4, labels=False)
    res = export_saev(store, tmp_path / "d", patches_per_shard=8 * 1000, progress=False)  # 1000 examples per shard
    f = res.path / "acts000000.bin"
    assert f.stat().st_size == 1000 * 2 * 4 * 256 * 4
    assert f.stat().st_blocks * 512 < 200_000  # 3 examples of data (24 KiB), the rest a hole
    assert not (res.path / "labels.bin").exists()


def test_rerun_returns_the_same_directory_untouched_and_overwrite_replaces_it(tmp_path):
    store = vit_store(tmp_path / "s")
    a = export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in a.path.iterdir()}
    b = export_saev(store.path, tmp_path / "d", patches_per_shard=30, progress=False)
    assert (a.reused, b.reused, b.path) == (False, True, a.path)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in b.path.iterdir()} == before
    c = export_saev(store, tmp_path / "d", patches_per_shard=30, overwrite=True, progress=False)
    assert c.path == a.path and not c.reused
    after = {p.name: p.stat().st_ino for p in c.path.iterdir()}
    assert set(after) == set(before) and all(after[k] != before[k][0] for k in after)
    assert verify_saev(c.path).problems == []
    assert sorted(os.listdir(tmp_path / "d")) == [a.hash]  # no temporary directory left


def test_different_configurations_get_different_hashes(tmp_path):
    store = vit_store(tmp_path / "s")
    other = vit_store(tmp_path / "s2", seed=7)  # same configuration, other values
    base = export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False)
    variants = [
        export_saev(store, tmp_path / "d", patches_per_shard=40, progress=False),
        export_saev(store, tmp_path / "d", patches_per_shard=30, layers=[5], progress=False),
        export_saev(store, tmp_path / "d", patches_per_shard=30, cls="drop", progress=False),
        export_saev(store, tmp_path / "d", patches_per_shard=30, ckpt="other/ckpt", progress=False),
        export_saev(other, tmp_path / "d", patches_per_shard=30, progress=False),
    ]
    hashes = [base.hash] + [v.hash for v in variants]
    assert len(set(hashes)) == len(hashes)
    assert sorted(os.listdir(tmp_path / "d")) == sorted(hashes)


def test_an_existing_damaged_directory_is_refused_without_overwrite(tmp_path):
    store = vit_store(tmp_path / "s")
    res = export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False)
    os.chmod(res.path / "acts000001.bin", 0o644)
    os.truncate(res.path / "acts000001.bin", 100)
    with pytest.raises(SaevExistsError) as e:
        export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False)
    assert str(e.value) == (
        f"{res.path} already exists but does not verify (acts000001.bin: 100 bytes, expected 960 (examples_per_shard 3 "
        "x 2 layers x 5 tokens x 8 d_model x 4 bytes; the last shard too is full size, zero-padded)); "
        "pass overwrite=True (--overwrite) to rebuild it"
    )
    assert export_saev(store, tmp_path / "d", patches_per_shard=30, overwrite=True, progress=False).reused is False
    assert verify_saev(res.path).problems == []


def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    store = vit_store(tmp_path / "s")
    calls = []

    def failing_write(fd, parts):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return os.write(fd, b"".join(bytes(memoryview(p).cast("B")) for p in parts))

    monkeypatch.setattr(pipeline_mod, "write_all", failing_write)
    with pytest.raises(OSError, match="No space left"):
        export_saev(store, tmp_path / "d", patches_per_shard=30, batch_bytes=1, progress=False)
    assert os.listdir(tmp_path / "d") == []


def test_small_batches_and_one_worker_give_the_same_bytes(tmp_path):
    store = text_store(tmp_path / "s", dtype="float16", t_chunk=4)
    kw = dict(patches_per_shard=50, family="clip", dataset="/d", keep_special=True, progress=False)
    a = export_saev(store, tmp_path / "a", **kw)
    b = export_saev(store, tmp_path / "b", workers=1, batch_bytes=1, **kw)
    assert a.hash == b.hash
    for p in a.path.iterdir():
        assert (b.path / p.name).read_bytes() == p.read_bytes()


def test_metadata_defaults_come_from_the_store_and_options_override_them(tmp_path):
    store = vit_store(
        tmp_path / "s",
        attrs={"family": "clip", "ckpt": "hf-hub:x/y", "data": {"__class__": "ImageFolder", "root": "/img"}},
    )
    md = export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False).metadata
    assert (md["family"], md["ckpt"], md["dataset"], md["data"]) == (
        "clip",
        "hf-hub:x/y",
        "/datasets/images",
        {"__class__": "ImageFolder", "root": "/img"},
    )
    md = export_saev(
        store,
        tmp_path / "d",
        patches_per_shard=30,
        family="siglip",
        ckpt="c",
        dataset="rel",
        data='{"__class__": "X"}',
        progress=False,
    ).metadata
    assert (md["family"], md["ckpt"], md["dataset"], md["data"]) == (
        "siglip",
        "c",
        os.path.abspath("rel"),
        {"__class__": "X"},
    )
    md = export_saev(
        store,
        tmp_path / "x" / "saev" / "shards",
        protocol="2.1",
        patches_per_shard=30,
        pixel_agg="prefer-fg",
        progress=False,
    ).metadata
    assert list(md) == [
        "family",
        "ckpt",
        "layers",
        "content_tokens_per_example",
        "cls_token",
        "d_model",
        "n_examples",
        "max_tokens_per_shard",
        "data",
        "dataset",
        "pixel_agg",
        "dtype",
        "protocol",
    ]
    assert (md["data"], md["pixel_agg"], md["n_examples"], md["content_tokens_per_example"]) == (
        '{"__class__":"ImageFolder","root":"/img"}',
        "prefer-fg",
        13,
        4,
    )


def test_family_is_guessed_from_the_model_id(tmp_path):
    store = vit_store(tmp_path / "s", model_id="embedded:dinov2-s14")
    assert export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False).metadata["family"] == "dinov2"


@pytest.mark.parametrize(
    "kwargs,store_kw,message",
    [
        (
            {"family": "llama"},
            {},
            "family 'llama' is not a saev protocol 2.0 family; saev accepts only ['clip', 'siglip', 'dinov2']: pass one with --family",
        ),
        (
            {},
            {"model_id": "meta/llama-3"},
            "the store does not record its model family (attrs['family']) and its model_id 'meta/llama-3' names none; pass family (--family), one of ['clip', 'siglip', 'dinov2']",
        ),
        (
            {},
            {"cls": None},
            "the store does not say whether token 0 is a CLS token (no boolean attrs['cls_token']); pass cls (--cls): 'keep' (CLS exported at token 0), 'drop' (CLS left out) or 'none' (no CLS: every token is content)",
        ),
        (
            {"patches_per_shard": 9},
            {},
            "patches_per_shard 9 is smaller than one example (5 tokens x 2 layers = 10); raise it to at least 10",
        ),
        ({"pixel_agg": "majority"}, {}, "pixel_agg exists only in protocol 2.1; drop it or pass protocol='2.1'"),
        (
            {"protocol": "2.1"},
            {},
            "protocol 2.1 directories must sit at .../saev/shards/<hash> (saev's loaders check); dump_to {d} does not end in saev/shards: pass e.g. {d}/saev/shards",
        ),
        (
            {"labels": True},
            {"labels": False},
            "the store has no per-token labels (it was written without token_labels=True); export without labels",
        ),
        (
            {},
            {"attrs": {"dataset": None}},
            "the store does not record its dataset root (attrs['dataset']); pass dataset (--dataset), the absolute path of the original data set (saev links it for visuals)",
        ),
        (
            {"data": {"root": "/x"}},
            {},
            "data must be an object with a string '__class__' field naming the dataset config class (protocol 2.0 stores dataclasses.asdict(cfg.data) plus __class__). Got {'root': '/x'}.",
        ),
        ({"cls": "first"}, {}, "cls must be one of ['keep', 'drop', 'none']. Got 'first'."),
        ({"protocol": "3.0"}, {}, "protocol must be one of ['2.0', '2.1']. Got '3.0'."),
    ],
)
def test_bad_options_are_clear_errors(tmp_path, kwargs, store_kw, message):
    store = vit_store(tmp_path / "s", **store_kw)
    d = tmp_path / "d"
    with pytest.raises(SaevOptionError) as e:
        export_saev(store, d, progress=False, **{"patches_per_shard": 30, **kwargs})
    assert str(e.value) == message.replace("{d}", str(d))
    assert not d.exists() or os.listdir(d) == []


def test_every_missing_export_option_is_named_at_once(tmp_path):
    """A store written from Python records no saev metadata: one attempt names --cls, --family,
    --ckpt and --dataset together (not one per run)."""
    from click.testing import CliRunner

    from actstore.cli import main

    store = vit_store(tmp_path / "s", cls=None, model_id=None, attrs={"dataset": None})
    with pytest.raises(SaevOptionError) as e:
        export_saev(store, tmp_path / "d", progress=False)
    assert str(e.value).startswith("4 export options need a value: the store does not say whether token 0")
    res = CliRunner().invoke(main, ["export-saev", str(store.path), "--out", str(tmp_path / "d")])
    assert res.exit_code == 1 and len(res.output.splitlines()) == 1, res.output
    assert [f for f in ("--cls", "--family", "--ckpt", "--dataset") if f"pass {f}" not in res.output] == []
    given = ["--cls", "keep", "--family", "dinov2", "--ckpt", "x/y", "--dataset", str(tmp_path)]
    ok = CliRunner().invoke(main, ["export-saev", str(store.path), "--out", str(tmp_path / "d"), *given, "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["examples"] == len(store), ok.output


def test_unknown_layer_and_segment_name_what_exists(tmp_path):
    store = text_store(tmp_path / "s")
    with pytest.raises(LayerNotFoundError, match=r"layer 2 is not stored; this store holds layers \[1, 3\]"):
        export_saev(store, tmp_path / "d", layers=[2], family="clip", dataset="/d", progress=False)
    with pytest.raises(
        SegmentNotFoundError, match=r"segment 'answer' is not in this store; it has segments \['prompt', 'response'\]"
    ):
        export_saev(store, tmp_path / "d", segments=["answer"], family="clip", dataset="/d", progress=False)


def test_dump_to_defaults_to_saev_scratch(tmp_path, monkeypatch):
    store = vit_store(tmp_path / "s")
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path / "scratch"))
    res = export_saev(store, protocol="2.1", patches_per_shard=30, progress=False)
    assert res.path == tmp_path / "scratch" / "saev" / "shards" / res.hash and len(res.hash) == 8
    monkeypatch.delenv("SAEV_SCRATCH")
    with pytest.raises(SaevOptionError, match=r"no dump_to given and \$SAEV_SCRATCH is not set"):
        export_saev(store, progress=False)


def test_top_level_api_is_exported():
    assert actstore.export_saev is export_saev and actstore.verify_saev is verify_saev


@pytest.mark.torch  # torch's half cast
def test_torch_and_numpy_half_conversions_give_the_same_bytes(tmp_path, monkeypatch):
    store = vit_store(tmp_path / "s", dtype="float16", cls=True, t_chunk=2)
    kw = dict(patches_per_shard=30, cls="drop", progress=False)
    real = pipeline_mod._half_converter
    monkeypatch.setattr(pipeline_mod, "_half_converter", lambda nbytes: None)  # numpy's cast
    a = export_saev(store, tmp_path / "numpy", **kw)
    monkeypatch.setattr(pipeline_mod, "_half_converter", real)
    monkeypatch.setattr(pipeline_mod, "TORCH_HALF_MIN_BYTES", 0)
    assert pipeline_mod._half_converter(10) is not None  # torch is a dev dependency
    b = export_saev(store, tmp_path / "torch", **kw)
    assert a.hash == b.hash
    for p in a.path.iterdir():
        assert (b.path / p.name).read_bytes() == p.read_bytes()


def test_a_saev_directory_is_not_exported_again(tmp_path):
    store = vit_store(tmp_path / "s", n=4)
    res = export_saev(store, tmp_path / "d", patches_per_shard=30, progress=False)
    with pytest.raises(
        SaevOptionError, match=r"is not an actstore store \(a saev directory cannot be exported again\)"
    ):
        export_saev(res.path, tmp_path / "e", progress=False)


def test_the_default_protocol_is_what_saev_reads_where_it_can_read_it(tmp_path, monkeypatch):
    store = vit_store(tmp_path / "s")
    assert export_saev(store, tmp_path / "scratch" / "saev" / "shards", progress=False).protocol == "2.1"
    assert (
        export_saev(store, tmp_path / "elsewhere", progress=False).protocol == "2.0"
    )  # saev's loaders need .../saev/shards
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path / "env"))
    res = export_saev(store, progress=False)  # the default place: $SAEV_SCRATCH/saev/shards
    assert res.protocol == "2.1" and res.path.parent == tmp_path / "env" / "saev" / "shards"


def test_one_options_value_exports_what_the_keywords_export(tmp_path):
    from actstore.saev import SaevExportOptions

    store = vit_store(tmp_path / "store", n=5, dtype="float16")
    kw = dict(protocol="2.0", patches_per_shard=30, layers=[5], cls="drop", progress=False)
    by_kw = export_saev(store, tmp_path / "a", **kw)
    by_value = export_saev(store, tmp_path / "b", options=SaevExportOptions(**kw))
    assert by_value.path.name == by_kw.path.name and not by_value.reused
    for f in sorted(p.name for p in by_kw.path.iterdir()):
        assert (by_value.path / f).read_bytes() == (by_kw.path / f).read_bytes(), f
    with pytest.raises(
        SaevOptionError, match=r"pass options= or the export's keywords, not both: got options= and \['workers'\]"
    ):
        export_saev(store, tmp_path / "c", options=SaevExportOptions(**kw), workers=3)
    assert not (tmp_path / "c").exists()
