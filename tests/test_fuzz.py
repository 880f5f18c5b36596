"""Property-based fuzzing of every parser of untrusted metadata (bounded, derandomized).

Each parser may raise only its documented error types: actstore's CorruptStoreError family
(with FormatVersionError, UnsafePathError) for store metadata, LegacyFormatError (with
UnsafePickleError) for legacy files. Anything else (KeyError, TypeError, AttributeError,
MemoryError, ...) is a bug.
"""

from __future__ import annotations

import copy
import gzip
import json
import pickle
from pathlib import Path

import faultlib as F
import numpy as np
import pytest
from factory import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actstore import ActStore
from actstore.catalog import read_blocks, read_commit, read_identity
from actstore.errors import ActstoreError, CorruptStoreError, FormatVersionError, LegacyFormatError
from actstore.layout import spec
from actstore.layout.records import parse_manifest
from actstore.legacy import parse_metadata, restricted_loads
from actstore.storage import LocalStorage
from actstore.verify import verify_store
from actstore.write.finalize import finalize, load_manifest

SETTINGS = settings(
    max_examples=examples(200),  # above the profile's 100: the hostile parsers' rarer branches
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
STORE_ERRORS = (CorruptStoreError, FormatVersionError)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(["../x", "/etc/passwd", "shard-00000.zarr", "stats.npz", "prompt", "tokens", "1.0"]),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
# values of every JSON type, hostile ones first: most bugs are a field of an unexpected type
hostile_values = st.sampled_from(
    [None, True, -1, 0, 2**64, 1.5, float("nan"), "", "x", "../x", "/abs", [], [1], ["a"], {}, {"a": 1}, [[1]]]
).map(copy.deepcopy)
any_value = hostile_values | json_values


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "store"
    F.write_shard(root, 0, 5)
    finalize(root)
    return root


@pytest.fixture(scope="module")
def working_copy(store, tmp_path_factory) -> Path:
    """One copy of the store for every example (each restores the one file it changed)."""
    return F.copy_store(store, tmp_path_factory.mktemp("v") / "s")


@pytest.fixture(scope="module")
def store_values(store) -> list[dict[int, np.ndarray]]:
    """store[ex, layer] of the pristine store, read once."""
    st_ = ActStore(store)
    return [{layer: st_[ex, layer] for layer in st_.layers} for ex in range(len(st_))]


def _paths(doc, prefix=()):
    """Every (path, container) position inside a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _mutate(doc, data):
    """Up to three random edits: replace a value, delete a key or element, or add a key."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path = data.draw(st.sampled_from(paths))
        if not path:
            return data.draw(any_value) if data.draw(st.booleans()) else doc
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = data.draw(any_value)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6))] = data.draw(any_value)
        else:
            parent.append(data.draw(any_value))
    return doc


@SETTINGS
@given(data=st.data())
def test_fuzz_parse_manifest(store, data):
    doc = json.loads((store / spec.MANIFEST_FILE).read_text())
    mutated = _mutate(doc, data)
    try:
        m = parse_manifest(json.dumps(mutated).encode(), str(store / spec.MANIFEST_FILE))
    except STORE_ERRORS:
        return
    assert m.n_examples == sum(s.n_examples for s in m.shards) <= 2**48  # what parsed is consistent


@SETTINGS
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzz_manifest_and_identity_bytes(tmp_path, raw):
    root = tmp_path / "s"
    root.mkdir(exist_ok=True)
    (root / spec.MANIFEST_FILE).write_bytes(raw)
    (root / spec.IDENTITY_FILE).write_bytes(raw)
    with pytest.raises(STORE_ERRORS):
        load_manifest(root)
    with pytest.raises(STORE_ERRORS):
        read_identity(LocalStorage(root))


@SETTINGS
@given(data=st.data())
def test_fuzz_identity_commit_and_blocks(store, tmp_path, data):
    sdir = store / "shards/shard-00000.zarr"
    root = tmp_path / "s"
    (root / "meta").mkdir(parents=True, exist_ok=True)
    ident = _mutate(json.loads((store / spec.IDENTITY_FILE).read_text()), data)
    (root / spec.IDENTITY_FILE).write_text(json.dumps(ident))
    try:
        cfg = read_identity(LocalStorage(root))
    except STORE_ERRORS:
        pass
    else:  # what parsed is a configuration a writer could have made
        assert cfg.layers and all(type(x) is int for x in cfg.layers) and len(set(cfg.layers)) == len(cfg.layers)
        assert type(cfg.d_model) is int and cfg.d_model >= 1 and cfg.dtype in spec.ACT_DTYPES
        assert cfg.segments and all(type(g.t_max) is int and g.t_max >= 1 for g in cfg.segments)
    commit = _mutate(json.loads((sdir / spec.COMMIT_FILE).read_text()), data)
    (root / spec.COMMIT_FILE).write_text(json.dumps(commit))
    try:
        rec = read_commit(LocalStorage(root))
        assert isinstance(rec.n_committed, int) and isinstance(rec.complete, bool)
    except STORE_ERRORS:
        pass
    lines = [json.loads(x) for x in (sdir / spec.BLOCKS_FILE).read_text().splitlines()]
    blocks = _mutate(lines, data)
    text = "\n".join(json.dumps(b) for b in blocks) + "\n" if isinstance(blocks, list) else json.dumps(blocks)
    (root / spec.BLOCKS_FILE).write_text(text)
    try:
        got = read_blocks(LocalStorage(root), data.draw(st.integers(0, 4)))
        assert all(b.start < b.stop for b in got)
    except STORE_ERRORS:
        pass


@settings(
    max_examples=examples(40),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzz_verify_never_crashes(working_copy, store_values, data):
    root = working_copy
    target = data.draw(
        st.sampled_from(
            [
                spec.MANIFEST_FILE,
                "shards/shard-00000.zarr/meta/commit.json",
                "shards/shard-00000.zarr/arrays/prompt_activations/.zarray",
                "shards/shard-00000.zarr/.zmetadata",
            ]
        )
    )
    original = (root / target).read_bytes()
    (root / target).write_text(json.dumps(_mutate(json.loads(original), data)))
    try:
        try:
            rep = verify_store(root, deep=True)
        except ActstoreError:
            return
        if rep.ok:  # verify passed the mutated store: then it reads exactly as before
            after = ActStore(root)
            assert len(after) == len(store_values)
            for ex, per_layer in enumerate(store_values):
                for layer, want in per_layer.items():
                    np.testing.assert_array_equal(after[ex, layer], want)
    finally:
        (root / target).write_bytes(original)  # the next example mutates the pristine copy again


def test_a_manifest_describing_another_store_is_an_identity_error_of_verify(store, tmp_path):
    """The branch that random manifests reach only by chance: a manifest whose configuration
    is not actstore.json's is named by verify (and the shard metadata disagrees with it too)."""
    root = F.copy_store(store, tmp_path / "s")
    doc = json.loads((root / spec.MANIFEST_FILE).read_text())
    doc["config"]["model_id"] = "another/model"
    (root / spec.MANIFEST_FILE).write_text(json.dumps(doc))
    rep = verify_store(root)
    assert [(p.kind, p.path) for p in rep.errors] == [
        ("identity", spec.MANIFEST_FILE),
        ("shard-meta", "shards/shard-00000.zarr/.zattrs"),
    ]
    assert rep.errors[0].message == (
        "actstore.json and manifest.json describe different stores: model_id: store has None, asked for 'another/model'"
    )


legacy_doc = {
    "version": "1.0",
    "created_at": "2025-01-09T12:00:00Z",
    "extraction_config": {
        "model_name": "m",
        "model_params": {"hidden_size": 4},
        "layers_extracted": [1, 2],
        "max_seq_length": 8,
    },
    "distributed_config": {"machine_id": 0},
    "shards": [
        {
            "shard_id": 1,
            "filename": "shard_0001.pkl.gz",
            "size_bytes": 10,
            "num_samples": 2,
            "layers": [1, 2],
            "sample_id_range": [0, 1],
            "compressed": True,
            "checksum": "sha256:" + "ab" * 32,
        }
    ],
    "statistics": {"total_shards": 1},
}


@SETTINGS
@given(data=st.data())
def test_fuzz_legacy_metadata(data):
    try:
        md = parse_metadata(_mutate(legacy_doc, data))
    except LegacyFormatError:
        return
    assert md.shards and all(set(s.layers) == set(md.layers) for s in md.shards)


def _admitted(obj) -> bool:
    """Whether `obj` is built only of plain containers, scalars and numpy arrays."""
    if isinstance(obj, dict):
        return all(_admitted(k) and _admitted(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_admitted(v) for v in obj)
    return obj is None or isinstance(obj, (str, bytes, int, float, complex, np.ndarray, np.generic, np.dtype))


_valid_pickles = [
    pickle.dumps(
        {"layer_1": [{"sample_idx": 0, "activation": np.ones((2, 3), np.float32), "shape": (2, 3)}]}, protocol=p
    )
    for p in (2, 4, 5)
]


@SETTINGS
@given(data=st.data())
def test_fuzz_restricted_unpickler(data):
    base = data.draw(st.sampled_from(_valid_pickles))
    raw = bytearray(base)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    compressed = data.draw(st.booleans())
    blob = gzip.compress(bytes(raw)) if compressed else bytes(raw)
    try:
        from actstore.legacy import load_shard_bytes

        loaded = load_shard_bytes(blob, compressed=compressed, where="fuzz", max_bytes=1 << 16)
    except LegacyFormatError:
        pass
    else:  # a damaged pickle that still loads built nothing but what the unpickler admits
        assert _admitted(loaded), repr(loaded)[:300]
    with pytest.raises(LegacyFormatError):
        restricted_loads(data.draw(st.binary(max_size=40)) + b"\x00garbage-without-stop")
