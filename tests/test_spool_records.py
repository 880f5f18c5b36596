"""The spool's records and pure accounting (actstore.layout.spool): keys, dump/parse round
trips, damage named, the budget parser, example-range merging (property-tested),
block_owner, spooled_bytes and consumed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actstore.errors import CorruptStoreError, SpoolError
from actstore.layout import spool

# ---- keys -----------------------------------------------------------------------------


def test_keys_are_the_contracts():
    assert spool.SPOOL_FILE == "spool/spool.json"
    assert spool.consumer_key("sae-l8", 3) == "spool/consumers/sae-l8/rank-3.json"
    assert spool.dropped_key("sae-l8") == "spool/dropped/sae-l8.json"
    assert spool.removed_key(2, "writer-00002") == "spool/removed/shard-00002.zarr/writer-00002.json"
    assert spool.removed_key(0, "finalize") == "spool/removed/shard-00000.zarr/finalize.json"
    assert spool.removed_key(0, spool.cli_remover("0a1b2c3d")) == "spool/removed/shard-00000.zarr/cli-0a1b2c3d.json"
    assert spool.writer_remover(7) == "writer-00007"
    assert spool.parse_rank_file("rank-12.json") == 12
    assert spool.parse_rank_file("rank-x.json") is None
    assert spool.parse_dropped_file("sae.json") == "sae"
    assert spool.parse_dropped_file(".tmp") is None
    assert spool.parse_remover_file("finalize.json") == "finalize"
    assert spool.parse_remover_file("someone.json") is None


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "..", "sae l8", 3])
def test_bad_consumer_names_are_refused(name):
    with pytest.raises(SpoolError, match="1-64 characters"):
        spool.consumer_key(name, 0)


def test_a_bad_remover_is_refused():
    with pytest.raises(ValueError, match="writer-NNNNN, finalize or cli-<8 hex>"):
        spool.removed_key(0, "me")
    with pytest.raises(ValueError, match="8 lowercase hex"):
        spool.cli_remover("XYZ")


# ---- the budget ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,n",
    [
        ("50GB", 50 * 10**9),
        ("50 GiB", 50 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1_500_000_000_000),
        ("1000000", 1_000_000),
        ("4 kb", 4000),
        ("4KiB", 4096),
        ("10B", 10),
        (".5MB", 500_000),
        (12345, 12345),
    ],
)
def test_budgets_parse_in_si_and_iec_units(text, n):
    assert spool.parse_budget(text) == n


@pytest.mark.parametrize("bad", ["50XB", "GB", "-5GB", "5 G B", "", "0", 0, -1, True, 1.5, None, "1e9"])
def test_bad_budgets_name_the_value_and_the_spellings(bad):
    with pytest.raises(SpoolError) as e:
        spool.parse_budget(bad)
    assert repr(bad) in str(e.value)


def test_format_bytes():
    assert spool.format_bytes(1_500_000_000) == "1.50 GB"
    assert spool.format_bytes(999) == "999 B"


# ---- ranges --------------------------------------------------------------------------

range_lists = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12)


@given(range_lists)
def test_merge_ranges_holds_exactly_the_union(rs):
    merged = spool.merge_ranges(rs)
    members = {i for a, b in rs for i in range(a, b)}
    assert {i for a, b in merged for i in range(a, b)} == members
    assert spool.range_count(merged) == len(members)
    # sorted, non-empty, disjoint and not touching
    assert all(a < b for a, b in merged)
    assert all(merged[i][1] < merged[i + 1][0] for i in range(len(merged) - 1))
    assert spool.merge_ranges(merged) == merged


@given(range_lists, st.integers(0, 60), st.integers(0, 60))
def test_covers_overlaps_and_add_agree_with_sets(rs, start, stop):
    merged = spool.merge_ranges(rs)
    members = {i for a, b in rs for i in range(a, b)}
    block = set(range(start, stop))
    assert spool.covers(merged, start, stop) == block.issubset(members)
    assert spool.overlaps(merged, start, stop) == bool(block & members)
    added = spool.add_range(merged, start, stop)
    assert {i for a, b in added for i in range(a, b)} == members | block


def test_merge_joins_touching_ranges():
    assert spool.merge_ranges([(4, 6), (0, 2), (2, 4), (8, 9)]) == ((0, 6), (8, 9))


# ---- records -------------------------------------------------------------------------


def test_spool_record_round_trip_and_damage():
    rec = spool.SpoolRecord(budget_bytes=10**9, created="2026-01-01T00:00:00Z")
    data = spool.dump_spool(rec)
    assert json.loads(data) == {"format_version": 1, "budget_bytes": 10**9, "created": "2026-01-01T00:00:00Z"}
    assert spool.parse_spool(data, "s/spool/spool.json") == rec
    with pytest.raises(CorruptStoreError, match=r"s/spool/spool.json: budget_bytes must be a positive int, got 0"):
        spool.parse_spool(b'{"format_version": 1, "budget_bytes": 0, "created": ""}', "s/spool/spool.json")
    with pytest.raises(CorruptStoreError, match="must have exactly the fields"):
        spool.parse_spool(b'{"budget_bytes": 5}', "w")
    with pytest.raises(CorruptStoreError, match="upgrade actstore"):
        spool.parse_spool(b'{"format_version": 2, "budget_bytes": 5, "created": ""}', "w")
    with pytest.raises(CorruptStoreError, match="w is not valid JSON"):
        spool.parse_spool(b"{", "w")


def test_consumer_record_round_trip_merges_and_accepts_shard_names():
    rec = spool.ConsumerRecord(
        name="sae-l8", rank=1, world_size=2, acked={0: ((0, 4), (4, 8)), 3: ((2, 5),)}, registered="r", updated="u"
    )
    doc = json.loads(spool.dump_consumer(rec))
    assert doc == {
        "name": "sae-l8",
        "rank": 1,
        "world_size": 2,
        "acked": [[0, 0, 8], [3, 2, 5]],
        "registered": "r",
        "updated": "u",
    }
    back = spool.parse_consumer(spool.dump_consumer(rec), "w")
    assert back.acked == {0: ((0, 8),), 3: ((2, 5),)}
    doc["acked"] = [["shard-00003.zarr", 5, 9], [3, 0, 2]]
    assert spool.parse_consumer(json.dumps(doc).encode(), "w").acked == {3: ((0, 2), (5, 9))}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rank": 2}, "rank must be an int in 0..1"),
        ({"world_size": 0}, "world_size must be an int in 1..65536"),
        ({"acked": [[0, 5, 5]]}, r"acked must be a list of \[shard, start, stop\]"),
        ({"acked": [["nope", 0, 1]]}, r"acked .* got item \['nope', 0, 1\]"),
        ({"acked": {}}, "acked must be a list"),
        ({"name": "a b"}, "name must be 1-64 characters"),
        ({"updated": 5}, "updated must be a string"),
    ],
)
def test_damaged_consumer_records_name_the_file_and_field(change, message):
    doc = {"name": "c", "rank": 0, "world_size": 2, "acked": [], "registered": "", "updated": ""}
    doc.update(change)
    with pytest.raises(CorruptStoreError, match=f"^store/spool/consumers/c/rank-0.json: {message}"):
        spool.parse_consumer(json.dumps(doc).encode(), "store/spool/consumers/c/rank-0.json")


def test_dropped_and_removed_records_round_trip_and_damage():
    d = spool.DroppedRecord(name="sae", dropped="t", by="alice@host")
    assert spool.parse_dropped(spool.dump_dropped(d), "w") == d
    r = spool.RemovedRecord(removed=((4, 8), (0, 4)), bytes=100, updated="t")
    back = spool.parse_removed(spool.dump_removed(r), "w")
    assert back == spool.RemovedRecord(removed=((0, 8),), bytes=100, updated="t")
    with pytest.raises(CorruptStoreError, match=r"^w: removed must be a list of \[start, stop\]"):
        spool.parse_removed(b'{"removed": [[3, 1]], "bytes": 1, "updated": ""}', "w")
    with pytest.raises(CorruptStoreError, match="^w: bytes must be a non-negative int, got -1"):
        spool.parse_removed(b'{"removed": [], "bytes": -1, "updated": ""}', "w")
    with pytest.raises(CorruptStoreError, match="^w: by must be a string"):
        spool.parse_dropped(b'{"name": "a", "dropped": "", "by": null}', "w")


# ---- accounting ----------------------------------------------------------------------


def _blocks():
    # shard 0: [0,4) [4,8); shard 1: [0,3)
    return [
        spool.SpoolBlock(0, 0, 0, 4, 400),
        spool.SpoolBlock(0, 1, 4, 8, 400),
        spool.SpoolBlock(1, 0, 0, 3, 300),
    ]


def test_block_owner_is_deterministic_and_spreads_shards():
    assert [spool.block_owner(0, i, 0, 2) for i in range(4)] == [0, 1, 0, 1]
    assert [spool.block_owner(s, 0, 0, 4) for s in range(5)] == [0, 1, 2, 3, 0]
    assert all(spool.block_owner(s, i, 0, 1) == 0 for s in range(3) for i in range(3))
    with pytest.raises(ValueError, match="positive int"):
        spool.block_owner(0, 0, 0, 0)


def test_spooled_bytes_counts_kept_blocks_only():
    blocks = _blocks()
    assert spool.spooled_bytes(blocks, {}) == 1100
    assert spool.spooled_bytes(blocks, {0: ((0, 4),)}) == 700
    assert spool.spooled_bytes(blocks, {0: ((0, 8),), 1: ((0, 3),)}) == 0
    recs = [spool.RemovedRecord(removed=((0, 2),), bytes=0), spool.RemovedRecord(removed=((2, 4),), bytes=0)]
    assert spool.removed_union(recs) == ((0, 4),)


def _consumer(name, rank, world, acked):
    return spool.ConsumerRecord(name=name, rank=rank, world_size=world, acked=acked)


def test_consumed_needs_every_live_consumer():
    b0, b1, b2 = _blocks()
    a = _consumer("a", 0, 1, {0: ((0, 8),)})
    b0_only = _consumer("b", 0, 1, {0: ((0, 4),)})
    assert not spool.consumed(b0, [], [])  # no consumer yet: the writers wait for one
    assert spool.consumed(b0, [a], []) and spool.consumed(b1, [a], [])
    assert not spool.consumed(b2, [a], [])
    assert spool.consumed(b0, [a, b0_only], []) and not spool.consumed(b1, [a, b0_only], [])
    assert spool.consumed(b1, [a, b0_only], ["b"])  # a dropped consumer holds nothing back
    assert spool.consumed(b2, [a], ["a"])  # every registered consumer dropped: nothing holds blocks
    # two ranks of one consumer: the block counts as acked when its rank lists it
    r0 = _consumer("c", 0, 2, {0: ((0, 4),)})
    r1 = _consumer("c", 1, 2, {0: ((4, 8),)})
    assert spool.consumed(b0, [r0, r1], []) and spool.consumed(b1, [r0, r1], [])
    assert not spool.consumed(b1, [r0], [])
    # a partly acked block is not consumed
    assert not spool.consumed(b0, [_consumer("d", 0, 1, {0: ((0, 3),)})], [])


def test_lag_counts_kept_unacked_blocks():
    blocks = _blocks()
    ranks = [_consumer("a", 0, 1, {0: ((0, 4),)})]
    assert spool.lag(blocks, ranks, {}) == 2
    assert spool.lag(blocks, ranks, {1: ((0, 3),)}) == 1
