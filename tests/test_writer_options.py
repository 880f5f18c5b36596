"""ShardWriter's configuration and options as values: config= and options= write the same
bytes as the keywords that build them; mixing the two, or a bad option, is refused before
anything is written."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from actstore import ShardWriter, finalize
from actstore.layout.config import make_config
from actstore.write.options import WriterOptions


def _write(path, **kw):
    rng = np.random.default_rng(0)
    with ShardWriter(path, **kw) as w:
        w.append(
            rng.standard_normal((3, 2, 5, 8)).astype(np.float16),
            lengths={"prompt": [5, 2, 0]},
            fields={"label": np.array([1, 2, 3])},
        )
    finalize(path)


def _files(root):
    # Every file's bytes, the times of day written into records and attributes left out.
    stamp = re.compile(rb'"(created|updated|finalized|started|renewed)": "[^"]*"')
    return {
        p.relative_to(root).as_posix(): stamp.sub(rb"", p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_config_and_options_values_write_what_the_keywords_write(tmp_path):
    store = dict(layers=[3, 5], d_model=8, segments={"prompt": 5}, fields={"label": "int64"}, zarr_format=3)
    writer = dict(commit_bytes=100, on_overflow="clip", stats=True)
    _write(tmp_path / "kw", **store, **writer)
    _write(tmp_path / "val", config=make_config(**store), options=WriterOptions(**writer))
    a, b = _files(tmp_path / "kw"), _files(tmp_path / "val")
    assert sorted(a) == sorted(b) and len(a) > 10
    assert a == b


def test_mixing_values_and_keywords_is_refused_before_anything_is_written(tmp_path):
    cfg = make_config(layers=[1], d_model=4, tokens=2)
    with pytest.raises(
        TypeError, match=re.escape("pass config= or the store's keywords, not both: got config= and ['d_model']")
    ):
        ShardWriter(tmp_path / "a", config=cfg, d_model=4)
    with pytest.raises(
        TypeError, match=re.escape("pass options= or the writer's keywords, not both: got options= and ['fsync']")
    ):
        ShardWriter(tmp_path / "a", config=cfg, options=WriterOptions(), fsync=True)
    with pytest.raises(TypeError, match=re.escape("ShardWriter needs d_model= (or config=, a StoreConfig)")):
        ShardWriter(tmp_path / "a", layers=[1], tokens=2)
    with pytest.raises(ValueError, match=re.escape("engine must be one of ['auto', 'direct', 'zarr']. Got 'fast'.")):
        WriterOptions(engine="fast")
    with pytest.raises(ValueError, match=re.escape("io_threads must be a positive int or None. Got 0.")):
        ShardWriter(tmp_path / "a", config=cfg, io_threads=0)
    assert not (tmp_path / "a").exists()
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field .fsync."):
        WriterOptions().fsync = True  # type: ignore[misc]
