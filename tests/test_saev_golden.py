"""Golden files: a small fixed store exports to exactly the committed bytes and names.

Regenerate (only after a deliberate format change) with:
    .venv/bin/python tests/test_saev_golden.py
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import actstore
from actstore.saev import export_saev, verify_saev

GOLDEN = Path(__file__).resolve().parent / "golden"
# protocol -> where its <HASH> directory lives under tests/golden/
LOCATIONS = {"2.0": Path("saev-2.0"), "2.1": Path("saev-2.1") / "saev" / "shards"}


def golden_store(path: Path) -> actstore.ActStore:
    """5 examples, layers [1, 4], CLS + 2 patches, d_model 4, float16, per-token labels."""
    n, L, T, D = 5, 2, 3, 4
    x = (np.arange(n * L * T * D, dtype=np.float32).reshape(n, L, T, D) - 60) * 0.25  # exact in float16
    labels = (np.arange(n * T, dtype=np.uint8).reshape(n, T) % 7).astype(np.uint8)
    with actstore.ShardWriter(
        path,
        layers=[1, 4],
        d_model=D,
        tokens=T,
        token_labels=True,
        model_id="facebook/dinov2-small",
        attrs={"cls_token": True, "dataset": "/datasets/golden"},
    ) as w:
        w.append(x[:3], token_labels=labels[:3], sample_keys=[f"img{i}" for i in range(3)])
        w.append(x[3:], token_labels=labels[3:], sample_keys=[f"img{i}" for i in range(3, 5)])
    actstore.finalize(path)
    return actstore.ActStore(path)


def export_golden(store, root: Path, protocol: str):
    # patches_per_shard 12 -> 12 // (3 tokens x 2 layers) = 2 examples per shard: 2, 2, 1
    return export_saev(store, root / LOCATIONS[protocol], protocol=protocol, patches_per_shard=12, progress=False)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("protocol", ["2.0", "2.1"])
def test_export_matches_golden_files(tmp_path, protocol):
    store = golden_store(tmp_path / "store")
    res = export_golden(store, tmp_path / "out", protocol)
    want = _tree(GOLDEN / LOCATIONS[protocol])
    got = _tree(tmp_path / "out" / LOCATIONS[protocol])
    assert sorted(got) == sorted(want)  # same hash directory name, same file names
    for name in want:
        assert got[name] == want[name], f"{name} differs from the golden file"
    assert len(res.hash) == (64 if protocol == "2.0" else 8)
    # The committed golden directory itself verifies, and reads back through ActStore.
    golden_dir = GOLDEN / LOCATIONS[protocol] / res.hash
    assert verify_saev(golden_dir, values=True).problems == []
    back = actstore.open(golden_dir)
    for ex in range(5):
        for layer in (1, 4):
            np.testing.assert_array_equal(back[ex, layer], store[ex, layer].astype(np.float32))


@pytest.mark.parametrize("protocol", ["2.0", "2.1"])
def test_golden_reads_exactly_through_saev_reader(tmp_path, protocol):
    """The committed directories read exactly, independently of today's exporter."""
    from actstore.saev import SaevStore

    store = golden_store(tmp_path / "store")
    (golden_dir,) = [p for p in (GOLDEN / LOCATIONS[protocol]).iterdir() if p.is_dir()]
    back = actstore.open(golden_dir)
    assert isinstance(back, SaevStore) and back.protocol == protocol
    assert (len(back), back.layers, back.d_model, back.dtype) == (5, (1, 4), 4, "float32")
    assert back.meta["model_id"] == "facebook/dinov2-small" and back.meta["cls_token"] is True
    for ex in range(5):
        for layer in (1, 4):
            got = back[ex, layer]
            assert got.dtype == np.float32 and got.shape == (3, 4)
            np.testing.assert_array_equal(got, store[ex, layer].astype(np.float32))
            np.testing.assert_array_equal(back.segment("tokens")[ex, layer], got)
    # labels.bin holds the content tokens' labels; the CLS token (token 0) reads as label 0.
    want = store.field("tokens_token_labels").copy()
    want[:, 0] = 0
    np.testing.assert_array_equal(back.field("tokens_token_labels"), want)
    np.testing.assert_array_equal(back.field("tokens_len"), np.full(5, 3))


def _regenerate() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        store = golden_store(Path(tmp) / "store")
        for protocol, loc in LOCATIONS.items():
            top = GOLDEN / loc.parts[0]
            shutil.rmtree(top, ignore_errors=True)
            res = export_golden(store, Path(tmp) / "out", protocol)
            dst = GOLDEN / loc / res.hash
            shutil.copytree(res.path, dst)
            for p in dst.iterdir():
                os.chmod(p, 0o644)
            print(f"wrote {dst}")


if __name__ == "__main__":
    sys.exit(_regenerate())
