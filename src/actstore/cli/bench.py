"""`actstore bench`: run the benchmark scripts of a source checkout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from actstore.cli import grammar as G

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


def register(main: click.Group) -> None:
    main.add_command(bench_cmd)


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py")) if BENCH_DIR.is_dir() else []


@click.command("bench")
@click.argument("names", nargs=-1)
@click.option("--list", "list_only", is_flag=True, help="List the benchmarks and exit.")
@click.option(
    "--arg",
    "extra",
    multiple=True,
    help="Extra argument passed to every script (repeatable), e.g. --arg=--examples=500.",
)
@G.quiet_json(
    quiet="Print nothing but a failed script's error output (results still go to bench-results/).",
    json="Run the scripts quietly and print one JSON document: each benchmark's bench-results/<name>.json "
    "(null where it wrote none) and the failed ones.",
)
def bench_cmd(names: tuple[str, ...], list_only: bool, extra: tuple[str, ...], quiet: bool, as_json: bool) -> None:
    """Run benchmarks (all, or NAMES such as `store export loaders capture`).

    Each benchmark measures actstore against the physical limit in the same run (raw
    write, memmap/pread, sequential read) and writes bench-results/<name>.json. They
    live in the source checkout's benchmarks/ folder; docs/benchmarks.md shows figures.
    """
    have = available()
    if not have:
        raise click.ClickException(f"no benchmarks found in {BENCH_DIR}: `actstore bench` runs from a source checkout")
    if list_only:
        click.echo(json.dumps(have) if as_json else "\n".join(have))
        return
    unknown = [n for n in names if n not in have]
    if unknown:
        raise click.ClickException(f"unknown benchmark(s) {unknown}; available: {have}")
    quiet = quiet or as_json
    started = time.time()
    failed = []
    for name in names or have:
        if not quiet:
            click.echo(f"== {name} ==")
        r = subprocess.run(
            [sys.executable, str(BENCH_DIR / f"bench_{name}.py"), *extra],
            cwd=BENCH_DIR.parent,
            capture_output=quiet,
            text=True,
        )
        if r.returncode:
            failed.append(name)
            if quiet:
                click.echo(r.stderr[-4000:], err=True)
    if as_json:
        G.echo_json({"benchmarks": {n: _result(n, started) for n in names or have}, "failed": failed})
    if failed:
        raise click.ClickException(f"benchmarks failed: {failed}")


def _result(name: str, since: float):
    """What benchmark `name` wrote to bench-results/<name>.json since `since` (None: nothing)."""
    path = BENCH_DIR.parent / "bench-results" / f"{name}.json"
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
