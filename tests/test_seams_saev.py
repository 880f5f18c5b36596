"""Seams of the saev export (issue 23): an export of a store captured from embedded data
passes our own verify-saev, opens with actstore.open and imports back; every export is
verified before it is published."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from factory import cli, vit_store

import actstore
from actstore.saev import export_saev, verify_saev


@pytest.mark.dev  # its images need Pillow
def test_export_of_an_embedded_images_store_needs_no_options_and_verifies(tmp_path):
    store = vit_store(tmp_path / "s", model_id="embedded:dinov2-s14", attrs={"dataset": "embedded:images"})
    out = tmp_path / "saev" / "shards"
    target = Path(cli("export-saev", store.path, out, "--quiet").output.strip().splitlines()[-1])
    md = verify_saev(target).metadata
    assert verify_saev(target).problems == []
    images = out / "embedded-images"
    assert md["dataset"] == str(images) and os.path.isabs(md["dataset"])
    assert len(list(images.glob("*.png"))) == 21  # the embedded images, as files saev can link to
    assert cli("verify-saev", target).exit_code == 0
    opened = actstore.open(target)
    assert len(opened) == 13 and np.array_equal(opened[3, 5], np.asarray(store[3, 5], np.float32))
    cli("import-saev", target, tmp_path / "back", "--quiet")
    back = actstore.ActStore(tmp_path / "back")
    np.testing.assert_array_equal(np.asarray(back[3, 2]), np.asarray(store[3, 2], np.float32))
    again = cli("export-saev", store.path, out)  # rerunning finds it, verified
    assert "exists, verified" in again.output


def test_the_library_names_the_fix_for_an_embedded_dataset(tmp_path):
    store = vit_store(tmp_path / "s", attrs={"dataset": "embedded:images"})
    with pytest.raises(
        ValueError,
        match=r"attrs\['dataset'\] is 'embedded:images', data shipped in packages, not a folder saev can "
        r"link to; pass dataset \(--dataset\) .*`actstore export-saev` writes the embedded images",
    ):
        export_saev(store, tmp_path / "d", progress=False)


def test_an_export_that_does_not_verify_is_never_published(tmp_path, monkeypatch):
    from actstore.saev import export as ex

    store = vit_store(tmp_path / "s")
    monkeypatch.setattr(ex.P, "shards_bytes", lambda counts, protocol: b"[]")  # a broken shards.json
    with pytest.raises(
        ex.SaevExportError, match=r"the export does not verify \(shards.json.*\); nothing was published"
    ):
        export_saev(store, tmp_path / "d", progress=False)
    assert os.listdir(tmp_path / "d") == []
