"""`actstore bench`: run the benchmark scripts of a source checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


def register(main: click.Group) -> None:
    main.add_command(bench_cmd)


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py")) if BENCH_DIR.is_dir() else []


@click.command("bench", context_settings={"ignore_unknown_options": True})
@click.argument("names", nargs=-1)
@click.option("--list", "list_only", is_flag=True, help="List the benchmarks and exit.")
@click.option(
    "--arg",
    "extra",
    multiple=True,
    help="Extra argument passed to every script (repeatable), e.g. --arg=--examples=500.",
)
@click.option(
    "--quiet",
    is_flag=True,
    help="Print nothing but a failed script's error output (results still go to bench-results/).",
)
def bench_cmd(names: tuple[str, ...], list_only: bool, extra: tuple[str, ...], quiet: bool) -> None:
    """Run benchmarks (all, or NAMES such as `store export loaders capture`).

    Each benchmark measures actstore against the physical limit in the same run (raw
    write, memmap/pread, sequential read) and writes bench-results/<name>.json. They
    live in the source checkout's benchmarks/ folder; docs/benchmarks.md shows figures.
    """
    have = available()
    if not have:
        raise click.ClickException(f"no benchmarks found in {BENCH_DIR}: `actstore bench` runs from a source checkout")
    if list_only:
        click.echo("\n".join(have))
        return
    unknown = [n for n in names if n not in have]
    if unknown:
        raise click.ClickException(f"unknown benchmark(s) {unknown}; available: {have}")
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
    if failed:
        raise click.ClickException(f"benchmarks failed: {failed}")
