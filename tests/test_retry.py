"""Connection-level failures of object-store requests (actstore/storage/retry.py), met through
a proxy on 127.0.0.1 in front of moto: retried with backoff until a deadline, counted, shown
on progress bars; after the deadline the error says what happened and how often, and blames
the configuration only when the endpoint never answered."""

from __future__ import annotations

import io
import socket
import time
from datetime import timedelta

import pytest
from faultproxy import FaultProxy

from actstore.errors import StorageAccessError
from actstore.progress import bar, notes
from actstore.storage import ObjectStorage, retry

QUICK = {
    "max_retries": 1,
    "retry_timeout": timedelta(seconds=2),
    "backoff": {"init_backoff": timedelta(milliseconds=10)},
}


@pytest.fixture
def policy():
    retry.reset_counts()
    retry.set_policy(retry.RetryPolicy(deadline_s=1.5, first_wait_s=0.01, max_wait_s=0.2))
    yield
    retry.set_policy(None)


def _storage(url: str) -> ObjectStorage:
    return ObjectStorage(url, retry_config=QUICK)  # obstore's own retries short: ours are what is tested


def test_every_read_and_listing_rides_through_resets_and_cut_answers(s3_endpoint, s3_url, monkeypatch, policy):
    data = bytes(range(256)) * 400
    _storage(s3_url).put("a/c/0/0/0/0", data)
    with FaultProxy(
        s3_endpoint, fail=0, drop_request=0, drop_response=0, reset=0.3, cut=0.3, keepalive=False, seed=4
    ) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        st = _storage(s3_url)
        for _ in range(8):
            assert st.get("a/c/0/0/0/0") == data
            assert st.get_range("a/c/0/0/0/0", 1000, 5000) == data[1000:6000]
            assert st.size("a/c/0/0/0/0") == len(data)
            assert [e.key for e in st.list("a")] == ["a/c/0/0/0/0"]
            assert st.list_dir("a") == ["c"]
            st.put("b", b"x")  # a whole-object put may be sent again: same bytes
            assert st.put_if_absent(f"lock{_}", b"me") is True  # a retried create-only put knows its own bytes
    c = retry.counts()
    assert proxy.counts["reset"] > 5 and proxy.counts["cut"] > 5
    assert c["reset"] + c["cut"] > 5 and c["recovered"] >= 1 and c["retried"] == sum(c[k] for k in retry.LABELS)
    assert c["refused"] == c["unresolved"] == c["timeout"] == 0
    assert notes() == f"{sum(c[k] for k in retry.LABELS)} network retries"


def test_after_the_deadline_the_error_says_what_happened_not_a_configuration_hint(
    s3_endpoint, s3_url, monkeypatch, policy
):
    _storage(s3_url).put("k", b"v")
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0, reset=1.0, seed=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        st = _storage(s3_url)
        retry._reached.add(retry.root_of(s3_url))  # noqa: SLF001 - as after an earlier answer of this endpoint
        t = time.monotonic()
        with pytest.raises(StorageAccessError) as e:
            st.get("k")
        took = time.monotonic() - t
    msg = str(e.value)
    n = retry.counts()["reset"]
    assert n >= 3 and proxy.counts["reset"] >= n
    assert msg.startswith(f"cannot read {s3_url}/k: {n} connection failures in ")
    assert f"({n} connection resets); the last: " in msg
    assert "not the configuration" in msg and "ACTSTORE_RETRY_SECONDS, now 1.5 s" in msg
    assert "AWS_ENDPOINT_URL" not in msg and took < 30  # bounded: the deadline, not obstore's 180 s


def test_an_endpoint_that_never_answered_fails_at_once_with_the_configuration_hint(s3_url, monkeypatch, policy):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(
        StorageAccessError,
        match=r"cannot read s3://.*/k: the endpoint http://127\.0\.0\.1:\d+ cannot be reached "
        r"\(check AWS_ENDPOINT_URL",
    ):
        _storage(s3_url).get("k")
    assert retry.counts()["refused"] == 0  # not retried: nothing suggests the network, everything the configuration


def test_an_endpoint_that_answered_before_and_then_refuses_is_retried_until_the_deadline(
    s3_endpoint, s3_url, monkeypatch, policy
):
    _storage(s3_url).put("k", b"v")
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0, keepalive=False) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        st = _storage(s3_url)
        assert st.get("k") == b"v"
    # the proxy is gone: its port refuses (a server restarting)
    with pytest.raises(
        StorageAccessError,
        match=r"cannot read s3://.*/k: \d+ connection failures in [\d.]+ s \(\d+ refused connections\); "
        r"the last: .*not the configuration",
    ):
        st.get("k")
    assert retry.counts()["refused"] >= 2


def test_progress_bars_show_the_network_retries(s3_endpoint, s3_url, monkeypatch, policy):
    _storage(s3_url).put("k", b"v" * 1000)
    out = io.StringIO()
    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0, reset=0.5, keepalive=False, seed=2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        st = _storage(s3_url)
        with bar(total=20, file=out, mininterval=0, delay=0) as b:
            for _ in range(20):
                st.get("k")
                b.update(1)
    n = sum(retry.counts()[k] for k in retry.LABELS)
    assert n >= 2 and proxy.counts["reset"] >= n
    assert out.getvalue().splitlines()[-1].endswith(f"{n} network retries]")


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (
            "Generic S3 error: Error performing HEAD http://h/k in 430µs - HTTP error: error sending request\n"
            'hyper::Error(\n Canceled,\n "connection was not ready",\n )',
            "reset",
        ),
        (
            "Generic S3 error: Error getting list response body: HTTP error: request or response body error\n"
            'Os {\n code: 104,\n kind: ConnectionReset,\n message: "Connection reset by peer",\n }',
            "reset",
        ),
        ("Generic S3 error: HTTP error: error decoding response body", "cut"),
        ("Generic S3 error: Error performing GET http://h/k - HTTP error: operation timed out", "timeout"),
        (
            "Generic S3 error: Error performing GET http://h/k - error sending request ... Connection refused (os error 111)",
            "refused",
        ),
        (
            "Generic S3 error: Error performing GET http://h/k - Server returned non-2XX status code: 503 Service Unavailable",
            None,
        ),
    ],
)
def test_which_failures_are_connection_failures(text, kind):
    from obstore.exceptions import GenericError

    assert retry.kind(GenericError(text)) == kind
    assert retry.kind(ValueError(text)) is None  # only the store client's errors


def test_the_network_note_follows_what_the_bar_shows_itself(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(retry, "_counts", retry.Counter({"reset": 2, "cut": 1, "retried": 3}))
    with bar(total=2, file=out, mininterval=0, delay=0) as b:
        b.set_postfix_str("1,000 tok/s", refresh=False)  # a capture's own note
        b.update(1)
        b.update(1)
    assert out.getvalue().splitlines()[-1].endswith("1,000 tok/s, 3 network retries]")


def test_a_failure_nothing_retries_after_the_endpoint_answered_is_not_blamed_on_the_configuration(s3_url):
    from obstore.exceptions import GenericError

    from actstore.storage.objecterrors import cause

    e = GenericError(
        "Generic S3 error: Error performing PUT http://h/k - HTTP error: error sending request\n"
        'Os {\n code: 104,\n kind: ConnectionReset,\n message: "Connection reset by peer",\n }'
    )
    root = retry.root_of(s3_url)
    retry._reached.discard(root)  # noqa: SLF001
    assert cause(e, s3_url).startswith("the endpoint ") and "check AWS_ENDPOINT_URL" in cause(e, s3_url)
    retry._reached.add(root)  # noqa: SLF001
    assert cause(e, s3_url) == (
        "the connection failed (connection reset: Connection reset by peer) although the endpoint "
        "answered before: the network or the server failed, not the configuration; try again"
    )


def test_a_runs_counts_are_its_own_plus_those_of_writers_in_other_processes(monkeypatch):
    """`write --workers N --json` reports the retries of the worker processes too: each
    RecordResult carries its run's counts, which the parent adds to its own."""
    monkeypatch.setattr(retry, "_counts", retry.Counter({"reset": 2, "retried": 2, "recovered": 1}))
    before = retry.counts()
    monkeypatch.setattr(retry, "_counts", retry.Counter({"reset": 3, "timeout": 1, "retried": 4, "recovered": 2}))
    worker_a = {"cut": 2, "retried": 2, "recovered": 1}
    worker_b = {"reset": 1, "retried": 1}
    got = retry.counts_since(before, worker_a, worker_b)
    assert got == {"retried": 5, "recovered": 2, "reset": 2, "cut": 2, "timeout": 1, "refused": 0, "unresolved": 0}


def test_an_endpoint_that_goes_away_mid_write_costs_one_deadline_not_one_per_operation(
    s3_endpoint, s3_url, monkeypatch, policy
):
    """A writer's commit, its cleanup and the next write each used to wait out the deadline
    (374 s of 120 s budgets): after the first gives up, the endpoint is down until it answers."""
    import numpy as np

    import actstore

    with FaultProxy(s3_endpoint, fail=0, drop_request=0, drop_response=0, keepalive=False) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        w = actstore.ShardWriter(_storage(s3_url), layers=[0], d_model=4, tokens=3, zarr_format=2)
        w.append(np.ones((2, 1, 3, 4), np.float16))
        w.commit()
        w.append(np.ones((2, 1, 3, 4), np.float16))  # chunk files written, not yet committed
    # the proxy is gone: its port refuses (an endpoint that went away)
    waited_out = []  # each request that retried until the deadline
    plain = retry._Attempts.gave_up  # noqa: SLF001

    def gave_up(self, *args):
        waited_out.append(self.down is None)
        return plain(self, *args)

    monkeypatch.setattr(retry._Attempts, "gave_up", gave_up)  # noqa: SLF001
    with pytest.raises(StorageAccessError) as first:
        w.close()  # the commit's puts, then the lease's release
    assert "connection failures in" in str(first.value) and "refused" in str(first.value)
    assert waited_out[0] and not any(waited_out[1:]), waited_out  # one deadline, not one per request
    t = time.monotonic()
    with pytest.raises(StorageAccessError, match=r"the endpoint stopped answering \(cannot .* after \d+ s of retries"):
        _storage(s3_url).get("k")  # the next operation: one try, at once, naming what gave up
    assert time.monotonic() - t < 1.0
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # the endpoint is back: requests go through again
    assert _storage(s3_url).list_dir("shards") == ["shard-00000.zarr"]
