"""`actstore spool status|drop|gc STORE [NAME]`: a spool's budget, consumers and removals."""

from __future__ import annotations

import click

from actstore.cli import grammar as G
from actstore.cli.params import STORE
from actstore.errors import SpoolError
from actstore.layout.spool import format_bytes
from actstore.spoolstate import SpoolState, describe, read_state, spool_lines
from actstore.storage import open_storage
from actstore.write import spool as wspool


def register(main: click.Group) -> None:
    main.add_command(spool_group)


@click.group("spool")
@G.quiet_json(quiet="Print nothing on success.", json="Print the spool as JSON.")
@click.pass_context
def spool_group(ctx: click.Context, quiet: bool, as_json: bool) -> None:
    """A spool (a store written with --spool BUDGET): its consumers and removals.

    \b
    status STORE       the budget, kept and removed blocks, each consumer's lag
    drop STORE NAME    a consumer that will not come back stops holding blocks
    gc STORE           remove the blocks every consumer has read
    """
    ctx.obj = {"quiet": quiet, "as_json": as_json}


def _show(ctx: click.Context, state: SpoolState, head: str | None = None) -> None:
    opts = ctx.find_object(dict) or {}
    if opts.get("as_json"):
        G.echo_json({**describe(state), **({"done": head} if head else {})})
    elif not opts.get("quiet"):
        click.echo("\n".join(([head] if head else []) + spool_lines(describe(state))))


def _state(store: str) -> SpoolState:
    state = read_state(open_storage(store))
    if state is None:
        raise SpoolError(f"{store} is not a spool (it was not written with --spool); nothing to show")
    return state


@spool_group.command("status")
@click.argument("store", type=STORE)
@click.pass_context
def status_cmd(ctx: click.Context, store: str) -> None:
    """Show STORE's spool: budget, kept and removed blocks, each consumer's acked blocks and lag."""
    _show(ctx, _state(store))


@spool_group.command("drop")
@click.argument("store", type=STORE)
@click.argument("name")
@click.pass_context
def drop_cmd(ctx: click.Context, store: str, name: str) -> None:
    """Drop consumer NAME of STORE's spool: it holds no block back any more (writers go on), and
    a consumer of that name that comes back is refused (register it under a new name). Then
    removes the blocks every other consumer has read."""
    state, n, nbytes = wspool.drop(open_storage(store), name)
    _show(ctx, state, f"dropped consumer {name}; removed {n} blocks ({format_bytes(nbytes)})")


@spool_group.command("gc")
@click.argument("store", type=STORE)
@click.pass_context
def gc_cmd(ctx: click.Context, store: str) -> None:
    """Remove the activation files of the blocks every consumer of STORE's spool has read
    (writers do it themselves while they wait; this frees the disk when none runs)."""
    out = wspool.gc(open_storage(store))
    if out is None:
        raise SpoolError(f"{store} is not a spool (it was not written with --spool); nothing to remove")
    state, n, nbytes = out
    _show(ctx, state, f"removed {n} blocks ({format_bytes(nbytes)})")
