"""The token streams' API: one StreamSpec checked once, the public StreamPosition a loader
advances (and checkpoints of the format written before it load), the named constructors
and the classes they return, and the deprecated keywords (a warning, the same batches)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from factory import pairs_store, plain_vit_store

from actstore.loaders.spec import StreamOptions
from actstore.torch import (
    AlignedTokenStream,
    BaseTokenStream,
    FollowStream,
    StreamPosition,
    StreamSpec,
    TokenStream,
)


def test_the_spec_is_checked_once_and_frozen():
    spec = StreamSpec(batch_size=5, seed=3, layers=[0])
    assert (spec.batch_size, spec.seed, spec.rank, spec.world_size, spec.device) == (5, 3, 0, 1, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.batch_size = 6  # type: ignore[misc]
    for kw, msg in [
        ({"batch_size": 0}, "batch_size must be a positive int. Got 0."),
        ({"batch_size": True}, "batch_size must be a positive int. Got True."),
        ({"buffer_bytes": -1}, "buffer_bytes must be a positive int. Got -1."),
        ({"run_bytes": -1}, "run_bytes must be an int >= 0. Got -1."),
        ({"seed": -2}, "seed must be a non-negative int. Got -2."),
        ({"prefetch": -1}, "prefetch must be an int >= 0. Got -1."),
        ({"prefetch_batches": 0}, "prefetch_batches must be an int >= 1. Got 0."),
        ({"gather_threads": 9}, "gather_threads must be an int in 1..8. Got 9."),
        ({"normalize": "zscore"}, "normalize must be one of [None, 'standardize', 'scale']. Got 'zscore'."),
        (
            {"rank": 2, "world_size": 2},
            "rank must be in 0..world_size-1 with world_size >= 1. Got rank=2, world_size=2.",
        ),
        ({"device": "meta"}, "device='meta': a loader moves batches to 'cuda' devices"),
    ]:
        with pytest.raises(ValueError) as e:
            StreamSpec(**kw)
        assert str(e.value).startswith(msg), (kw, str(e.value))
    # The typed partial options name exactly the spec's fields.
    assert set(StreamOptions.__annotations__) == {f.name for f in dataclasses.fields(StreamSpec)}


def test_a_spec_or_keywords_make_the_same_stream(tmp_path):
    store = pairs_store(tmp_path / "s")
    spec = StreamSpec(batch_size=7, seed=4, layers=[2, 9], buffer_bytes=7 * 8 * 2 * 2)
    a, b = TokenStream(store, spec), TokenStream(store, batch_size=7, seed=4, layers=[2, 9], buffer_bytes=7 * 8 * 2 * 2)
    assert a.spec == b.spec == spec and a.layers == (2, 9) and a.window_batches == 2
    xs, ys = list(a), list(b)
    assert len(xs) == len(ys) == len(a) > 2 and all(torch.equal(x, y) for x, y in zip(xs, ys))
    c = TokenStream(store, spec, seed=5)  # a keyword replaces the spec's field
    assert c.spec == dataclasses.replace(spec, seed=5) and c.seed == 5
    assert not all(torch.equal(x, y) for x, y in zip(xs, list(c)))
    with pytest.raises(TypeError, match=r"TokenStream\(\) got unexpected options \['colour'\]"):
        TokenStream(store, colour=1)
    with pytest.raises(TypeError, match="TokenStream\\(\\) takes a StreamSpec after the store. Got dict."):
        TokenStream(store, {"batch_size": 3})


def test_the_position_is_what_the_loop_consumed(tmp_path):
    store = plain_vit_store(tmp_path / "s", n=12, t=5)
    ts = TokenStream(store, batch_size=8, seed=2)
    assert ts.position == StreamPosition(seed=2, epoch=0, batches_done=0, num_workers=0)
    it = iter(ts)
    for _ in range(3):
        next(it)
    assert (ts.position.epoch, ts.position.batches_done) == (0, 3)
    it.close()
    rest = list(ts)  # continues after the third batch, then ends the epoch
    assert len(rest) == len(ts) - 3 and (ts.position.epoch, ts.position.batches_done) == (1, 0)
    ts.position.start(0, 5)  # a position set by hand: the next iteration skips 5 batches of epoch 0
    tail = list(ts)
    ts.set_epoch(0)
    assert all(torch.equal(x, y) for x, y in zip(tail, list(ts)[5:]))
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0\. Got -1\."):
        ts.set_epoch(-1)


def test_a_checkpoint_of_the_format_written_before_loads(tmp_path):
    """The state dict as the TokenStream before StreamSpec/StreamPosition wrote it (its keys, in
    its order, through JSON as a checkpoint keeps it) resumes at exactly the batch it names."""
    store = plain_vit_store(tmp_path / "s", n=12, t=5)
    ts = TokenStream(store, batch_size=8, seed=6, buffer_bytes=8 * 6 * 2 * 2)
    full = list(ts)
    saved = {
        "format": "actstore.TokenStream",
        "version": 1,
        "seed": 6,
        "epoch": 0,
        "batches_done": 4,
        "num_workers": 0,
        "n_tokens": 120,
        "batch_size": 8,
        "window_batches": 2,
        "run": 1,
        "world_size": 1,
        "rank": 0,
        "shuffle": True,
        "drop_last": False,
    }
    assert list(ts.state_dict()) == list(saved)  # the format is unchanged
    resumed = TokenStream(store, batch_size=8, seed=0, buffer_bytes=8 * 6 * 2 * 2)  # the state brings the seed
    resumed.load_state_dict(json.loads(json.dumps(saved)))
    assert resumed.position == StreamPosition(seed=6, epoch=0, batches_done=4, num_workers=0)
    rest = list(resumed)
    assert len(rest) == len(full) - 4 and all(torch.equal(x, y) for x, y in zip(rest, full[4:]))
    assert resumed.state_dict() == {**saved, "epoch": 1, "batches_done": 0}


def test_named_constructors_return_the_class_of_their_job(tmp_path):
    store = plain_vit_store(tmp_path / "s", n=12, t=5)
    plain = TokenStream(store, batch_size=8)
    aligned = TokenStream.aligned(store, layers=[0, 1], batch_size=8)
    follow = TokenStream.follow(store.path, batch_size=8)
    assert type(plain) is TokenStream and type(aligned) is AlignedTokenStream and type(follow) is FollowStream
    assert all(isinstance(s, BaseTokenStream) for s in (plain, aligned, follow))
    assert not isinstance(aligned, TokenStream) and not isinstance(follow, TokenStream)
    assert aligned.spec == StreamSpec(batch_size=8) and aligned.position.seed == 0
    assert follow.position is None
    with pytest.raises(ValueError, match="a FollowStream has no epochs: it streams a store until it is finalized"):
        follow.set_epoch(1)
    with pytest.raises(ValueError, match="a follow stream cannot be resumed"):
        follow.load_state_dict({})


def _deprecated(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = make()
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__  # it points at the caller's line
    return stream, str(caught[0].message)


def test_aligned_keyword_warns_and_gives_the_same_stream(tmp_path):
    store = plain_vit_store(tmp_path / "s", n=12, t=5)
    old, msg = _deprecated(lambda: TokenStream(store, layers=[0, 1], aligned=True, batch_size=8, seed=3, stack=True))
    assert msg == "TokenStream(stores, aligned=True, ...) is deprecated: use TokenStream.aligned(stores, ...)"
    new = TokenStream.aligned(store, layers=[0, 1], batch_size=8, seed=3, stack=True)
    assert isinstance(old, TokenStream) and len(old) == len(new) and old.seed == 3
    xs, ys = list(old), list(new)
    assert len(xs) == len(new) and all(x.shape[1:] == (2, 6) and torch.equal(x, y) for x, y in zip(xs, ys))
    assert old.state_dict() == new.state_dict() and old.epoch == 1
    old.set_epoch(0)
    assert old.position.epoch == 0 and len(list(old.loader())) == len(new)


def test_follow_keyword_warns_and_gives_the_same_stream(tmp_path):
    store = plain_vit_store(tmp_path / "s", n=12, t=5)
    old, msg = _deprecated(lambda: TokenStream(store.path, follow=True, batch_size=8, layers=[1], seed=2))
    assert msg == "TokenStream(path, follow=True, ...) is deprecated: use TokenStream.follow(path, ...)"
    new = TokenStream.follow(store.path, batch_size=8, layers=[1], seed=2)
    assert isinstance(old, TokenStream) and old.loader() is vars(old)["_legacy"] and old.seed == 2
    xs, ys = list(old), list(new)  # the pool holds the whole store: drawn once it is finalized, by the seed
    assert sum(len(x) for x in xs) == 12 * 5 and all(torch.equal(x, y) for x, y in zip(xs, ys))
    with pytest.raises(ValueError, match="a follow stream cannot be resumed"):
        old.state_dict()
    with pytest.raises(TypeError, match="takes no aligned=True"):
        TokenStream(store.path, follow=True, aligned=True)


def test_no_class_makes_another_in_new_and_stores_are_typed():
    """No `__new__` anywhere in the package (a constructor that returns another class is what
    TokenStream.aligned/.follow replaced), and at most three parameters named `store` typed Any
    (the reading API is a type: Reader, or a location as_reader opens)."""
    import ast
    from pathlib import Path

    import actstore

    news, untyped = [], []
    for path in sorted(Path(actstore.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == "__new__":
                    news.append(f"{path.name}:{node.lineno}")
                for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    if a.arg == "store" and isinstance(a.annotation, ast.Name) and a.annotation.id == "Any":
                        untyped.append(f"{path.name}:{node.lineno}")
    assert news == []
    assert len(untyped) <= 3, untyped
