"""A real S3 HTTP server on 127.0.0.1 for tests: moto's ThreadedMotoServer."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


_PUT_LOCK = threading.Lock()


def _atomic_conditional_puts() -> None:
    """Make moto's PUT Object atomic, as S3's own is: moto checks `If-None-Match: *` and then
    writes with nothing between, so two racing create-only puts of one key could both win
    under load (seen once in a loaded run of test_put_if_absent_has_one_winner). Once per
    process; the lock covers only the in-process server (moto_server)."""
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_actstore_locked", False):
        return
    plain = S3Response.put_object

    def put_object(self, *args, **kwargs):
        with _PUT_LOCK:
            return plain(self, *args, **kwargs)

    put_object._actstore_locked = True
    S3Response.put_object = put_object


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start moto on a free loopback port; yield its endpoint URL; always stop it."""
    from moto.server import ThreadedMotoServer

    _atomic_conditional_puts()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        sock = getattr(getattr(server, "_server", None), "socket", None)
        if sock is not None:  # stop() leaves the listening socket open
            with contextlib.suppress(OSError):
                sock.close()


@contextlib.contextmanager
def moto_process() -> Iterator[str]:
    """moto's server in a process of its own on a free loopback port (for benchmarks: the
    server then does not share the measured process's GIL); always stopped."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard environment that points S3 clients (obstore, boto3) at `endpoint`."""
    return {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def create_bucket(endpoint: str, name: str | None = None) -> str:
    import boto3

    name = name or f"actstore-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        **{
            "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        },
    ).create_bucket(Bucket=name)
    return name


def apply_env(env: dict[str, str]) -> dict[str, str | None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return old


def restore_env(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
