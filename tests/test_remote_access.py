"""Refused credentials and missing permissions on S3 (moto with IAM authentication on):
every command and API names the URL and the cause, in the project's own error; a capture
fails before its model loads; nothing is written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.errors import StorageAccessError

REFUSED = "the credentials were refused"
DENIED = "access denied"


@pytest.fixture
def auth(s3_endpoint, s3_url, monkeypatch):
    """A finalized store on S3, then IAM authentication on, with two identities: a reader
    (s3:GetObject and s3:ListBucket only) and a wrong secret. Authentication is switched off
    again at teardown (the server is shared by the session's tests)."""
    import boto3
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    with actstore.ShardWriter(s3_url, layers=[0], d_model=4, tokens=3) as w:
        w.append(np.arange(24, dtype=np.float16).reshape(2, 1, 3, 4))
    actstore.finalize(s3_url)
    iam = boto3.client("iam", endpoint_url=s3_endpoint, region_name="us-east-1")
    user = f"reader-{os.urandom(4).hex()}"
    iam.create_user(UserName=user)
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}],
    }
    arn = iam.create_policy(PolicyName=f"{user}-ro", PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
    iam.attach_user_policy(UserName=user, PolicyArn=arn)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    saved = settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count
    settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = 0, 0
    try:
        yield {
            "url": s3_url,
            "reader": {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]},
            "wrong": {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        }
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = saved


def _as(monkeypatch, creds):
    for k, v in creds.items():
        monkeypatch.setenv(k, v)


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_reader_reads_and_every_write_is_refused_naming_the_object(auth, monkeypatch, tmp_path):
    url = auth["url"]
    _as(monkeypatch, auth["reader"])
    assert actstore.ActStore(url)[1, 0].tolist() == np.arange(12, 24, dtype=np.float16).reshape(3, 4).tolist()
    assert _cli("verify", "--deep", "--quiet", url).exit_code == 0
    res = _cli("finalize", url)
    assert res.exit_code == 1
    assert res.output.startswith(
        f"actstore: error: cannot write {url}/manifest.json: {DENIED}: these credentials may not do this in"
    )
    with pytest.raises(StorageAccessError, match=rf"cannot write {url}/leases/shard-00003\.0\.json: {DENIED}"):
        actstore.ShardWriter(url, shard=3, layers=[0], d_model=4, tokens=3)
    local = tmp_path / "copy"
    assert _cli("cp", "--quiet", url, local).exit_code == 0  # reading is allowed: a local copy
    res = _cli("cp", local, f"{url}-copy")
    assert res.exit_code == 1 and f"cannot write {url}-copy/" in res.output and DENIED in res.output
    from actstore.storage import open_storage

    assert not any("leases/shard-00003" in e.key for e in open_storage(url).list())  # nothing was written


@pytest.mark.parametrize(
    "args",
    [
        ("info", "{url}"),
        ("verify", "{url}"),
        ("finalize", "{url}"),
        ("export-saev", "{url}", "{tmp}/dump"),
        ("cp", "{url}", "{tmp}/copy"),
    ],
)
def test_refused_credentials_are_named_by_every_command(auth, monkeypatch, tmp_path, args):
    _as(monkeypatch, auth["wrong"])
    res = _cli(*[a.format(url=auth["url"], tmp=tmp_path) for a in args])
    assert res.exit_code == 1, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("actstore: error: cannot ") and auth["url"] in line
    assert REFUSED in line or "the credentials were refused or may not do this" in line, line
    assert "Traceback" not in res.output and not (tmp_path / "dump").exists()


def test_refused_credentials_in_the_api(auth, monkeypatch):
    _as(monkeypatch, auth["wrong"])
    with pytest.raises(StorageAccessError, match=rf"cannot read {auth['url']}/manifest\.json: {REFUSED}"):
        actstore.ActStore(auth["url"])
    with pytest.raises(StorageAccessError, match=REFUSED):
        actstore.open(auth["url"])


@pytest.mark.parametrize("who, cause", [("reader", DENIED), ("wrong", REFUSED)])
def test_a_capture_without_write_access_fails_before_the_model_loads(auth, monkeypatch, tmp_path, who, cause):
    import actstore.capture.run as run_mod

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "load_model", no_model)
    data = tmp_path / "c.txt"
    data.write_text("one document\nanother one\n")
    _as(monkeypatch, auth[who])
    url = auth["url"].rsplit("/", 1)[0] + "/capture"
    res = _cli("write", url, "--model", "embedded:smollm2-135m", "--data", data, "--layers", "0", "--quiet")
    assert res.exit_code == 1
    assert res.output.startswith("actstore: error: cannot ") and url in res.output and cause in res.output, res.output
