"""Debian's chromium for the feature site's tests: ONE headless browser per test process (made
at the first page, closed at exit), each page a new tab of it driven over the DevTools protocol
on a pipe (no port, no websocket); a page's DOM or screenshot; a feature's data record as the
page reads it. Chromium's absence is a failure under ACTSTORE_NO_SKIP=1.

A launch of chromium costs about a CPU-second; the suite opens about twenty pages, so they share
one browser. A page is loaded as `chromium --headless --virtual-time-budget=N` loads it: virtual
time starts paused, runs N ms once the navigation is under way (paused while a fetch is
pending), and the DOM or the picture is taken when it has run out.
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile

import pytest

PAGE_TIMEOUT_S = 120  # a page that does not finish loading fails its test, never hangs it


def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "Debian's chromium is not installed: apt-get install -y chromium (scripts/test_tools.sh does)"
        if os.environ.get("ACTSTORE_NO_SKIP") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


class Browser:
    """One headless chromium; `page()` opens a tab, loads a URL and closes the tab."""

    def __init__(self, exe: str):
        self.profile = tempfile.mkdtemp(prefix="actstore-chromium-")
        # chromium reads commands from fd 3 and writes replies to fd 4 (--remote-debugging-pipe);
        # the pipes are made above fd 4 so that the shell's redirections cannot clobber them.
        cmd_r, self._cmd_w = (_above_4(f) for f in os.pipe())
        self._reply_r, reply_w = (_above_4(f) for f in os.pipe())
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{cmd_r} 4>&{reply_w}', exe, "--headless", "--no-sandbox"]
            + ["--disable-gpu", f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(cmd_r, reply_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(cmd_r)
        os.close(reply_w)
        self._buf, self._id, self._events = b"", 0, []

    def page(self, url: str, *, size: tuple[int, int] = (800, 600), budget_ms: int = 5000, dom=True, png=False):
        """(the DOM as --dump-dom prints it or None, the PNG's bytes or None) of `url` once
        `budget_ms` of virtual time has run (0: once it has loaded), in a viewport of `size`
        (width, height)."""
        tab = self.send("Target.createTarget", url="about:blank")["targetId"]
        try:
            s = self.send("Target.attachToTarget", targetId=tab, flatten=True)["sessionId"]
            width, height = size
            self.send(
                "Emulation.setDeviceMetricsOverride", s, width=width, height=height, deviceScaleFactor=1, mobile=False
            )
            self.send("Page.enable", s)
            if budget_ms:
                self.send("Emulation.setVirtualTimePolicy", s, policy="pause")
            self.send("Page.navigate", s, url=url)
            if budget_ms:
                self.send("Emulation.setVirtualTimePolicy", s, policy="pauseIfNetworkFetchesPending", budget=budget_ms)
                self._event("Emulation.virtualTimeBudgetExpired", s)
            else:  # as the one-shot command without a budget: the load event
                self._event("Page.loadEventFired", s)
            html = None
            if dom:
                js = "document.documentElement.outerHTML"
                html = self.send("Runtime.evaluate", s, expression=js, returnByValue=True)["result"]["value"]
            shot = base64.b64decode(self.send("Page.captureScreenshot", s, format="png")["data"]) if png else None
            return html, shot
        finally:
            self.send("Target.closeTarget", targetId=tab)
            self._events.clear()

    def send(self, method: str, session: str | None = None, **params):
        """A DevTools command's result (events that arrive before it are kept for _event)."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params} | ({"sessionId": session} if session else {})
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                assert "error" not in reply, f"chromium: {method} failed: {reply['error']}"
                return reply["result"]
            self._events.append(reply)

    def _event(self, name: str, session: str) -> dict:
        for e in self._events:
            if e.get("method") == name and e.get("sessionId") == session:
                return e
        while True:
            e = self._read()
            if e.get("method") == name and e.get("sessionId") == session:
                return e
            self._events.append(e)

    def _read(self) -> dict:
        import select

        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._reply_r], [], [], PAGE_TIMEOUT_S)
            chunk = os.read(self._reply_r, 1 << 20) if ready else None
            if not chunk:
                self.close()
                why = "closed its pipe" if ready else f"gave no answer in {PAGE_TIMEOUT_S} s"
                raise AssertionError(f"chromium {why}: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def close(self) -> None:
        global _BROWSER
        _BROWSER = None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._cmd_w, self._reply_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


def _above_4(fd: int) -> int:
    """`fd` moved to a number above 10 (close-on-exec, as os.pipe's)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


_BROWSER: Browser | None = None


def browser() -> Browser:
    """This process's browser (one per pytest-xdist worker), started at the first page."""
    global _BROWSER
    if _BROWSER is None or _BROWSER.proc.poll() is not None:
        _BROWSER = Browser(_chromium())
        atexit.register(_BROWSER.close)
    return _BROWSER


def _browser(exe, *args, url):
    """A page as `chromium --headless ARGS... URL` gives it (the flags of the one-shot command:
    --dump-dom, --screenshot=PATH, --window-size=W,H, --virtual-time-budget=MS), loaded in the
    process's one browser; `exe` and the profile folder (args[0]) are kept for the callers'
    spelling: the tabs share the browser's profile. Returns the DOM ("" without --dump-dom)."""
    flags = dict(a.removeprefix("--").partition("=")[::2] for a in args[1:])
    unknown = set(flags) - {"dump-dom", "screenshot", "window-size", "virtual-time-budget"}
    assert not unknown, f"browser.py does not know the chromium flags {sorted(unknown)}"
    width, height = (int(v) for v in flags.get("window-size", "800,600").split(","))
    html, png = browser().page(
        url,
        size=(width, height),
        budget_ms=int(flags.get("virtual-time-budget") or 0),
        dom="dump-dom" in flags,
        png="screenshot" in flags,
    )
    if png is not None:
        with open(flags["screenshot"], "wb") as f:
            f.write(png)
    return html + "\n" if html is not None else ""


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
