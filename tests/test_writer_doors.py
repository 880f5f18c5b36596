"""The writer's two doors: the user's `append(...)` checks its arguments and builds a Batch;
`append_batch(batch)` takes a checked Batch as it is (no second shape check, no second
non-finite screen) and stores the same bytes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from screen_count import count_screens

from actstore import ShardWriter, finalize
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
            calls = count_screens(monkeypatch)
            assert w.append_batch(batch) == range(len(w) - 3, len(w))
            assert calls[0] == 0  # the checked batch is not screened again
            monkeypatch.undo()
        assert w.nonfinite == nonfinite == {"prompt": 1}
    finalize(tmp_path / "user")
    finalize(tmp_path / "inner")
    assert _files(tmp_path / "user") == _files(tmp_path / "inner")


def test_append_screens_each_value_once(tmp_path, monkeypatch):
    with ShardWriter(tmp_path / "s", **STORE) as w:
        calls = count_screens(monkeypatch)
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


def test_the_keywords_are_the_stores_and_the_writers_and_build_the_same_store(tmp_path):
    from actstore.write.options import CONFIG_KEYWORDS, OPTION_KEYWORDS, WriterKeywords, from_keywords

    assert set(WriterKeywords.__annotations__) == set(CONFIG_KEYWORDS) | set(OPTION_KEYWORDS)
    assert not set(CONFIG_KEYWORDS) & set(OPTION_KEYWORDS)
    kw = dict(STORE, commit_bytes=2000, on_overflow="clip", stats=True)
    cfg, opts = from_keywords(None, None, kw)
    assert (cfg.layers, cfg.shard_examples, opts.commit_bytes, opts.on_overflow) == ((1, 4), 4, 2000, "clip")
    for name, spelling in (("kw", kw), ("values", {"config": cfg, "options": opts})):
        with ShardWriter(tmp_path / name, **spelling) as w:
            for b in _batches():
                w.append(b.pop("acts"), **b)
        finalize(tmp_path / name)
    assert _files(tmp_path / "kw") == _files(tmp_path / "values")
    with pytest.raises(TypeError, match=r"ShardWriter got unknown keywords \['d_modle'\]; the store's are \['layers'"):
        ShardWriter(tmp_path / "bad", layers=[0], d_modle=8, tokens=2)
    assert not (tmp_path / "bad").exists()


def _count_lease_looks(monkeypatch) -> list[int]:
    from actstore.write import lease

    looks = [0]
    real = lease._generations

    def counted(storage, shard):
        looks[0] += 1
        return real(storage, shard)

    monkeypatch.setattr(lease, "_generations", counted)
    return looks


def test_opening_a_shard_looks_at_its_lease_once(tmp_path, monkeypatch):
    looks = _count_lease_looks(monkeypatch)
    with ShardWriter(tmp_path / "s", layers=[0], d_model=4, tokens=2) as w:
        assert looks[0] == 1
        w.append(np.ones((1, 1, 2, 4), np.float32))
    assert looks[0] == 2  # and once more before the commit record (a writer taken over commits nothing)
    looks[0] = 0
    with ShardWriter(tmp_path / "s", layers=[0], d_model=4, tokens=2, overwrite=True):
        assert looks[0] == 1


def test_a_lease_taken_before_the_writer_opens_is_adopted_not_looked_up_again(tmp_path, monkeypatch):
    from actstore.capture.target import CaptureTarget
    from actstore.errors import ShardBusyError

    target = CaptureTarget(tmp_path / "s")
    looks = _count_lease_looks(monkeypatch)
    target.take_lease(0)
    assert looks[0] == 1
    with pytest.raises(ShardBusyError, match=r"shard 0 of .* is being written by another writer: pid "):
        ShardWriter(tmp_path / "s", layers=[0], d_model=4, tokens=2)  # held (by this process's capture)
    looks[0] = 0
    with pytest.raises(ValueError, match=r"lease= holds shard 0 of .*, not shard 1 of "):
        ShardWriter(tmp_path / "s", shard=1, layers=[0], d_model=4, tokens=2, lease=target._leases[0])
    with ShardWriter(tmp_path / "s", layers=[0], d_model=4, tokens=2, lease=target.lease(0)) as w:
        assert looks[0] == 0
        w.append(np.ones((1, 1, 2, 4), np.float32))
    assert sorted(p.name for p in (tmp_path / "s" / "leases").iterdir()) == []  # given back on close
    target.release_leases()  # given back already by the writer: nothing happens
    assert not (tmp_path / "s" / "leases").exists() or not list((tmp_path / "s" / "leases").iterdir())
    target.take_lease(1)  # a lease no writer adopts (its writer failed to open) goes back here
    with pytest.raises(ValueError, match="lease= holds shard 1"):
        ShardWriter(tmp_path / "s", shard=2, layers=[0], d_model=4, tokens=2, lease=target.lease(1))
    target.release_leases()
    assert list((tmp_path / "s" / "leases").iterdir()) == []
    finalize(tmp_path / "s")
