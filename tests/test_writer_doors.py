"""The writer's two doors: the user's `append(...)` checks its arguments and builds a Batch;
`append_batch(batch)` takes a checked Batch as it is (no second shape check, no second
non-finite screen) and stores the same bytes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from actstore import ShardWriter, finalize
from actstore import dtypes
from actstore.layout.config import make_config
from actstore.write import batch as batches
from actstore.write.options import WriterOptions

STORE = dict(
    layers=[1, 4],
    d_model=8,
    segments={"prompt": 6},
    fields={"label": "int64"},
    texts=["text"],
    token_labels=True,
    shard_examples=4,
)


def _files(root):
    # Every file's bytes, the times of day written into records and attributes left out.
    stamp = re.compile(rb'"(created|updated|finalized|started|renewed)": "[^"]*"')
    return {
        p.relative_to(root).as_posix(): stamp.sub(rb"", p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()
    }


def _batches():
    rng = np.random.default_rng(5)
    out = []
    for k in range(3):
        x = rng.standard_normal((3, 2, 6, 8)).astype(np.float32)
        x[0, 1, 2, 3] = np.nan if k == 1 else x[0, 1, 2, 3]  # one non-finite value, counted
        out.append(
            dict(
                acts=x,
                lengths={"prompt": np.array([6, 3, 1])},
                token_labels={"prompt": rng.integers(0, 3, (3, 6)).astype(np.uint8)},
                fields={"label": np.array([k, k + 1, k + 2])},
                texts={"text": [f"t{k}-{i}" for i in range(3)]},
            )
        )
    return out


def _count_screens(monkeypatch) -> list[int]:
    """Count the calls of the non-finite screen (every path of dtypes.convert goes through these)."""
    calls = [0]
    for name in ("count_nonfinite_16", "_count_nonfinite"):
        real = getattr(dtypes, name)

        def counted(x, _real=real):
            calls[0] += 1
            return _real(x)

        monkeypatch.setattr(dtypes, name, counted)
    return calls


def test_a_checked_batch_through_append_batch_stores_what_append_stores(tmp_path, monkeypatch):
    with ShardWriter(tmp_path / "user", stats=True, **STORE) as w:
        for kw in _batches():
            w.append(kw.pop("acts"), **kw)
        nonfinite = dict(w.nonfinite)
    cfg = make_config(**STORE)
    opts = WriterOptions(stats=True)
    with ShardWriter(tmp_path / "inner", config=cfg, options=opts) as w:
        for kw in _batches():
            batch = batches.prepare(
                cfg,
                {"prompt": kw.pop("acts")},
                source_lengths=None,
                sample_keys=None,
                first_index=len(w),
                shard=w.shard,
                on_nonfinite="count",
                on_overflow="raise",
                **kw,
            )
            calls = _count_screens(monkeypatch)
            assert w.append_batch(batch) == range(len(w) - 3, len(w))
            assert calls[0] == 0  # the checked batch is not screened again
            monkeypatch.undo()
        assert w.nonfinite == nonfinite == {"prompt": 1}
    finalize(tmp_path / "user")
    finalize(tmp_path / "inner")
    assert _files(tmp_path / "user") == _files(tmp_path / "inner")


def test_append_screens_each_value_once(tmp_path, monkeypatch):
    with ShardWriter(tmp_path / "s", **STORE) as w:
        calls = _count_screens(monkeypatch)
        kw = _batches()[0]
        w.append(kw.pop("acts"), **kw)
        # float32 -> float16: the converted values are screened (one reduction), the
        # inputs only when that finds one (none here), per segment, once.
        assert calls[0] == 1


def test_append_batch_refuses_a_closed_writer(tmp_path):
    cfg = make_config(**STORE)
    w = ShardWriter(tmp_path / "s", config=cfg)
    kw = _batches()[0]
    batch = batches.prepare(
        cfg,
        {"prompt": kw.pop("acts")},
        source_lengths=None,
        sample_keys=None,
        first_index=0,
        shard=0,
        on_nonfinite="count",
        on_overflow="raise",
        **kw,
    )
    w.close()
    with pytest.raises(ValueError, match=r"shard writer 0 of .* is closed"):
        w.append_batch(batch)
