"""Durable named consumers (TokenStream.follow(path, consumer=...)): each name gets every
kept token vector once (multisets of the vectors' bytes against the blocks' generator),
its acknowledgements are written one checkpoint behind, a restart continues from a state or
from the store's record, an older checkpoint and a dropped consumer are refused, ranks
share the blocks disjointly, and the device path hands over exactly what it marks."""

from __future__ import annotations

import threading

import pytest
import spoolhelp as sh
import torch

import actstore
from actstore.errors import ConsumerDroppedError, SpoolError
from actstore.layout import spool
from actstore.layout.records import now
from actstore.loaders import feed
from actstore.loaders.consumer import ConsumerStream
from actstore.loaders.consumerstate import triples_of
from actstore.storage import open_storage
from actstore.torch import TokenStream

OPTS = dict(batch_size=7, buffer_bytes=30 * sh.D * 2, token_mask="all", poll_s=0.01, idle_timeout_s=60)


def consumer(path, name="sae", **kw):
    return TokenStream.follow(path, consumer=name, **{**OPTS, "layers": [1], **kw})


def record(path, name="sae", rank=0):
    st = open_storage(path)
    key = spool.consumer_key(name, rank)
    return spool.parse_consumer(st.get(key), key)


def finished_store(path, shards=None):
    shards = shards or {0: 10, 1: 7}
    for s, n in shards.items():
        sh.write_blocks(path, s, range(n), world_size=len(shards))
    actstore.finalize(path)
    return shards


def test_two_consumers_each_get_every_token_once_while_the_store_is_written(tmp_path):
    path = tmp_path / "s"
    got: dict[str, list] = {"l1": [], "both": []}
    errors = []

    def train(name, layers):
        try:
            for b in consumer(path, name, layers=layers, ack="yielded"):
                got[name].append(b.clone())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    readers = [threading.Thread(target=train, args=a) for a in (("l1", [1]), ("both", [1, 3]))]
    for t in readers:
        t.start()  # before the store exists: each registers once it does
    writers = [
        threading.Thread(target=sh.write_blocks, args=(path, s, range(15)), kwargs={"world_size": 2}) for s in (0, 1)
    ]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    actstore.finalize(path)
    for t in readers:
        t.join()
    assert not errors
    assert sh.rows(got["l1"]) == sh.expected({0: 15, 1: 15}, [1])
    assert sh.rows(got["both"]) == sh.expected({0: 15, 1: 15}, [1, 3])
    assert sum(sh.expected({0: 15, 1: 15}, [1]).values()) > 250
    every = {0: ((0, 45),), 1: ((0, 45),)}  # 15 blocks of 3 examples per shard, all acknowledged
    assert dict(record(path, "l1").acked) == every and dict(record(path, "both").acked) == every


def test_acknowledged_one_checkpoint_behind_and_resumed_from_a_state_exactly(tmp_path):
    path = tmp_path / "s"
    finished_store(path)
    want = sh.expected({0: 10, 1: 7}, [1])
    s = consumer(path)
    assert dict(record(path).acked) == {}  # registered at once: the store exists
    it = iter(s)
    first = [next(it).clone() for _ in range(6)]
    st1 = s.state_dict()
    assert dict(record(path).acked) == {}  # nothing written at the first call
    first += [next(it).clone() for _ in range(6)]
    st2 = s.state_dict()
    assert triples_of(record(path).acked) == st1["completed"]  # the first state's blocks, written at the second call
    assert st1["completed"] != st2["completed"]
    after = [next(it).clone() for _ in range(3)]  # yielded after the checkpoint: lost with the process
    del it
    again = consumer(path)
    again.load_state_dict(st2)
    assert triples_of(record(path).acked) == st2["completed"]  # a state loaded is a durable one
    rest = [b.clone() for b in again]
    assert sh.rows(first) + sh.rows(rest) == want
    assert not (sh.rows(first) & sh.rows(rest))
    assert sh.rows(after) <= sh.rows(rest)  # (what the killed run yielded after its checkpoint comes again)
    assert st2["in_flight"]  # the state held rows of partly yielded blocks


def test_a_restart_without_a_state_continues_from_the_record(tmp_path):
    path = tmp_path / "s"
    finished_store(path)
    s = consumer(path, ack="yielded", poll_s=1e-9)
    it = iter(s)
    first = [next(it).clone() for _ in range(20)]
    del it
    done = record(path).acked
    assert done and dict(done) == s.progress.completed_now()
    acked_rows = sh.Counter()
    for shard, ranges in done.items():
        for a, b in ranges:
            for i in range(a // sh.PER_BLOCK, b // sh.PER_BLOCK):
                acked_rows += sh.block_rows(shard, i)
    rest = [b.clone() for b in consumer(path, ack="yielded")]
    assert sh.rows(rest) == sh.expected({0: 10, 1: 7}, [1]) - acked_rows
    assert acked_rows <= sh.rows(first)


def test_a_checkpoint_older_than_the_record_is_refused(tmp_path):
    path = tmp_path / "s"
    finished_store(path)
    s = consumer(path, ack="yielded", poll_s=1e-9)
    it = iter(s)
    next(it)
    old = s.state_dict()
    for _ in range(12):
        next(it)
    del it
    assert triples_of(record(path).acked) != old["completed"]
    with pytest.raises(
        SpoolError,
        match=r"this checkpoint of consumer 'sae' rank 0 is older than its record in .*: the store was told it consumed examples",
    ):
        consumer(path, ack="yielded").load_state_dict(old)


def test_what_a_consumer_refuses(tmp_path):
    path = tmp_path / "s"
    finished_store(path)
    with pytest.raises(SpoolError, match=r"consumer name must be 1-64 characters of A-Z a-z 0-9 \. _ -.* Got 'a/b'"):
        consumer(path, "a/b")
    with pytest.raises(ValueError, match=r"ack must be one of \['checkpoint', 'manual', 'yielded'\]\. Got 'always'"):
        consumer(path, ack="always")
    with pytest.raises(ValueError, match="takes ack= only with consumer="):
        TokenStream.follow(path, ack="yielded")
    consumer(path, "wide", rank=0, world_size=2)
    with pytest.raises(
        SpoolError, match=r"consumer 'wide' of .* was registered with world_size=2 .*this stream has world_size=3"
    ):
        consumer(path, "wide", rank=1, world_size=3)
    state = consumer(path, "a").state_dict()
    with pytest.raises(
        ValueError, match=r"saved by another consumer or with other options: consumer='a' \(this stream: 'b'\)"
    ):
        consumer(path, "b").load_state_dict(state)
    with pytest.raises(ValueError, match=r"layers=\[1\] \(this stream: \[3\]\)"):
        consumer(path, "a", layers=[3]).load_state_dict(state)
    with pytest.raises(ValueError, match="acknowledge\\(\\) needs a state"):
        consumer(path, "c").acknowledge()
    st = open_storage(path)
    st.put(spool.dropped_key("gone"), spool.dump_dropped(spool.DroppedRecord(name="gone", dropped=now(), by="test")))
    with pytest.raises(
        ConsumerDroppedError, match=r"consumer 'gone' of .* was dropped \(.*, by test\).*register under a new name"
    ):
        consumer(path, "gone")


def test_ranks_take_disjoint_shares_that_end_independently(tmp_path):
    path = tmp_path / "s"
    finished_store(path, {0: 10, 1: 7})
    got = [sh.rows(consumer(path, "ddp", rank=r, world_size=3)) for r in range(3)]
    assert sum(got, sh.Counter()) == sh.expected({0: 10, 1: 7}, [1])
    assert all(not (got[i] & got[j]) for i in range(3) for j in range(i + 1, 3))
    for r in range(3):
        owned = {(s, i * 3, i * 3 + 3) for s, n in ((0, 10), (1, 7)) for i in range(n) if (s + i) % 3 == r}
        s = consumer(path, f"own{r}", rank=r, world_size=3)
        list(s)
        assert {b[:3] for b in s.blocks_read} == owned
    assert len({sum(c.values()) for c in got}) > 1  # uneven shares, each stream ended on its own


def test_the_device_path_marks_exactly_the_batches_handed_over(tmp_path, monkeypatch):
    path = tmp_path / "s"
    finished_store(path)
    fed = []
    real = feed.DeviceFeeder.__iter__

    def counted(self):
        fed.append(self.prefetch)
        return real(self)

    monkeypatch.setattr(feed.DeviceFeeder, "__iter__", counted)
    s = consumer(path, device="cpu", prefetch_batches=3, dtype=torch.float32)
    assert isinstance(s, ConsumerStream) and s.device is None  # "cpu": CPU batches, no feeder
    s.device = torch.device("cpu")  # the device path with host copies (what device="cuda" takes)
    it = iter(s)
    first = [next(it).clone() for _ in range(9)]  # the feeder has drawn batches beyond these
    st = s.state_dict()
    del it
    again = consumer(path, prefetch_batches=3, dtype=torch.float32)
    again.device = torch.device("cpu")
    again.load_state_dict(st)
    rest = list(again)
    assert fed == [3, 3] and all(b.dtype == torch.float32 for b in first + rest)
    assert sh.rows(first) + sh.rows(rest) == sh.expected({0: 10, 1: 7}, [1])


def test_a_consumer_of_an_object_store(tmp_path, s3_url):
    got = []
    reader = threading.Thread(
        target=lambda: got.extend(b.clone() for b in consumer(s3_url, ack="yielded", poll_s=0.05))
    )
    reader.start()
    sh.write_blocks(s3_url, 0, range(6))
    actstore.finalize(s3_url)
    reader.join()
    assert sh.rows(got) == sh.expected({0: 6}, [1])
    assert dict(record(s3_url).acked) == {0: ((0, 18),)}


def test_a_block_whose_file_was_replaced_under_a_read_is_read_again(tmp_path, monkeypatch):
    """On an object store a Zarr shard file is rewritten whole as it grows: a read may see the
    index of one version and the data of the next (a crc32c mismatch). The stream reads the
    shard again at its next looks (its block records unchanged); damage that stays is raised
    after follow.READ_TRIES looks."""
    from actstore.errors import CorruptChunkError
    from actstore.loaders import follow

    path = tmp_path / "s"
    finished_store(path)
    fails = {"left": 2}

    class Flaky(follow.ShardReader):
        def read_many(self, seg, items):
            if fails["left"]:
                fails["left"] -= 1
                raise CorruptChunkError("shard file x has a damaged index (crc32c mismatch)")
            return super().read_many(seg, items)

    monkeypatch.setattr(follow, "ShardReader", Flaky)
    assert sh.rows(consumer(path)) == sh.expected({0: 10, 1: 7}, [1]) and fails["left"] == 0
    fails["left"] = 2
    plain = TokenStream.follow(path, **{**OPTS, "layers": [1]})  # a plain follow stream: the same
    assert sh.rows(plain) == sh.expected({0: 10, 1: 7}, [1]) and fails["left"] == 0
    fails["left"] = 10**6
    with pytest.raises(CorruptChunkError, match="damaged index"):
        list(consumer(path, "other"))
