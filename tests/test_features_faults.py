"""`actstore features` under faults: a full disk (a real file-size limit, and ENOSPC from a
stand-in) or a failing upload keeps the older output whole and names the file; a finalize
during the pass is refused (nothing published, both states named); an
unknown encoder kind in meta.json is a FeatureError naming it; format-1 folders read as +1."""

from __future__ import annotations

import builtins
import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from feature_stores import D, make_store

import actstore
from actstore.errors import DiskFullError, FeatureError, StoreChangedError
from actstore.features.encoders import sources
from actstore.features.run import run_features
from actstore.features.topk import publish
from actstore.features.topk.tables import FEATURES, INTERVALS, META, TOP, read_meta, read_table
from actstore.storage import open_storage

pytestmark = pytest.mark.torch  # the CLI's features encodes with torch

REPO = Path(__file__).resolve().parent.parent
OURS = {TOP, FEATURES, INTERVALS, META}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def no_staging_left(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".staging-" in p.name or ".old-" in p.name]


@pytest.fixture
def store(tmp_path):
    make_store(tmp_path / "s", zarr_format=2, per_shard=30)
    return tmp_path / "s"


def test_a_file_size_limit_keeps_the_older_output_and_names_the_file(store, tmp_path):
    out = tmp_path / "feat"
    run_features(store, 0, str(out), neurons=True, top_k=2)
    before = snapshot(out)
    limit = max(len(b) for b in before.values()) + 512  # the first run's files fit, a top-k of 200 does not

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "features", str(store), "--layer", "0", "--neurons", "--top-k", "200"]
        + ["--sign", "both", "--intervals", "20", "--per-interval", "50", "--out", str(out), "--overwrite", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limited,
        timeout=300,
    )
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"actstore: error: writing the feature tables of {store}: File too large writing {out}/"), (
        line
    )
    assert ".parquet: a file-size limit (ulimit -f) was reached. Nothing was published to " in line
    assert line.endswith(
        "(an older output there is unchanged); free space there (or export elsewhere), then rerun the same command"
    )
    assert snapshot(out) == before and read_meta(out)["options"]["k"] == 2
    assert no_staging_left(tmp_path)


def test_enospc_keeps_the_older_output(store, tmp_path, monkeypatch):
    out = tmp_path / "feat"
    run_features(store, 0, str(out), neurons=True, top_k=3)
    before = snapshot(out)
    real_open = builtins.open

    def full_disk_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if "w" in mode and str(path).endswith(INTERVALS):
            f.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return f

    monkeypatch.setattr(publish, "open", full_disk_open, raising=False)
    with pytest.raises(DiskFullError) as e:
        run_features(store, 0, str(out), neurons=True, top_k=5, sign="both")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out / INTERVALS)
    assert f"No space left on device writing {out / INTERVALS}: the disk or quota is full" in str(e.value)
    assert snapshot(out) == before and no_staging_left(tmp_path)
    monkeypatch.undo()
    meta = run_features(store, 0, str(out), neurons=True, top_k=5, sign="both")  # the rerun replaces it whole
    assert read_meta(out) == meta and meta["options"]["sign"] == "both" and set(snapshot(out)) == OURS
    assert {n: __import__("hashlib").sha256(b).hexdigest() for n, b in snapshot(out).items() if n != META} == meta[
        "files"
    ]


def test_other_files_in_the_folder_are_kept(store, tmp_path):
    out = tmp_path / "feat"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "a.txt").write_text("mine")
    (out / "readme.txt").write_text("also mine")
    (out / TOP).write_text("an older table")
    meta = run_features(store, 0, str(out), neurons=True, top_k=2)
    assert sorted(p.name for p in out.iterdir()) == sorted(OURS | {"notes", "readme.txt"})
    assert (out / "notes" / "a.txt").read_text() == "mine" and (out / "readme.txt").read_text() == "also mine"
    assert read_meta(out) == meta and no_staging_left(tmp_path)
    (out / "x").write_text("")
    (tmp_path / "file").write_text("")
    with pytest.raises(FeatureError, match="is a file: give --out a folder"):
        run_features(store, 0, str(tmp_path / "file"), neurons=True, top_k=2)


def test_a_failed_upload_keeps_the_older_output_on_s3(store, s3_url, monkeypatch):
    out = s3_url.rsplit("/", 1)[0] + "/feat"
    run_features(store, 0, out, neurons=True, top_k=2)
    st = open_storage(out)
    before = {n: st.get(n) for n in OURS}
    cls = type(st)
    real_put = cls.put

    def failing_put(self, key, *parts, **kw):
        if ".staging-" in key and key.endswith(FEATURES):
            raise OSError(errno.EIO, "the upload failed")
        return real_put(self, key, *parts, **kw)

    monkeypatch.setattr(cls, "put", failing_put)
    with pytest.raises(OSError, match=f"Input/output error writing {out}/{FEATURES}; the disk reported an I/O error"):
        run_features(store, 0, out, neurons=True, top_k=4)
    monkeypatch.undo()
    assert {n: st.get(n) for n in OURS} == before
    assert not [e for e in st.list() if ".staging-" in e.key]
    meta = run_features(store, 0, out, neurons=True, top_k=4, sign="negative")
    assert read_meta(out) == meta and set(read_table(out, TOP).column("sign").to_pylist()) == {-1}
    assert not [e for e in st.list() if ".staging-" in e.key]


def _shard(path, shard: int, n: int) -> None:
    """Shard `shard` of a 3-writer store like make_store's, n examples."""
    rng = np.random.default_rng(shard)
    with actstore.ShardWriter(
        path,
        shard=shard,
        layers=[0, 2],
        d_model=D,
        segments={"prompt": 5, "response": 3},
        token_labels=True,
        zarr_format=2,
        world_size=3,
        t_chunk={"prompt": 2, "response": 3},
    ) as w:
        w.append(
            prompt=rng.standard_normal((n, 2, 5, D)).astype(np.float16),
            response=rng.standard_normal((n, 2, 3, D)).astype(np.float16),
            lengths={"prompt": rng.integers(0, 6, n), "response": rng.integers(0, 4, n)},
            token_labels={"prompt": np.zeros((n, 5), np.uint8), "response": np.zeros((n, 3), np.uint8)},
        )


def test_a_finalize_during_the_pass_is_refused_naming_both_states(tmp_path):
    path = tmp_path / "s"
    _shard(path, 0, 40)
    _shard(path, 1, 40)
    actstore.finalize(path, allow_partial=True)  # shard 2 not written yet
    opened = (path / "manifest.json").read_bytes()
    store = actstore.ActStore(path)
    done = []

    def finalize_again(n):  # during the pass, the last writer adds its shard and the store is finalized
        if not done:
            done.append(n)
            _shard(path, 2, 9)
            actstore.finalize(path)

    out = tmp_path / "feat"
    with pytest.raises(StoreChangedError) as e:
        run_features(path, 0, str(out), neurons=True, store=store, progress=finalize_again)
    sha = __import__("hashlib").sha256
    now = sha((path / "manifest.json").read_bytes()).hexdigest()
    assert done and actstore.open(path).manifest.n_examples == 89
    assert str(e.value).startswith(
        f"{path} changed while the feature pass read it (manifest sha256 {sha(opened).hexdigest()[:12]}... when the "
        f"read began; manifest sha256 {now[:12]}... at the end): nothing was published"
    )
    assert not out.exists() and no_staging_left(tmp_path)
    meta = run_features(path, 0, str(out), neurons=True)  # the rerun reads the state as it is now
    assert meta["store"]["sha256"] == now and meta["store"]["n_examples"] == 89


def test_an_unknown_encoder_kind_is_a_feature_error_naming_it(store, tmp_path):
    out = tmp_path / "feat"
    run_features(store, 0, str(out), neurons=True, top_k=2)
    meta = json.loads((out / META).read_text())
    for bad, says in (
        ({**meta["encoder"], "kind": "magic"}, r"encoder.kind must be one of \['neurons', 'saelens', 'saev', "),
        ({"kind": "saelens"}, r"meta.json's encoder \(kind 'saelens'\) names no path"),
        ("neurons", r"encoder.kind must be one of .* Got None"),
    ):
        with pytest.raises(FeatureError, match=says):
            sources.from_meta(bad, D)
    from actstore.features.views.site import encoder_from_meta

    meta["encoder"]["kind"] = "magic"
    with pytest.raises(FeatureError, match=r"Got 'magic': the folder was not written by this version"):
        encoder_from_meta(meta, actstore.open(store))
    assert sources.from_meta({"kind": "neurons"}, D).n_features == D


def test_a_format_1_folder_reads_as_the_positive_tail(store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "old"
    out.mkdir()
    pq.write_table(pa.table({"feature": pa.array([0, 0], pa.int32()), "rank": pa.array([0, 1], pa.int32())}), out / TOP)
    (out / META).write_text(json.dumps({"format": "actstore-features/1"}))
    t = read_table(out, TOP)
    assert t.column_names == ["feature", "sign", "rank"] and t.column("sign").to_pylist() == [1, 1]
    assert t.schema.field("sign").type == pa.int8() and read_meta(out)["format"] == "actstore-features/1"
    (out / META).write_text(json.dumps({"format": "actstore-features/9"}))
    with pytest.raises(FeatureError, match=r"format must be one of \['actstore-features/1', 'actstore-features/2'\]"):
        read_meta(out)
