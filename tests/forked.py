"""A test script's process without a fresh interpreter: `start(script, *args)` forks it from
the test process's forkserver, whose imports (actstore, numpy, torch: tests/conftest.py's
preload) are done once, and runs the script as `python script args` would (`__main__`,
sys.argv, the test process's environment and folder). The process is as separate as a
spawned one (its own memory, files and signals; a SIGKILL ends it mid-write); only the
imports a fresh interpreter pays at each start (0.7 s for actstore, 2-3 s with torch) are
gone. The returned Child reads like subprocess.Popen's (stdout/stderr text pipes, pid, poll,
wait, kill, communicate, returncode); `run` and `run_code` are subprocess.run's."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, args: list[str], env: dict[str, str], cwd: str, out: Any, err: Any, code: str | None) -> None:
    """In the forked process: the caller's environment, folder, stdout and stderr, then the
    script (or, given `code`, that code as `python -c` runs it)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    for p in (str(REPO / "src"), str(REPO), str(REPO / "tests"), str(Path(script).parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    if code is not None:
        sys.argv = ["-c", *args]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's own code
        return
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


class Child:
    """A started script: subprocess.Popen's reading side (text pipes)."""

    def __init__(self, proc: Any, out: Any, err: Any):
        self._proc, self.pid = proc, proc.pid
        # The forkserver, not the test, reaps the process the moment it ends: signals go by a
        # pidfd, which never reaches another process that got the number since (os.kill could).
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # ended already
            self._pidfd = None
        self.stdout = os.fdopen(os.dup(out.fileno()), "r")
        self.stderr = os.fdopen(os.dup(err.fileno()), "r")
        out.close()
        err.close()

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        """SIGKILL, unless the process ended already (as Popen.kill of a process not yet waited for)."""
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self._pidfd is not None and self._proc.exitcode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """The rest of stdout and stderr (read side by side: neither pipe fills), then the exit;
        subprocess.TimeoutExpired past `timeout` (the caller kills, as with Popen)."""
        got: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()), daemon=True)
            for k, f in (("out", self.stdout), ("err", self.stderr))
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout)
            if t.is_alive():
                raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
        self.wait(timeout)
        return got["out"], got["err"]


def start(
    script: str | Path,
    *args: str,
    code: str | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Child:
    """`python script *args` (or `python -c code *args`) forked from the forkserver (see the
    module's text), in the environment `env` and folder `cwd` (default: this process's)."""
    ctx = multiprocessing.get_context("forkserver")
    out_r, out_w = ctx.Pipe(duplex=False)
    err_r, err_w = ctx.Pipe(duplex=False)
    env = dict(os.environ if env is None else env)
    where = str(cwd or os.getcwd())
    proc = ctx.Process(target=_run, args=(str(script), [str(a) for a in args], env, where, out_w, err_w, code))
    proc.start()
    out_w.close()
    err_w.close()
    return Child(proc, out_r, err_r)


def run(script: str | Path, *args: str, timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """`subprocess.run([python, script, *args], capture_output=True, text=True)`, forked
    (start's keywords): its exit code (-9 for a SIGKILL), stdout and stderr."""
    child = start(script, *args, **kw)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    return subprocess.CompletedProcess([str(script), *args], child.returncode, out, err)


def run_code(code: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -c code *args` as `run` runs a script."""
    return run("-c", *args, code=code, timeout=timeout, env=env)


CLI_CODE = """
import resource, runpy, sys
fsize = int(sys.argv.pop(1))
if fsize >= 0:  # the kernel refuses a write past it with EFBIG (Python ignores SIGXFSZ)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.dont_write_bytecode = True  # no cached bytecode written under the limit
runpy.run_module("actstore.cli", run_name="__main__", alter_sys=True)
"""


def run_cli(*args: str, timeout: float, fsize: int = -1, **kw: Any) -> subprocess.CompletedProcess:
    """`python -m actstore.cli ARGS` as `run` runs a script, its files limited to `fsize`
    bytes where given (RLIMIT_FSIZE, as `ulimit -f` limits them)."""
    return run("-c", str(fsize), *map(str, args), code=CLI_CODE, timeout=timeout, **kw)


def writers_from_forkserver(monkeypatch: Any) -> None:
    """For the rest of the test, `--workers N`'s writer processes (actstore.capture.runner_local
    starts them with multiprocessing's "spawn") fork from the forkserver instead, in the test's
    environment and folder of the moment (as a spawned one starts): each is still a process of
    its own that gets its job pickled and reports over the queue, without a fresh interpreter's
    import of torch (seconds each)."""
    real = multiprocessing.get_context
    forked = _ForkedContext(real("forkserver"))
    monkeypatch.setattr(
        multiprocessing, "get_context", lambda method=None: forked if method == "spawn" else real(method)
    )


class _ForkedContext:
    """The forkserver's context, whose processes start in the caller's environment and folder."""

    def __init__(self, ctx: Any):
        self._ctx = ctx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def Process(self, target: Any = None, args: tuple = (), kwargs: dict | None = None, **kw: Any) -> Any:  # noqa: N802 - multiprocessing's name
        here = (dict(os.environ), os.getcwd(), target)
        return self._ctx.Process(target=_in_env, args=(*here, *args), kwargs=kwargs or {}, **kw)


def _in_env(env: dict[str, str], cwd: str, target: Any, *args: Any, **kwargs: Any) -> Any:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    return target(*args, **kwargs)
