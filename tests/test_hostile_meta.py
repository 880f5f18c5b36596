"""Hostile and silently wrong metadata: deeply nested JSON, a hand-edited byte order, per-sample
arrays whose metadata lie, format versions that are not exactly 1, consistent lies about
token counts, and what the writer takes (NaN in a text, a field value beyond its dtype, a
compressor of the other Zarr format). Each gives the project's error naming the file."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import faultlib as F
import numpy as np
import pytest
from hostile import everything, outcome, run_cli, same

import actstore
from actstore.errors import AppendError, CorruptStoreError, FormatVersionError
from actstore.layout.config import StoreConfig
from actstore.verify import verify_store

SH0 = "shards/shard-00000.zarr"


def edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def edit_array(store: Path, array: str, fn) -> None:
    """Edit an array's own metadata and its consolidated copy alike (a careful forger)."""
    edit(store / SH0 / "arrays" / array / ".zarray", fn)
    edit(store / SH0 / ".zmetadata", lambda d: fn(d["metadata"][f"arrays/{array}/.zarray"]))


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "rel",
    [
        "manifest.json",
        "actstore.json",
        f"{SH0}/meta/commit.json",
        f"{SH0}/.zmetadata",
        f"{SH0}/.zattrs",
        f"{SH0}/arrays/prompt_activations/.zarray",
        f"{SH0}/arrays/label/.zarray",
        f"{SH0}/arrays/label/.zattrs",
        f"{SH0}/arrays/prompt_len/.zarray",
    ],
)
def test_deeply_nested_json_is_refused(fault_store, fault_original, rel):
    store = fault_store
    built = fault_original
    (store / rel).write_text(NESTED)
    kind, got = outcome(everything, store)
    assert kind == "error" or same(got, built[1])
    if kind == "error":
        assert "nested deeper than" in str(got) or "nested deeper than" in repr(got.__cause__), str(got)
    rep = outcome(verify_store, store)[1]
    assert not rep.ok and any("nested deeper than" in p.message for p in rep.errors), [p.message for p in rep.errors]
    run_cli("info", str(fault_store))


def test_per_sample_array_metadata_nested_deeply_gives_the_projects_error(fault_store):
    store = fault_store
    (store / SH0 / "arrays/label/.zarray").write_text(NESTED)
    kind, e = outcome(lambda: actstore.ActStore(fault_store).field("label"))
    assert kind == "error" and isinstance(e, CorruptStoreError)
    assert str(e) == (
        f"{store / SH0 / 'arrays/label/.zarray'} is not valid JSON (nested deeper than JSON parsing allows); "
        "the array metadata is damaged"
    )


def test_byte_order_edit_is_refused_by_readers_and_fast_verify(fault_store):
    store = fault_store
    edit_array(fault_store, "prompt_activations", lambda d: d.__setitem__("dtype", ">f2"))
    kind, e = outcome(lambda: actstore.ActStore(fault_store)[0, 2])
    assert kind == "error"
    assert str(e) == (
        f"array {store / SH0 / 'arrays/prompt_activations'} has dtype >f2; the store config says <f2 (the byte order and "
        "width decide every value read); its metadata was altered (run `actstore verify`)"
    )
    rep = verify_store(fault_store)
    assert [(p.kind, p.message) for p in rep.errors] == [
        ("array-meta", "dtype >f2; the store config says <f2 (the byte order and width decide every value read)")
    ]


PER_SAMPLE_LIES = [
    ("label", "shape", [3], "3 examples; 6 are published"),
    (
        "label",
        "compressor",
        {"id": "zlib", "level": 1},
        "compressor {'id': 'zlib', 'level': 1}; actstore never compresses per-sample arrays",
    ),
    (
        "label",
        "dtype",
        "<i4",
        "dtype <i4; the store config says <i8 (the byte order and width decide every value read)",
    ),
    (
        "label",
        "dtype",
        ">i8",
        "dtype >i8; the store config says <i8 (the byte order and width decide every value read)",
    ),
    (
        "prompt_len",
        "dtype",
        ">i4",
        "dtype >i4; the store config says <i4 (the byte order and width decide every value read)",
    ),
    ("label", "chunks", [2], "chunk shape [2]; the format's is [8192]"),
    ("label", "fill_value", 7, "fill value 7; the format's is 0 (missing chunks read as it)"),
    ("label", "order", "F", "order 'F'; actstore writes C order"),
    (
        "label",
        "filters",
        [{"id": "delta", "dtype": "<i8"}],
        "filters [{'id': 'delta', 'dtype': '<i8'}]; actstore writes none (a filter changes every value read)",
    ),
    (
        "sample_key",
        "dtype",
        "|S32",
        "dtype |S32; the store config says |S64 (the byte order and width decide every value read)",
    ),
    ("label", "zarr_format", 2.0, "zarr_format 2.0; the store config says 2"),
]


@pytest.mark.parametrize("array, field, value, problem", PER_SAMPLE_LIES)
def test_per_sample_metadata_that_lies(fault_store, fault_original, array, field, value, problem):
    store = fault_store
    edit_array(fault_store, array, lambda d: d.__setitem__(field, value))
    kind, got = outcome(everything, store)
    assert kind == "error"
    assert (
        str(got)
        == f"array {store / SH0 / 'arrays' / array} has {problem}; its metadata was altered (run `actstore verify`)"
    )
    rep = verify_store(fault_store)
    if field == "shape":
        problem = "holds 3 values; 6 examples are published"
    else:
        problem = f"has {problem}"
    assert [(p.kind, p.message) for p in rep.errors] == [("array-meta", f"per-sample array {array} {problem}")]


@pytest.mark.parametrize("value", ["1.0", True, 1.0, "1", None])
@pytest.mark.parametrize("rel", ["manifest.json", "actstore.json", f"{SH0}/meta/commit.json", f"{SH0}/.zattrs"])
def test_format_version_must_be_exactly_1(fault_store, rel, value):
    store = fault_store

    def put(d):
        (d["actstore"] if rel.endswith(".zattrs") else d)["format_version"] = value

    edit(store / rel, put)
    if rel.endswith(".zattrs"):  # what resume and verify read
        rep = verify_store(fault_store)
        assert [p.kind for p in rep.errors] == ["shard-meta"]
        assert f"has unknown format_version {value!r}; this actstore reads version 1" in rep.errors[0].message
        return
    with pytest.raises(FormatVersionError) as ei:
        verify_store(fault_store)
    assert str(ei.value) == f"{store / rel} has unknown format_version {value!r}; this actstore reads version 1"
    if rel != "actstore.json":  # readers never open the identity file
        with pytest.raises(FormatVersionError):
            actstore.ActStore(fault_store)[0, 2]


def test_consistent_lie_about_token_counts_allocates_nothing(fault_store):
    """t_max of 2**34 in the manifest, the identity file, the shard's attributes, the array's
    metadata and the manifest's byte counts: readers would allocate 512 GiB per read."""
    store = fault_store
    T = 2**34

    def fix(cfg):
        next(s for s in cfg["segments"] if s["name"] == "prompt")["t_max"] = T

    edit(store / "actstore.json", lambda d: fix(d["config"]))
    edit(store / SH0 / ".zattrs", lambda d: fix(d["actstore"]["config"]))
    edit(store / SH0 / ".zmetadata", lambda d: fix(d["metadata"][".zattrs"]["actstore"]["config"]))

    def lie(d):
        fix(d["config"])
        per = StoreConfig.from_json(d["config"]).example_bytes()
        for s in d["shards"]:
            s["nbytes"] = s["n_examples"] * per

    edit(store / "manifest.json", lie)
    edit_array(fault_store, "prompt_activations", lambda d: d["shape"].__setitem__(2, T))
    tracemalloc.start()
    st = actstore.ActStore(fault_store)
    kind, x = outcome(lambda: st[3, 2])  # only the chunks of its 6 real tokens
    assert kind == "ok" and x.shape == (F.lengths(0, 3)["prompt"] + F.lengths(0, 3)["response"], 16)
    kind, e = outcome(lambda: st.segment("prompt").padded(3, 2))
    assert kind == "error"
    assert str(e) == (
        f"segment 'prompt' claims {T} tokens ({T // 4} chunks of 128 bytes per example and layer), but "
        f"{store / SH0 / 'arrays/prompt_activations/0.0.4294967295.0'} does not hold its last token chunk: the metadata claim "
        "more than the data on disk (reads above 67108864 bytes are checked first); run `actstore verify`"
    )
    kind, e = outcome(lambda: st[0:2, 2])
    assert kind == "error" and "does not hold its last token chunk" in str(e)
    rep = outcome(verify_store, store, deep=True)[1]
    run_cli("info", str(fault_store))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20
    assert not rep.ok


def test_nan_in_a_text_is_refused(tmp_path):
    w = actstore.ShardWriter(tmp_path / "s", zarr_format=2, shard=0, layers=[0], d_model=4, tokens=2, texts=["meta"])
    with pytest.raises(AppendError) as ei:
        w.append(np.zeros((2, 1, 2, 4), np.float16), texts={"meta": [{"score": float("nan")}, {"score": 1.0}]})
    assert str(ei.value).startswith(
        "text 'meta' holds a value that standard JSON cannot hold: Out of range float values are not JSON compliant"
    )
    w.append(np.zeros((2, 1, 2, 4), np.float16), texts={"meta": [{"score": 0.5}, {"score": 1.0}]})
    w.close()
    actstore.finalize(tmp_path / "s")
    assert list(actstore.ActStore(tmp_path / "s").texts("meta")) == [{"score": 0.5}, {"score": 1.0}]


@pytest.mark.parametrize(
    "dtype, values, message",
    [
        ("int8", [300, 1], "field 'f' holds values 1..300; its dtype int8 holds -128..127"),
        ("uint8", np.array([300, 1], np.uint16), "field 'f' holds values 1..300; its dtype uint8 holds 0..255"),
        ("int32", [2**40, 0], "field 'f' holds values 0..1099511627776; its dtype int32 holds -2147483648..2147483647"),
        ("float16", [1e6, 0.0], "field 'f' holds np.float64(1000000.0), beyond the range of its dtype float16"),
    ],
)
def test_field_values_are_range_checked(tmp_path, dtype, values, message):
    w = actstore.ShardWriter(
        tmp_path / "s", zarr_format=2, shard=0, layers=[0], d_model=4, tokens=2, fields={"f": dtype}
    )
    with pytest.raises(AppendError) as ei:
        w.append(np.zeros((2, 1, 2, 4), np.float16), fields={"f": np.array(values)})
    assert str(ei.value) == message
    w.append(np.zeros((2, 1, 2, 4), np.float16), fields={"f": np.array([1, 2], dtype=np.asarray(values).dtype)})
    w.close()
    actstore.finalize(tmp_path / "s")
    assert actstore.ActStore(tmp_path / "s").field("f").tolist() == [1, 2]


def test_compressor_of_the_other_zarr_format_is_refused_before_writing(tmp_path):
    import numcodecs
    import zarr

    with pytest.raises(ValueError) as ei:
        actstore.ShardWriter(
            tmp_path / "s", zarr_format=2, shard=0, layers=[0], d_model=4, tokens=2, compressor=zarr.codecs.ZstdCodec()
        )
    assert str(ei.value).startswith(
        "compressor ZstdCodec(level=0, checksum=False) is not a numcodecs codec; a Zarr format 2 store takes one"
    )
    with pytest.raises(ValueError, match="is not a Zarr v3 bytes-to-bytes codec"):
        actstore.ShardWriter(
            tmp_path / "s", shard=0, layers=[0], d_model=4, tokens=2, zarr_format=3, compressor=numcodecs.Zstd()
        )
    assert not (tmp_path / "s").exists()


def test_lease_with_an_endless_lifetime_is_refused():
    from actstore.layout.leases import parse_lease

    doc = {
        "shard": 0,
        "generation": 0,
        "token": "t",
        "host": "h",
        "pid": 1,
        "pid_start": None,
        "started": "",
        "renewed": 0.0,
        "ttl": float("inf"),
    }
    with pytest.raises(CorruptStoreError, match="a lease field has the wrong type"):
        parse_lease(json.dumps(doc).encode(), "lease.json")


def test_json_depth_limit_is_exact():
    from actstore.layout import jsonio

    assert jsonio.parse("[" * 64 + "1" + "]" * 64) is not None  # 64 nested containers: allowed
    for depth in (65, 200, 100_000):  # 65..~1000 were accepted before (an off-by-one); deeper: RecursionError
        with pytest.raises(ValueError, match="nested deeper than"):
            jsonio.parse("[" * depth + "]" * depth)


def test_statistics_file_claiming_huge_arrays_allocates_nothing(fault_store):
    """A few hundred bytes of .npz whose array header claims 10**12 float64 values: np.load
    allocated 8 TB (MemoryError) before reading a byte."""
    import io
    import zipfile

    store = fault_store
    name = json.loads((store / "manifest.json").read_text())["stats"]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
        zf.writestr("keys.npy", header.getvalue() + bytes(64))
    (store / name).write_bytes(buf.getvalue())
    tracemalloc.start()
    kind, e = outcome(lambda: actstore.ActStore(store).stats())
    rep = outcome(verify_store, store, deep=True)[1]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert kind == "error" and str(e).startswith(
        f"statistics file {store / name} is unreadable (member keys.npy claims"
    )
    assert [p.kind for p in rep.errors] == ["stats"] and peak < 16 * 2**20


def test_consistent_lie_about_token_counts_in_per_sample_rows(tmp_path):
    """Token labels of a segment claiming 2**34 tokens: zarr would allocate (n, 2**34) rows."""
    root = tmp_path / "s"
    with actstore.ShardWriter(root, zarr_format=2, layers=[0], d_model=4, tokens=4, token_labels=True) as w:
        w.append(np.ones((3, 1, 4, 4), np.float16), token_labels=np.ones((3, 4), np.uint8))
    actstore.finalize(root)
    T = 2**34

    def fix(cfg):
        cfg["segments"][0]["t_max"] = T

    edit(root / "actstore.json", lambda d: fix(d["config"]))
    edit(root / SH0 / ".zattrs", lambda d: fix(d["actstore"]["config"]))
    edit(root / SH0 / ".zmetadata", lambda d: fix(d["metadata"][".zattrs"]["actstore"]["config"]))

    def lie(d):
        fix(d["config"])
        d["shards"][0]["nbytes"] = 3 * StoreConfig.from_json(d["config"]).example_bytes()

    edit(root / "manifest.json", lie)
    edit_array(root, "tokens_activations", lambda d: d["shape"].__setitem__(2, T))
    edit_array(root, "tokens_token_labels", lambda d: (d["shape"].__setitem__(1, T), d.__setitem__("chunks", [1, T])))
    tracemalloc.start()
    kind, e = outcome(lambda: actstore.ActStore(root).field("tokens_token_labels"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert kind == "error" and peak < 16 * 2**20
    assert str(e) == (
        f"array {root / SH0 / 'arrays/tokens_token_labels'} claims rows of {T} bytes (3 rows: {3 * T} bytes), but its chunk "
        f"file {root / SH0 / 'arrays/tokens_token_labels/0.0'} does not hold {T} bytes: the metadata claim more than the data on "
        "disk (reads above 67108864 bytes are checked first); run `actstore verify`"
    )


def test_damaged_statistics_files_raise_only_value_error():
    """Bit flips in a zip's flags made zipfile raise NotImplementedError or RuntimeError
    (encrypted), out of ActStore.stats() and info (found by the mutation tests)."""
    from actstore.stats import RunningStats

    data = RunningStats(["layer2/prompt", "layer2/response"], 16).to_bytes()
    damaged = [data[:n] for n in range(0, len(data), 16)]
    damaged += [
        data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :] for i in range(0, len(data), 5) for bit in (0, 5, 6, 7)
    ]
    refused = 0
    for d in damaged:
        try:
            RunningStats.from_bytes(d)
        except ValueError:
            refused += 1
    assert refused > len(damaged) // 2


def test_token_labels_that_are_neither_a_bool_nor_the_kinds_mapping_are_refused():
    """A config's token_labels other than true, false or {"meaning": "kinds", "names": ...} is a
    ValueError that shows the value (the fuzz tests reach this branch only by chance)."""
    from actstore.layout.config import parse_token_labels

    assert parse_token_labels(True) == (True, None) and parse_token_labels(False) == (False, None)
    for bad in ("yes", 1, None, {"meaning": "kinds"}, {"names": {}}):
        with pytest.raises(ValueError, match=r"^token_labels must be true, false or ") as e:
            parse_token_labels(bad)
        assert str(e.value).endswith(f"Got {bad!r}."), e.value
