"""import-dictionary-learning: caches written the way dictionary_learning's
ActivationCache.collect writes them (memmap shards + .meta + config.json, its last shard
uncounted); exact values, every shard, resumable; damaged caches named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from import_sources import tokens_of, write_cache

from actstore import ActStore
from actstore.cli import main
from actstore.importers import DictionaryLearningCacheError, import_dictionary_learning


def test_every_shard_exactly_in_order(tmp_path):
    folder, shards = write_cache(tmp_path)
    res = CliRunner().invoke(main, ["import-dictionary-learning", str(folder), str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert "49 tokens from 3 parts" in res.output
    st = ActStore(tmp_path / "s")
    assert list(st.layers) == [5] and st.dtype == "float32" and len(st) == 3 + 3 + 2
    np.testing.assert_array_equal(tokens_of(st, 5), np.concatenate(shards))
    assert [st.lengths(ex)["tokens"] for ex in range(len(st))] == [8, 8, 7, 8, 8, 1, 8, 1]
    assert "beyond config.json's shard_count" in st.config.attrs["dictionary_learning"]["note"]


def test_the_zarr_format_defaults_to_writes_and_2_still_writes_chunk_files(tmp_path):
    folder, shards = write_cache(tmp_path, sizes=(9, 7))
    for flags, fmt in (([], 3), (["--zarr-format", "2"], 2)):
        out = tmp_path / f"s{fmt}"
        res = CliRunner().invoke(main, ["import-dictionary-learning", str(folder), str(out), "--quiet", *flags])
        assert res.exit_code == 0, res.output
        st = ActStore(out)
        assert st.config.zarr_format == fmt
        meta = sorted(p.name for p in out.glob("shards/shard-00000.zarr/arrays/*_activations/*") if p.is_file())
        # Zarr 3: metadata beside a c/ folder of shard files; Zarr 2: metadata beside one file per chunk
        assert meta == (["zarr.json"] if fmt == 3 else [".zarray", ".zattrs", "0.0.0.0", "1.0.0.0"])
        np.testing.assert_array_equal(tokens_of(st, 5), np.concatenate(shards))


def test_resumes_exactly(tmp_path, monkeypatch):
    folder, shards = write_cache(tmp_path, sizes=(40, 30))
    from actstore.importers.dictionary_learning import DictionaryLearningSource

    monkeypatch.setattr("actstore.importers.dictionary_learning.BATCH_TOKENS", 8)
    real = DictionaryLearningSource.read

    def dying(self, part, start):
        for k, b in enumerate(real(self, part, start)):
            if k == 2:
                raise KeyboardInterrupt
            yield b

    monkeypatch.setattr(DictionaryLearningSource, "read", dying)
    with pytest.raises(KeyboardInterrupt):
        import_dictionary_learning(folder, tmp_path / "s", progress=False, workers=1, commit_bytes=1)
    monkeypatch.setattr(DictionaryLearningSource, "read", real)
    rep = import_dictionary_learning(folder, tmp_path / "s", tokens_per_example=8, progress=False)
    assert rep.n_resumed == 1 and rep.n_written == 1
    np.testing.assert_array_equal(tokens_of(ActStore(tmp_path / "s"), 5), np.concatenate(shards))


def test_damaged_caches(tmp_path):
    folder, _ = write_cache(tmp_path)
    p = folder / "shard_1.memmap"
    p.write_bytes(p.read_bytes()[:-8])
    with pytest.raises(DictionaryLearningCacheError) as e:
        import_dictionary_learning(folder, tmp_path / "s", progress=False)
    assert (
        str(e.value)
        == f"{folder}/shard_1.memmap has {17 * 24 - 8} bytes; shard_1.meta says 17 x 6 float32 = {17 * 24} bytes (truncated or replaced?)"
    )
    os.remove(folder / "shard_1.memmap")
    os.remove(folder / "shard_1.meta")
    with pytest.raises(
        DictionaryLearningCacheError, match=r"holds \['shard_2.memmap', 'shard_2.meta'\] but no shard_1.memmap/.meta"
    ):
        import_dictionary_learning(folder, tmp_path / "s", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DictionaryLearningCacheError, match=r"empty/config.json is missing: pass one submodule's folder"
    ):
        import_dictionary_learning(tmp_path / "empty", tmp_path / "s", progress=False)
    folder2, _ = write_cache(tmp_path / "b")
    (folder2 / "shard_0.meta").write_text(json.dumps({"shape": [23, 7]}))
    with pytest.raises(DictionaryLearningCacheError, match=r"shard_0.meta: shape \[23, 7\]; expected \[n_tokens, 6\]"):
        import_dictionary_learning(folder2, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
