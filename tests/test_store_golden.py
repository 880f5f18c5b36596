"""Golden stores: the format cannot drift by accident.

tests/golden/store-*.tar.xz hold one tiny store of each layout (Zarr v2 with two
variable-length segments and two writer shards, Zarr v3, Zarr v3 sharded, bfloat16,
float32), written by tests/golden/make_store_golden.py. Each test extracts them to a
temporary folder and checks that
- today's reader (ActStore) returns exactly the values, lengths, keys, fields, texts,
  token labels, statistics and metadata the generator wrote, and `verify_store(deep=True)`
  finds nothing;
- zarr-python reads the activations of every writer shard;
- today's writer, given the same batches, writes every file byte for byte as the golden
  one (after the generator's normalisation of `created`, `updated` and `actstore_version`).

tests/golden/before-token-label-meaning/ keeps the stores as written before the configuration
said what token labels mean (format.md, section 3): store-v2's labels (1..9, written by a
ShardWriter) were then taken for token kinds, so its statistics cover no token (none is label
0); today they are classes and its statistics cover every real token; both read exactly, and
the old store's labels read as classes. tests/golden/before-every-chunk/ keeps the same stores as written before per-sample arrays
carried `actstore_every_chunk` (format.md, section 3), and tests/golden/before-per-sample-checksums/
as written before block records carried `per_sample_crc32c` and per-sample chunks were sized
to PER_SAMPLE_CHUNK_BYTES (they were up to 4 MiB): today's reader reads them exactly too.

Regenerate (only after a deliberate format change, and say so in the commit) with one command:
    .venv/bin/python tests/golden/make_store_golden.py
Only the public API is used here (ShardWriter, finalize, ActStore, verify_store, zarr).
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

import actstore
from actstore.verify import verify_store

GOLDEN = Path(__file__).resolve().parent / "golden"
REGENERATE = ".venv/bin/python tests/golden/make_store_golden.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_store_golden", GOLDEN / "make_store_golden.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()
NAMES = list(gen.STORES)


@functools.lru_cache(maxsize=None)
def expected(name: str):
    return gen.expected(name)


ERAS = {
    "today": GOLDEN,
    "before-token-label-meaning": GOLDEN / "before-token-label-meaning",
    "before-per-sample-checksums": GOLDEN / "before-per-sample-checksums",
    "before-every-chunk": GOLDEN / "before-every-chunk",
}


def _golden(tmp_path: Path, name: str, era: str = "today") -> Path:
    return gen.unpack(ERAS[era] / f"{name}.tar.xz", tmp_path / "golden")


def _read_dtype(dtype: str) -> np.dtype:
    """What ActStore returns for a stored dtype (bfloat16 widens exactly to float32)."""
    return np.dtype(np.float16 if dtype == "float16" else np.float32)


def test_every_layout_has_a_golden_archive():
    for folder in ERAS.values():
        on_disk = sorted(p.name.removesuffix(".tar.xz") for p in folder.glob("store-*.tar.xz"))
        assert on_disk == sorted(NAMES), f"golden archives and generator disagree; run {REGENERATE}"
    total = sum((folder / f"{n}.tar.xz").stat().st_size for folder in ERAS.values() for n in NAMES)
    assert total < 300_000, f"golden store archives take {total} bytes; keep them tiny"


@pytest.mark.parametrize("era", list(ERAS))
@pytest.mark.parametrize("name", NAMES)
def test_golden_reads_exactly(tmp_path, name, era):
    root = _golden(tmp_path, name, era)
    arrays = zarr.open_group(str(root / "shards/shard-00000.zarr/arrays"), mode="r")
    promised = {k: a.attrs.get("actstore_every_chunk") for k, a in arrays.arrays() if not k.endswith("_activations")}
    assert promised and set(promised.values()) == ({None} if era == "before-every-chunk" else {True}), promised
    blocks = [
        json.loads(line) for line in (root / "shards/shard-00000.zarr/meta/blocks.jsonl").read_text().splitlines()
    ]
    per_sample = {a.split("/")[-1] for a in promised}
    assert [set(b.get("per_sample_crc32c", ())) for b in blocks] == [
        per_sample if era in ("today", "before-token-label-meaning") else set()
    ] * len(blocks)
    exp = expected(name)
    store = actstore.ActStore(root)
    segs = list(exp.segments)
    assert len(store) == exp.n_examples
    assert store.layers == tuple(exp.layers)
    assert (store.d_model, store.dtype, store.segments) == (exp.d_model, exp.dtype, tuple(segs))
    want_dtype = _read_dtype(exp.dtype)
    for ex in range(exp.n_examples):
        lens = {s: int(exp.lengths[s][ex]) for s in segs}
        assert store.lengths(ex) == lens, f"example {ex}"
        for lp, layer in enumerate(exp.layers):
            parts = [exp.acts[s][ex, lp, : lens[s]] for s in segs]
            got = store[ex, layer]
            assert got.dtype == want_dtype, f"example {ex} layer {layer}"
            np.testing.assert_array_equal(got, np.concatenate(parts), err_msg=f"store[{ex}, {layer}]")
            for s, part in zip(segs, parts):
                np.testing.assert_array_equal(store.segment(s)[ex, layer], part, err_msg=f"segment {s} [{ex}, {layer}]")
        sample = store.sample(ex)
        assert sample["sample_key"] == exp.sample_keys[ex]
        assert sample["lengths"] == lens
        for f, values in exp.fields.items():
            assert sample[f] == values[ex].item()
        for t, values in exp.texts.items():
            assert sample[t] == values[ex]
    assert list(store.field("sample_key")) == exp.sample_keys
    for s in segs:
        got_len = store.field(f"{s}_len")
        assert got_len.dtype == np.int32
        np.testing.assert_array_equal(got_len, exp.lengths[s])
        if exp.token_labels:
            got_lab = store.field(f"{s}_token_labels")
            assert got_lab.dtype == np.uint8
            np.testing.assert_array_equal(got_lab, exp.token_labels[s])
    for f, values in exp.fields.items():
        got_f = store.field(f)
        assert got_f.dtype == values.dtype
        np.testing.assert_array_equal(got_f, values)
    for t, values in exp.texts.items():
        assert list(store.texts(t)) == values
    n = exp.n_examples
    assert store.meta == {
        "model_id": exp.model_id,
        "layers": exp.layers,
        "d_model": exp.d_model,
        "dtype": exp.dtype,
        "segments": exp.segments,
        "n_examples": n,
        "truncation": {s: {"count": c, "fraction": c / n} for s, c in exp.truncated.items()},
        "nonfinite": dict.fromkeys(segs, 0),
        "overflow": dict.fromkeys(segs, 0),
        "created": gen.FIXED_TIME,
        "actstore_version": gen.FIXED_VERSION,
        **exp.attrs,
    }
    # Statistics cover every real token, except in the stores written while any labels were
    # taken for token kinds (store-v2's are classes, so there they covered label 0: none).
    _check_stats(store, exp, content_only=era == "before-token-label-meaning")
    assert store.config.token_label_names is None  # labels, where there are any, are classes

    report = verify_store(root, deep=True)
    assert report.problems == [], report.summary()


def _check_stats(store, exp, content_only: bool = True) -> None:
    st = store.stats()
    if not exp.stats:
        assert st is None
        return
    assert st is not None
    for s in exp.segments:
        mask = np.arange(exp.acts[s].shape[2])[None, :] < exp.lengths[s][:, None]  # stored (non-padding) tokens
        if content_only and exp.token_labels:
            mask = mask & (exp.token_labels[s] == 0)  # labels read as token kinds: statistics over label 0 only
        for lp, layer in enumerate(exp.layers):
            v = exp.acts[s][:, lp][mask].astype(np.float64)  # (count, D)
            key = f"layer{layer}/{s}"
            k = st.keys.index(key)
            assert int(st.count[k]) == len(v), key
            if not len(v):
                continue
            assert (float(st.min[k]), float(st.max[k])) == (v.min(), v.max()), key
            np.testing.assert_allclose(st.mean[k], v.mean(axis=0), rtol=1e-12, atol=1e-12, err_msg=key)
            np.testing.assert_allclose(st.variance(key), v.var(axis=0), rtol=1e-9, atol=1e-12, err_msg=key)
            np.testing.assert_allclose(st.norm_sum[k], np.linalg.norm(v, axis=1).sum(), rtol=1e-12, err_msg=key)
            assert int(st.nonfinite[k]) == 0, key


def _difference(rel: str, want: bytes, got: bytes) -> str:
    """A short description of how a file differs (a unified diff for text files)."""
    try:
        a, b = want.decode("utf-8"), got.decode("utf-8")
    except UnicodeDecodeError:
        a = b = None
    if a is not None and b is not None and "\0" not in a + b:
        try:  # one-line JSON (.zmetadata): diff it pretty-printed, key by key
            a, b = (json.dumps(json.loads(t), indent=1, sort_keys=True) for t in (a, b))
        except ValueError:
            pass
        diff = difflib.unified_diff(a.splitlines(), b.splitlines(), "golden/" + rel, "written/" + rel, lineterm="", n=1)
        return "\n".join(list(diff)[:40])
    first = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
    return f"{rel}: {len(want)} bytes golden, {len(got)} written; first difference at byte {first}"


@pytest.mark.parametrize("name", NAMES)
def test_writer_reproduces_golden_bytes(tmp_path, name):
    want = gen.files(_golden(tmp_path, name))
    new_root = tmp_path / "written" / name
    gen.write_store(name, new_root)
    got = gen.files(new_root)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"{name}: today's writer no longer writes {missing} and newly writes {extra}. "
        f"If the format change is deliberate, regenerate: {REGENERATE}"
    )
    # Every file, byte for byte: metadata (.zarray, .zattrs, .zgroup, .zmetadata, zarr.json),
    # actstore.json, manifest.json, commit.json, blocks.jsonl, the crc32c file, chunk and Zarr
    # shard files, per-sample chunks, text/*.jsonl and the statistics .npz files. The .npz
    # files are deterministic: numpy writes zip members with the fixed zip epoch as their
    # time, and the generator's values make the float64 moments reproducible.
    differ = [rel for rel in sorted(want) if got[rel] != want[rel]]
    assert not differ, (
        f"{name}: {len(differ)} file(s) differ from the golden store: {differ[:10]}\n"
        + _difference(differ[0], want[differ[0]], got[differ[0]])
        + f"\nIf the format change is deliberate, regenerate: {REGENERATE}"
    )


@pytest.mark.parametrize("name", NAMES)
def test_zarr_python_reads_golden(tmp_path, name):
    root = _golden(tmp_path, name)
    exp = expected(name)
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    assert [(s["shard"], s["n_examples"]) for s in manifest["shards"]] == exp.shards
    for entry in manifest["shards"]:
        a, b = entry["start"], entry["start"] + entry["n_examples"]
        shard_dir = root / "shards" / entry["name"]
        group = zarr.open_group(shard_dir, mode="r", zarr_format=exp.zarr_format)
        for s in exp.segments:
            arr = zarr.open_array(shard_dir / "arrays" / f"{s}_activations", mode="r", zarr_format=exp.zarr_format)
            raw = arr[:]
            if exp.dtype == "bfloat16":  # stored as the raw <u2 bits of each bfloat16
                assert raw.dtype == np.dtype("<u2")
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            else:
                assert raw.dtype == np.dtype(exp.dtype)
            np.testing.assert_array_equal(raw, exp.acts[s][a:b], err_msg=f"{entry['name']} {s}_activations")
            np.testing.assert_array_equal(group[f"arrays/{s}_len"][:], exp.lengths[s][a:b])
        keys = np.asarray(group["arrays/sample_key"][:])
        if keys.dtype == np.uint8:  # format 3: (n, 64) bytes
            keys = [bytes(row).rstrip(b"\0") for row in keys]
        assert [bytes(k).decode("utf-8") for k in keys] == exp.sample_keys[a:b]
