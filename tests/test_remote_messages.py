"""cp and object-storage messages say what happened (issue 23 item 7): a copy into object
storage is deep-verified there and says so; an http:// endpoint without AWS_ALLOW_HTTP is
named as the cause, with the variable, instead of "builder error ... after retries"."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.copy import copy_store
from actstore.errors import StorageAccessError
from actstore.storage import open_storage


@pytest.fixture
def src(tmp_path):
    with actstore.ShardWriter(tmp_path / "src", layers=[0, 1], d_model=4, tokens=3) as w:
        w.append(np.arange(5 * 2 * 3 * 4, dtype=np.float32).reshape(5, 2, 3, 4))
    actstore.finalize(tmp_path / "src")
    return tmp_path / "src"


def test_cp_to_object_storage_runs_and_reports_deep_verify(src, s3_url):
    res = copy_store(src, s3_url)
    assert res.deep_verified is True and "verify --deep passed" in res.summary()
    out = CliRunner().invoke(main, ["cp", str(src), s3_url.replace("/store", "/again")])
    assert out.exit_code == 0 and "verify --deep passed" in out.output and "not run" not in out.output


def test_http_endpoint_without_allow_http_names_the_variable(s3_url, monkeypatch):
    open_storage(s3_url).put("k", b"x")
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    st = open_storage(s3_url)
    for call in (lambda: st.check_access(write=False), lambda: st.get("k")):
        with pytest.raises(
            StorageAccessError,
            match=r"the endpoint http://127.0.0.1:\d+ is plain http, which obstore refuses unless "
            r"AWS_ALLOW_HTTP=true is set \(nothing was sent or retried\)",
        ) as e:
            call()
        assert "after retries" not in str(e.value) and "builder error" not in str(e.value)
