"""An HTTP proxy on 127.0.0.1 that makes an S3 server unreliable, for tests.

Each new connection is, at random (seeded), reset at accept (TCP RST before any byte, as a
real network does now and then). Each request is, at random (seeded): answered 503 SlowDown
without reaching the server, dropped before it reaches the server (the connection closes
with no answer), forwarded and its answer dropped (the server acted, the client never
hears), forwarded and its answer cut midway (the status, the headers and half the body,
then a reset), or forwarded whole; answers with a body of a zarr chunk object (a key with
`/c/0/...` or `/0.1.0.0`: the activation chunks and shard files) are cut at a rate of their own.
A client that retries as the S3 protocol expects still gets exact results. Every wait is
bounded (upstream timeout, join timeout at exit).
"""

from __future__ import annotations

import contextlib
import http.client
import random
import re
import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


# obstore's own waits between its tries: 5 ms doubling up to 1 s (its defaults: 100 ms up to 15 s).
QUICK_BACKOFF = {"init_backoff": timedelta(milliseconds=5), "max_backoff": timedelta(seconds=1), "base": 2}


@contextlib.contextmanager
def quick_obstore_backoff() -> Iterator[None]:
    """Every obstore client built inside waits QUICK_BACKOFF between its own tries unless its
    caller set a retry_config: the same failures are retried as many times (obstore's
    max_retries and retry_timeout unchanged), only the pauses between tries are shorter, where
    riding through the failures is what a test checks, not how long it waits (a flaky-network
    job: 10 s -> 4 s)."""
    import obstore.store

    real = obstore.store.from_url

    def from_url(url, **kw):
        return real(url, **{"retry_config": {"backoff": QUICK_BACKOFF}, **kw})

    obstore.store.from_url = from_url
    try:
        yield
    finally:
        obstore.store.from_url = real


_CHUNK = re.compile(r"/c/\d|/\d+\.\d+\.\d+")  # a zarr chunk key: v3 `.../c/0/1/0/0`, v2 `.../0.1.0.0`


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (linger 0), not a FIN: the peer sees 'connection reset'."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class FaultProxy:
    """Forward to `upstream` (http://127.0.0.1:PORT) with faults; use as a context manager.

    Args:
        upstream: the real server's URL.
        fail: probability of a 503 answer.
        drop_request: probability of closing the connection before forwarding.
        drop_response: probability of forwarding, then closing without the answer.
        reset: probability of resetting a new connection at accept (no byte answered).
        cut: probability of forwarding, then sending half the answer's body and a reset.
        cut_chunks: the same for answers of chunk objects only (keys `.../c/0/...`, `.../0.1.0.0`).
        keepalive: False closes every connection after its answer (`Connection: close`), so
            each request opens a new one and meets the `reset` rate (real servers and load
            balancers close idle connections often).
        seed: the random generator's seed.
    """

    def __init__(
        self,
        upstream: str,
        *,
        fail: float = 0.05,
        drop_request: float = 0.03,
        drop_response: float = 0.02,
        reset: float = 0.0,
        cut: float = 0.0,
        cut_chunks: float = 0.0,
        keepalive: bool = True,
        seed: int = 0,
    ):
        u = urlsplit(upstream)
        self.host, self.port = u.hostname, u.port
        self.p = (fail, drop_request, drop_response)
        self.reset, self.cut, self.cut_chunks, self.keepalive = reset, cut, cut_chunks, keepalive
        self.rng = random.Random(seed)
        self.accept_rng = random.Random(seed + 1_000_003)  # its own stream: resets do not shift the requests' fates
        self.lock = threading.Lock()
        self.counts = {
            "forwarded": 0,
            "failed": 0,
            "dropped_request": 0,
            "dropped_response": 0,
            "connections": 0,
            "reset": 0,
            "cut": 0,
            "cut_answer": 0,  # answers cut: at the rate of every answer
            "cut_chunk_answer": 0,  # and at the chunk objects' own rate
            "upstream_error": 0,
        }
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                fate = proxy._fate()
                if fate == "failed":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if fate == "dropped_request":
                    self.close_connection = True
                    self.connection.close()
                    return
                conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "proxy-connection")}
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:  # the server is busy (its backlog full): the client sees a dropped request
                    with proxy.lock:
                        proxy.counts["upstream_error"] += 1
                    self.close_connection = True
                    _reset(self.connection)
                    return
                finally:
                    conn.close()
                if fate == "dropped_response":
                    self.close_connection = True
                    self.connection.close()
                    return
                if (
                    (fate == "cut" or (fate == "cut_chunk" and _CHUNK.search(self.path)))
                    and self.command != "HEAD"
                    and len(data) >= 2
                ):
                    with proxy.lock:
                        proxy.counts["cut"] += 1
                        proxy.counts["cut_answer"] += fate == "cut"
                        proxy.counts["cut_chunk_answer"] += fate == "cut_chunk"
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    _reset(self.connection)
                    return
                self.send_response(resp.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                if not proxy.keepalive:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # not 5: a client opening many connections at once is not refused

            def verify_request(self, request, client_address) -> bool:  # at accept: maybe a reset
                with proxy.lock:
                    proxy.counts["connections"] += 1
                    reset = proxy.accept_rng.random() < proxy.reset
                    proxy.counts["reset"] += reset
                if reset:
                    _reset(request)
                return not reset

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def _fate(self) -> str:
        with self.lock:
            r = self.rng.random()
            fail, dreq, dresp = self.p
            fate = (
                "failed"
                if r < fail
                else "dropped_request"
                if r < fail + dreq
                else "dropped_response"
                if r < fail + dreq + dresp
                else "forwarded"
            )
            if fate == "forwarded" and (self.cut or self.cut_chunks):  # a draw of its own: none when both are 0
                c = self.rng.random()
                fate = "cut" if c < self.cut else "cut_chunk" if c < self.cut + self.cut_chunks else fate
            self.counts[fate if fate in self.counts else "forwarded"] += 1
            return fate

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)
