"""Exports check the store after their read as well as before (issue 40): a store finalized
again, replaced or deleted while export-saelens or export-saev reads it is refused with a
StoreChangedError naming both states, and nothing is published (an earlier export there
stays as it was); run again on the store as it is, the export is published. (The view,
export-neuronpedia and export-delphi check through their staged folder:
tests/test_features_views.py; the feature pass: tests/test_features_faults.py.)"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import faultlib
import pytest

from actstore import finalize
from actstore.errors import StoreChangedError
from actstore.saelens import export as saelens_export
from actstore.saelens import export_saelens
from actstore.saev import export_saev, pipeline

pytestmark = pytest.mark.torch  # export-saelens streams through torch's TokenStream


@pytest.fixture
def store(tmp_path) -> Path:
    path = tmp_path / "s"
    faultlib.write_shard(path, 0, 12)
    faultlib.write_shard(path, 1, 9)
    finalize(path)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def _replace(path: Path) -> None:
    """The store at `path` replaced by another finalize of it (renamed in, as a copy would be)."""
    other = path.with_name("other")
    shutil.copytree(path, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["created"] = "2000-01-01T00:00:00"
    (other / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(path)
    other.rename(path)


def _hidden(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_export_saelens_refuses_a_store_that_changed_during_its_read(store, tmp_path, monkeypatch, change):
    out = tmp_path / "sl"
    export_saelens(store, out, layer=7, context_size=8, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    began = _sha(store)
    real, calls = saelens_export._ArrowFiles.write, []

    def write(self, x, ids):  # the first rows are written: the store changes under the export
        if not calls:
            _replace(store) if change == "replaced" else (store / "manifest.json").unlink()
        calls.append(1)
        return real(self, x, ids)

    monkeypatch.setattr(saelens_export._ArrowFiles, "write", write)
    with pytest.raises(StoreChangedError) as e:
        export_saelens(store, out, layer=7, context_size=8, overwrite=True, progress=False)
    end = "no manifest now (deleted?)" if change == "deleted" else f"manifest sha256 {_sha(store)[:12]}... at the end"
    assert str(e.value).startswith(
        f"{store} changed while export-saelens read it (manifest sha256 {began[:12]}... when the read began; "
        f"{'it has ' if change == 'deleted' else ''}{end}): nothing was published"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _hidden(tmp_path) == []
    if change == "replaced":
        monkeypatch.undo()
        res = export_saelens(store, out, layer=7, context_size=8, overwrite=True, progress=False)
        assert res.n_tokens == faultlib_tokens({0: 12, 1: 9})


def faultlib_tokens(counts: dict[int, int]) -> int:
    return sum(sum(faultlib.lengths(s, k).values()) for s, n in counts.items() for k in range(n))


def test_export_saev_refuses_a_store_that_changed_during_its_read(store, tmp_path, monkeypatch):
    began = _sha(store)
    real = pipeline.ShardPipeline.run

    def run(self):  # every shard written: the store is replaced before the export is published
        real(self)
        _replace(store)

    monkeypatch.setattr(pipeline.ShardPipeline, "run", run)
    dump = tmp_path / "dump"
    with pytest.raises(StoreChangedError) as e:
        export_saev(store, dump, **faultlib.saev_kwargs())
    assert str(e.value).startswith(
        f"{store} changed while export-saev read it (manifest sha256 {began[:12]}... when the read began; "
        f"manifest sha256 {_sha(store)[:12]}... at the end): nothing was published"
    )
    assert list(dump.iterdir()) == []  # no <HASH> directory, no stage left
    monkeypatch.undo()
    res = export_saev(store, dump, **faultlib.saev_kwargs())
    assert not res.reused and [p.name for p in dump.iterdir()] == [res.hash]
