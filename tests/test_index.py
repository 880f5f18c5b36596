"""Index math: global example <-> (shard, local), property-tested."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actstore.errors import ExampleIndexError, LayerNotFoundError
from actstore.index import ExampleIndex, layer_position


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12))
def test_every_example_in_exactly_one_shard_and_round_trips(counts):
    idx = ExampleIndex(counts)
    assert len(idx) == sum(counts)
    seen = []
    for ex in range(len(idx)):
        pos, local = idx.locate(ex)
        assert 0 <= local < counts[pos]
        assert idx.global_index(pos, local) == ex
        seen.append((pos, local))
    assert seen == [(p, i) for p, c in enumerate(counts) for i in range(c)]
    if len(idx):
        pos, local = idx.locate_many(np.arange(len(idx)))
        assert list(zip(pos.tolist(), local.tolist())) == seen
        assert idx.locate(-1) == seen[-1]
    with pytest.raises(ExampleIndexError):
        idx.locate(len(idx))
    with pytest.raises(ExampleIndexError):
        idx.locate(-len(idx) - 1)


def test_layer_position_names_the_stored_layers():
    assert layer_position([0, 6, 11], 11) == 2
    with pytest.raises(LayerNotFoundError) as e:
        layer_position([0, 6, 11], 5)
    assert (
        str(e.value)
        == "layer 5 is not stored; this store holds layers [0, 6, 11] (layer numbers are the model's block indices)"
    )
