"""A real S3 HTTP server on 127.0.0.1 for tests: moto's ThreadedMotoServer."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start moto on a free loopback port; yield its endpoint URL; always stop it."""
    from moto.server import ThreadedMotoServer

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
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **{
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }).create_bucket(Bucket=name)
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
