"""Debian's chromium for the feature site's tests: the browser (its absence a failure under ACTSTORE_NO_SKIP=1), a page's DOM or screenshot, and a feature's data record as the page reads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest


def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "Debian's chromium is not installed: apt-get install -y chromium (scripts/test_tools.sh does)"
        if os.environ.get("ACTSTORE_NO_SKIP") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def _browser(exe, *args, url):
    res = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + str(args[0]), *args[1:], url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def site_record(site, f):
    """The JSON value of a site's data script data/f/<bucket>/<f>.js (what feature.html renders),
    its packed columns decoded."""
    from actstore.features.views.sitedata import unpack

    text = (site / "data" / "f" / str(f // 1000) / f"{f}.js").read_text()
    assert text.startswith('ACTSTORE.load("feature",') and text.endswith(");\n")
    return unpack(json.loads(text[len('ACTSTORE.load("feature",') : -3]))


def screenshot(exe, prof, url, name, request, size="1200,900"):
    """A screenshot of the page, checked to be a real picture; with ACTSTORE_SCREENSHOTS=1 it
    replaces docs/img/NAME (the pages as a researcher sees them), else it stays in tmp_path
    (a test run leaves the repository as it was)."""
    if os.environ.get("ACTSTORE_SCREENSHOTS") == "1":
        shot = request.config.rootpath / "docs" / "img" / name
    else:
        shot = request.getfixturevalue("tmp_path") / "screenshots" / name
    shot.parent.mkdir(exist_ok=True)
    _browser(exe, prof, f"--screenshot={shot}", f"--window-size={size}", "--virtual-time-budget=5000", url=url)
    assert shot.stat().st_size > 5000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return shot
