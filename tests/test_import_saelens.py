"""import-saelens: caches written the way SAELens's CacheActivationsRunner writes them
(Dataset.from_dict with its features, save_to_disk per buffer, _consolidate_shards), and
export-saelens folders (round trip: same tokens, ids and values), local and on moto's S3;
resumable; a clear error for another hook, a truncated file, a foreign folder."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner
from import_sources import SAELENS_HOOK as HOOK
from import_sources import saelens_cache

import actstore
from actstore import ActStore, ShardWriter
from actstore.cli import main
from actstore.importers import SaelensDatasetError, SaelensSource, import_saelens
from actstore.saelens import export_saelens
from actstore.storage import open_storage

pytestmark = pytest.mark.torch  # SAELens caches are written with torch


def test_a_saelens_cache_imports_exactly_in_row_order(tmp_path):
    acts, ids = saelens_cache(tmp_path)
    rep = import_saelens(tmp_path / "cache", tmp_path / "s", progress=False)
    st = ActStore(tmp_path / "s")
    assert (rep.n_parts, rep.n_examples, rep.n_tokens) == (2, 12, 96)
    assert list(st.layers) == [4] and st.dtype == "float32" and st.config.attrs["saelens"]["hook_name"] == HOOK
    for r in range(12):
        np.testing.assert_array_equal(np.asarray(st[r, 4]), acts[r])
        assert st.token_ids(r).tolist() == ids[r].tolist()


def _store_with_ids(path, n=9, d=6, dtype="float16"):
    rng = np.random.default_rng(3)
    with ShardWriter(
        path, layers=[1, 4], d_model=d, segments={"prompt": 7, "response": 3}, dtype=dtype, token_ids=True
    ) as w:
        w.append(
            prompt=rng.standard_normal((n, 2, 7, d)),
            response=rng.standard_normal((n, 2, 3, d)),
            lengths={"prompt": rng.integers(0, 8, n), "response": rng.integers(0, 4, n)},
            token_ids={"prompt": rng.integers(0, 1000, (n, 7)), "response": rng.integers(0, 1000, (n, 3))},
        )
    actstore.finalize(path)
    return ActStore(path)


def _pairs(st, layer):
    """Multiset of (token id, vector bytes as float32) of a layer."""
    out = Counter()
    for ex in range(len(st)):
        x = np.asarray(st[ex, layer], dtype=np.float32)
        for tid, row in zip(st.token_ids(ex).tolist(), x):
            out[tid, row.tobytes()] += 1
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_export_then_import_gives_the_same_tokens_ids_and_values(tmp_path, dtype):
    src = _store_with_ids(tmp_path / "src")
    export_saelens(src, tmp_path / "exp", layer=4, context_size=4, dtype=dtype, progress=False)
    res = CliRunner().invoke(
        main, ["import-saelens", str(tmp_path / "exp"), str(tmp_path / "back"), "--quiet", "--zarr-format", "3"]
    )
    assert res.exit_code == 0, res.output
    back = ActStore(tmp_path / "back")
    assert list(back.layers) == [4] and back.dtype == dtype
    want = _pairs(src, 4)
    assert sum(want.values()) > 20 and _pairs(back, 4) == want


def test_export_codes_become_token_labels(tmp_path):
    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path / "src", layers=[2], d_model=4, tokens=5, token_labels=True, dtype="float32") as w:
        w.append(rng.standard_normal((6, 1, 5, 4)), token_labels=rng.integers(0, 3, (6, 5)).astype(np.uint8))
    actstore.finalize(tmp_path / "src")
    src = ActStore(tmp_path / "src")
    export_saelens(
        src, tmp_path / "exp", layer=2, context_size=4, skip_special=False, progress=False
    )  # every token: all three codes
    import_saelens(tmp_path / "exp", tmp_path / "back", progress=False)
    back = ActStore(tmp_path / "back")
    assert back.config.token_labels and not back.config.token_ids

    def labelled(st):
        labels = st.field("tokens_token_labels")
        return Counter(
            (int(labels[ex, t]), np.asarray(st[ex, 2])[t].tobytes())
            for ex in range(len(st))
            for t in range(st.lengths(ex)["tokens"])
        )

    assert labelled(back) == labelled(src)


def test_from_s3_equals_local(tmp_path, s3_url):
    acts, ids = saelens_cache(tmp_path, dtype="float16")
    remote = open_storage(f"{s3_url}/cache")
    for p in (tmp_path / "cache").iterdir():
        remote.put(p.name, p.read_bytes())
    rep = import_saelens(f"{s3_url}/cache", tmp_path / "s", progress=False, workers=2)
    st = ActStore(tmp_path / "s")
    assert rep.n_examples == 12 and st.dtype == "float16"
    for r in range(12):
        np.testing.assert_array_equal(np.asarray(st[r, 4]), acts[r])
        assert st.token_ids(r).tolist() == ids[r].tolist()


def test_resumes_exactly_after_a_failure_inside_a_record_batch(tmp_path, monkeypatch):
    acts, ids = saelens_cache(tmp_path, n_buffers=3)
    monkeypatch.setattr("actstore.importers.saelens.BATCH_BYTES", 8 * 5 * 4)  # one row per append
    real = SaelensSource.read

    def dying(self, part, start):
        for k, b in enumerate(real(self, part, start)):
            if k == 2:
                raise KeyboardInterrupt("killed inside the first record batch")
            yield b

    monkeypatch.setattr(SaelensSource, "read", dying)
    with pytest.raises(KeyboardInterrupt):
        import_saelens(tmp_path / "cache", tmp_path / "s", progress=False, workers=1, commit_bytes=1)
    starts = []
    monkeypatch.setattr(
        SaelensSource, "read", lambda self, part, start: (starts.append(start), real(self, part, start))[1]
    )
    rep = import_saelens(tmp_path / "cache", tmp_path / "s", progress=False)
    assert (rep.n_resumed, rep.n_written, rep.n_skipped) == (1, 2, 0) and sorted(starts) == [0, 0, 2]
    st = ActStore(tmp_path / "s")
    for r in range(18):
        np.testing.assert_array_equal(np.asarray(st[r, 4]), acts[r])
        assert st.token_ids(r).tolist() == ids[r].tolist()
    again = import_saelens(tmp_path / "cache", tmp_path / "s", progress=False)  # a finished import: nothing to do
    assert (again.n_skipped, again.n_written, again.n_examples) == (3, 0, 18)


def test_another_hook_than_asked_is_refused_naming_the_file(tmp_path):
    saelens_cache(tmp_path)
    with pytest.raises(SaelensDatasetError) as e:
        import_saelens(tmp_path / "cache", tmp_path / "s", hook_name="blocks.9.hook_resid_post", progress=False)
    assert str(e.value) == (
        f"{tmp_path / 'cache'}/dataset_info.json: the dataset holds activations of ['{HOOK}'], not of "
        f"'blocks.9.hook_resid_post'; pass --hook-name {HOOK} (SAELens caches one hook per folder)"
    )
    assert not (tmp_path / "s").exists()


def test_truncated_arrow_file_is_named(tmp_path):
    saelens_cache(tmp_path)
    f = sorted((tmp_path / "cache").glob("data-*.arrow"))[1]
    f.write_bytes(f.read_bytes()[:-300])
    with pytest.raises(SaelensDatasetError, match=rf"^{f} is not a readable Arrow stream: truncated or damaged"):
        import_saelens(tmp_path / "cache", tmp_path / "s", progress=False)


def test_foreign_or_damaged_folders(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(SaelensDatasetError, match=r"x/state.json is missing: .* is not a datasets save_to_disk folder"):
        import_saelens(tmp_path / "x", tmp_path / "s", progress=False)
    saelens_cache(tmp_path)
    (tmp_path / "cache" / "dataset_info.json").write_text("{broken")
    with pytest.raises(SaelensDatasetError, match=r"cache/dataset_info.json is not valid JSON"):
        import_saelens(tmp_path / "cache", tmp_path / "s", progress=False)


def test_shapes_that_disagree_with_dataset_info_are_named(tmp_path):
    import json

    saelens_cache(tmp_path)
    info = tmp_path / "cache" / "dataset_info.json"
    doc = json.loads(info.read_text())
    doc["features"][HOOK]["shape"] = [8, 4]  # the files hold rows of 8 x 5
    info.write_text(json.dumps(doc))
    first = sorted((tmp_path / "cache").glob("data-*.arrow"))[0]
    with pytest.raises(SaelensDatasetError) as e:
        import_saelens(tmp_path / "cache", tmp_path / "s", progress=False)
    assert str(e.value) == (
        f"{first}: a record batch of 6 rows holds 240 float32 values in '{HOOK}'; "
        "dataset_info.json says 6 x 8 x 4 float32"
    )
    assert not (tmp_path / "s").exists()
