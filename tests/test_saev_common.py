"""Shared helpers of the saev tests (stores, an independent seed-formula reader), and tests of
the pure protocol maths."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.layout import saevspec as P

ROOT = Path(__file__).resolve().parents[1]


# ---- tests of the pure protocol maths ---------------------------------------------------


@settings(deadline=None)
@given(
    n=st.integers(1, 500),
    L=st.integers(1, 4),
    content=st.integers(1, 40),
    cls=st.booleans(),
    D=st.integers(1, 16),
    extra=st.integers(0, 3000),
)
def test_geometry_tiles_examples_and_offsets_match_c_order(n, L, content, cls, D, extra):
    T = content + int(cls)
    g = P.ShardGeometry(
        n_examples=n, n_layers=L, content_tokens=content, cls_token=cls, d_model=D, budget=T * L + extra
    )
    S = g.examples_per_shard
    assert S == (T * L + extra) // (T * L) >= 1
    counts = g.shard_counts()
    assert sum(counts) == n and all(c == S for c in counts[:-1]) and 1 <= counts[-1] <= S
    assert len(counts) == g.n_shards
    rng = np.random.default_rng(n * 31 + L)
    for ex in [0, n - 1, int(rng.integers(n))]:
        lp, tok = int(rng.integers(L)), int(rng.integers(T))
        shard, off = g.locate(ex, lp, tok)
        assert shard == ex // S
        assert off == np.ravel_multi_index((ex % S, lp, tok, 0), g.shard_shape) * 4
        assert off + D * 4 <= g.shard_nbytes


def test_hashes_follow_each_protocol():
    md20 = {"b": 1, "a": "é"}
    text20 = '{"a":"\\u00e9","b":1}'
    import hashlib

    assert P.metadata_hash(md20, "2.0") == hashlib.sha256(text20.encode()).hexdigest()
    text21 = '{"b":1,"a":"é"}'  # field order kept, non-ASCII not escaped
    assert P.metadata_hash(md20, "2.1") == hashlib.sha256(text21.encode("utf-8")).hexdigest()[:8]
    assert json.loads(P.shards_bytes([3, 1], "2.0")) == [
        {"name": "acts000000.bin", "n_ex": 3},
        {"name": "acts000001.bin", "n_ex": 1},
    ]
    assert json.loads(P.shards_bytes([2], "2.1")) == [{"name": "acts000000.bin", "n_examples": 2}]


def test_export_doc_lists_every_field_family_and_rule():
    doc = (ROOT / "docs" / "export.md").read_text(encoding="utf-8")
    for proto in P.PROTOCOLS:
        for name in P.FIELDS[proto] + P.FAMILIES[proto]:
            assert re.search(rf"`{re.escape(name)}`", doc), f"docs/export.md does not mention `{name}` ({proto})"
        # the 2.1 field order as written in the doc equals the code's
    listed = re.search(r"2\.1 fields, in order: (.+)", doc).group(1)
    assert re.findall(r"`([a-z_]+)`", listed) == list(P.FIELDS["2.1"])
    listed20 = re.search(r"2\.0 fields, in order: (.+)", doc).group(1)
    assert re.findall(r"`([a-z_]+)`", listed20) == list(P.FIELDS["2.0"])
