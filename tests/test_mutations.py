"""Property tests of hostile input: random mutations of every file (and folder) of small stores
of each layout and of a saev export. After each mutation every read, verify and info must
give exactly the original values or the project's error, within a time limit per call
(tests/watchdog.py); the run prints how many mutations it tried.

Mutations: truncate, extend, flip a bit, zero, delete; replace by a folder, a FIFO or a
symbolic link (to a copy of the same bytes outside the store); JSON documents rewritten
with random values of random types at a random place, or nested deeply. A folder may be
deleted, replaced by a file or by a link.

What "exactly the original values" cannot cover, by design (docs/reliability.md, Limits):
a change that keeps a file's size is invisible to reads without checksums, so after such a
change of a data file only "no other exception, no hang" is required of plain reads; for
activation chunks (checksummed) deep verify must then report an error, or the values must
be the original ones. Per-sample arrays, texts, statistics and saev shard files carry no
checksums, so their same-size changes are only required to be read or refused cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import faultlib as F
import pytest
from hostile import everything, outcome, same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
from actstore.read.info import store_info
from actstore.saev import export_saev, verify_saev
from actstore.verify import verify_store

pytestmark = pytest.mark.slow  # every mutation of every layout, about 2 minutes

PER_LAYOUT = {"v2": 500, "v3": 400, "v3-sharded": 400, "v2-zstd": 400, "saev": 500}  # 2,200 mutations per run
# ACTSTORE_MUTATION_SEED=1 draws new random mutations each run (CI runs one fixed, derandomized set).
SEED = os.environ.get("ACTSTORE_MUTATION_SEED")
SCALE = float(
    os.environ.get("ACTSTORE_MUTATION_SCALE", "1")
)  # e.g. 0.1 for a quick local run  # 2,050 mutations per run
COUNT: dict[str, Any] = {"mutations": 0, "by_kind": {}, "by_layout": {}, "t0": None}
JSON_NAMES = (".json", ".zarray", ".zattrs", ".zgroup", ".zmetadata", ".jsonl")
SAME_SIZE = ("flip", "zero", "json-same")  # "json-same": a JSON line rewritten to the same number of bytes


# ---- the stores -------------------------------------------------------------------------
def _build(kind: str, root: Path) -> Path:
    if kind == "saev":
        from factory import vit_store

        store = vit_store(root / "vit", n=5)
        return export_saev(
            store, root / "x" / "saev" / "shards", protocol="2.1", patches_per_shard=30, progress=False
        ).path
    kw: dict[str, Any] = {
        "v2": {},
        "v3": {"zarr_format": 3},
        "v3-sharded": {"zarr_format": 3, "shard_examples": 2},
        "v2-zstd": {"compressor": __import__("numcodecs").Zstd()},
    }[kind]
    path = root / "store"
    counts = {0: 3, 1: 2} if kind == "v2" else {0: 3}
    for shard, n in counts.items():
        with F.writer(path, shard, **kw) as w:
            F.append_range(w, shard, 0, n)
    actstore.finalize(path)
    return path


class Layouts(dict):
    """The stores under test (a short repr: hypothesis prints the arguments of a failure)."""

    def __repr__(self) -> str:
        return f"Layouts({list(self)})"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """{layout: (pristine copy, working copy, original values, every path in it)}."""
    out = Layouts()
    for kind in PER_LAYOUT:
        root = tmp_path_factory.mktemp(kind.replace("-", ""))
        built = _build(kind, root)
        work = root / "work" / "saev" / "shards" / built.name if kind == "saev" else root / "work"
        shutil.copytree(built, work, symlinks=True)
        for p in work.rglob("*"):
            if p.is_file():
                os.chmod(p, 0o644)
        paths = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
        out[kind] = (built, work, everything(work), paths)
    COUNT["t0"] = time.perf_counter()
    yield out
    took = time.perf_counter() - COUNT["t0"]
    print(f"\nmutations tried: {COUNT['mutations']} in {took:.1f} s; by kind: {dict(sorted(COUNT['by_kind'].items()))}")


# ---- mutations --------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _rewrite_json(doc: Any, draw) -> Any:
    """A random place of `doc` replaced by a random value (or the whole document)."""
    value = draw(JSON_VALUES)
    if draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3)) * draw(st.sampled_from([1, 30, 300]))):
            value = [value]
    node, parent, key = doc, None, None
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)):
        parent, key = node, draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        node = node[key]
    if parent is None:
        return value
    if draw(st.booleans()) or not isinstance(parent, dict):
        parent[key] = value
    else:
        del parent[key]
    return doc


def mutate(root: Path, rel: str, draw, outside: Path) -> str:
    """Apply one random mutation to root/rel; returns its kind."""
    path = root / rel
    if path.is_dir():
        kind = draw(st.sampled_from(["delete", "file", "link"]))
        if kind == "link":
            target = outside / "dir"
            shutil.copytree(path, target)
        _remove(path)
        if kind == "file":
            path.write_bytes(b"x")
        elif kind == "link":
            path.symlink_to(target)
        return "dir-" + kind
    data = path.read_bytes()
    kinds = ["truncate", "extend", "flip", "zero", "delete", "dir", "fifo", "link"]
    if rel.endswith(JSON_NAMES):
        kinds += ["json"] * 4
    kind = draw(st.sampled_from(kinds))
    if kind == "truncate":
        path.write_bytes(data[: draw(st.integers(0, max(len(data) - 1, 0)))])
    elif kind == "extend":
        path.write_bytes(data + draw(st.binary(min_size=1, max_size=64)))
    elif kind == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        path.write_bytes(data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :])
    elif kind == "zero":
        path.write_bytes(bytes(len(data)))
    elif kind in ("delete", "dir", "fifo", "link"):
        path.unlink()
        if kind == "dir":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "link":
            (outside / "file").write_bytes(data)
            path.symlink_to(outside / "file")
    elif kind == "json":
        lines = data.split(b"\n")
        i = draw(st.integers(0, max(len(lines) - 2, 0))) if rel.endswith(".jsonl") else None
        try:
            doc = json.loads(lines[i] if i is not None else data)
        except ValueError:
            doc = None
        text = json.dumps(_rewrite_json(doc, draw)).encode()
        if i is not None:
            if len(text) == len(lines[i]):
                kind = "json-same"
            lines[i] = text
            text = b"\n".join(lines)
        path.write_bytes(text)
    return kind


def restore(pristine: Path, work: Path, rel: str) -> None:
    """Put root/rel back as it was (a file's bytes, or a whole folder)."""
    src, dst = pristine / rel, work / rel
    if dst.is_symlink() or dst.exists():
        _remove(dst)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
        for p in dst.rglob("*"):
            if p.is_file():
                os.chmod(p, 0o644)
    else:
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o644)


# ---- what must hold ---------------------------------------------------------------------
def _unchecked(layout: str, rel: str, kind: str) -> str | None:
    """None when reads must give the original values or an error; "acts" for a same-size
    change of a checksummed activation chunk (deep verify must see it); "data" for a
    same-size change of a file without checksums (only a clean read or refusal)."""
    name = rel.rsplit("/", 1)[-1]
    if kind == "delete" and layout == "saev" and name in ("labels.bin", "example_offsets.bin"):
        return "data"  # optional files of the protocol: without them the directory is another valid one
    if kind not in SAME_SIZE:
        return None
    if layout == "saev":
        return "data" if name.endswith(".bin") else None
    if "_activations/" in rel and not name.startswith("."):
        return "acts"
    if name.endswith((".jsonl", ".npz", ".u32")) or (
        "/arrays/" in rel and not name.startswith(".") and name != "zarr.json"
    ):
        return "data"
    return None


def _check_store(work: Path, original: dict, unchecked: str | None) -> None:
    kind, got = outcome(everything, work, what="read")
    reports = {}
    for deep in (False, True):
        k, rep = outcome(verify_store, work, deep=deep, what=f"verify deep={deep}")
        reports[deep] = rep if k == "ok" else None
    outcome(store_info, work, what="info")
    if kind != "ok":
        return
    if unchecked is None:
        assert same(got, original), "a read returned different values without an error"
    elif unchecked == "acts" and not same(got, original):
        deep = reports[True]
        assert deep is None or not deep.ok, "deep verify found no damage but reads return different values"


def _check_saev(work: Path, original: dict, unchecked: str | None) -> None:
    kind, got = outcome(everything, work, what="read")
    outcome(verify_saev, work, values=True, what="verify-saev")
    outcome(actstore.open, work, verify="deep", what="open verify=deep")
    if kind == "ok" and unchecked is None:
        assert same(got, original), "a read returned different values without an error"


def _property(layouts, layout: str, data, tmp_path_factory) -> None:
    pristine, work, original, paths = layouts[layout]
    rel = data.draw(st.sampled_from(paths), label="path")
    outside = tmp_path_factory.mktemp("outside")
    kind = mutate(work, rel, data.draw, outside)
    try:
        unchecked = _unchecked(layout, rel, kind)
        try:
            (_check_saev if layout == "saev" else _check_store)(work, original, unchecked)
        except BaseException as e:
            e.add_note(f"mutation: {kind} of {rel} in the {layout} store")
            raise
    finally:
        restore(pristine, work, rel)
        shutil.rmtree(outside, ignore_errors=True)
    COUNT["mutations"] += 1
    COUNT["by_kind"][kind] = COUNT["by_kind"].get(kind, 0) + 1
    COUNT["by_layout"][layout] = COUNT["by_layout"].get(layout, 0) + 1


def _settings(layout: str):
    return settings(
        max_examples=max(1, int(PER_LAYOUT[layout] * SCALE)),
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _property_test(layout: str):
    """The property test of one layout (one test function each: its own example budget)."""

    @_settings(layout)
    @given(data=st.data())
    def test(layouts, data, tmp_path_factory):
        _property(layouts, layout, data, tmp_path_factory)

    test.__name__ = f"test_mutations_of_the_{layout.replace('-', '_')}_layout"
    return test


for _layout in PER_LAYOUT:  # test_mutations_of_the_v2_layout, ..._v3_sharded_layout, ..._saev_layout
    globals()[f"test_mutations_of_the_{_layout.replace('-', '_')}_layout"] = _property_test(_layout)


def test_every_mutation_was_tried_and_the_stores_restored(layouts):
    """Runs last: the count of this run (when every property test above ran) and the
    working copies back to their pristine bytes."""
    assert sum(PER_LAYOUT.values()) >= 2000
    if SCALE == 1 and all(k in COUNT["by_layout"] for k in PER_LAYOUT):  # every property test ran in full
        assert COUNT["mutations"] >= sum(PER_LAYOUT.values())
    for pristine, work, original, paths in layouts.values():
        assert same(everything(work), original)
        for rel in paths:
            a, b = pristine / rel, work / rel
            assert stat.S_IFMT(os.lstat(a).st_mode) == stat.S_IFMT(os.lstat(b).st_mode)
            if a.is_file():
                assert a.read_bytes() == b.read_bytes()
