"""The command line's grammar, spelled once (docs/cli.md, "The grammar").

Every command follows it, and tests/test_cli_grammar.py walks every registered command:

- a command that makes a store takes it positionally (`write STORE`, `cp SRC DST`,
  `import-* SOURCE STORE`);
- a command that derives files from a store names them with `--out/-o` (`out_option`); a
  positional output it had stays one release as a deprecated alias;
- `--layer` / `--layers` take numbers and names alike (actstore.read.layers parses them);
- special tokens have one vocabulary, `--special keep|mask|drop` (`special_option`);
- an existing output is refused unless `--overwrite` (`overwrite_option`, `refuse_existing`);
- every missing required parameter is named in one error (`check_missing`);
- every command takes `--quiet` and `--json` (`quiet_json`);
- a command that encodes a layer with a dictionary names its directions one way
  (`encoder_options`: --neurons, --sae, --saev, --dictionary, --directions, --bias);
- an old spelling still works for one release and says so on stderr (`alias`, `deprecated`):
  `actstore: warning: --keep-special is deprecated; use --special keep`.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from actstore.errors import OutputExistsError

SPECIAL = ("keep", "mask", "drop")  # the one vocabulary; a command takes the words that mean something to it
_ALIASES = "actstore.aliases"  # ctx.meta: target parameter name -> (the old spelling used, its value)
_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def warn(message: str) -> None:
    """One `actstore: warning: ...` line on stderr (actstore.progress.warn)."""
    from actstore.progress import warn as warn_line

    warn_line(message)


def deprecated(old: str, new: str) -> None:
    """Say on stderr that `old` still works for this release and what replaces it."""
    warn(f"{old} is deprecated; use {new}")


# -- deprecated spellings ---------------------------------------------------------------


def alias(
    *decls: str, of: str, use: str, value: Callable[[Any], Any] | None = None, argument: bool = False, **attrs: Any
) -> Callable:
    """Decorator: a deprecated spelling of the parameter named `of`, spelled `use` today.

    The old spelling is hidden from --help, parsed first (eager), warns when given, and hands
    its value (through `value`, e.g. a flag -> a --special word) to the parameter `of`, which
    must be declared with `callback=resolve` (or a callback that calls it). Giving both
    spellings is a usage error. `argument=True` makes a positional alias (an old positional
    output); otherwise `decls` are option names. `attrs` go to click (a type, is_flag).
    """
    spelled = decls[0] if not argument else f"{decls[0].upper()} as an argument"
    name = f"_alias_{of}_{decls[0].lstrip('-').replace('-', '_')}"

    def remember(ctx: click.Context, param: click.Parameter, got: Any) -> Any:
        if ctx.get_parameter_source(param.name) in _GIVEN and got is not None and not ctx.resilient_parsing:
            word = spelled if argument else _spelling(param, got)
            deprecated(word, use)
            ctx.meta.setdefault(_ALIASES, {})[of] = (word, value(got) if value else got)
        return got

    def deco(f: Callable) -> Callable:
        if argument:
            param = click.argument(
                name,
                required=False,
                is_eager=True,
                expose_value=False,
                callback=remember,
                metavar=f"[{decls[0]}]",
                **attrs,
            )
        else:
            param = click.option(
                *decls, name, hidden=True, is_eager=True, expose_value=False, callback=remember, **attrs
            )
        f = param(f)
        f.__click_params__[-1].alias_of = of  # what check_missing and the grammar test read
        return f

    return deco


def _spelling(param: click.Parameter, got: Any) -> str:
    """The option name the user typed: for a --x/--no-x pair, the one its value says."""
    if getattr(param, "secondary_opts", None) and got is False:
        return param.secondary_opts[0]
    return param.opts[0]


def resolve(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Callback of a parameter that has deprecated aliases: their value when one was given,
    a usage error when both spellings were, MissingParameter when a parameter required
    here (`param.required_here`) got neither."""
    old = ctx.meta.get(_ALIASES, {}).get(param.name)
    if old is not None:
        word, old_value = old
        if ctx.get_parameter_source(param.name) in _GIVEN:
            raise click.UsageError(f"{word} and {_label(param)} say the same thing: give {_label(param)} only", ctx)
        value = old_value
    if value is None and getattr(param, "required_here", False) and not ctx.resilient_parsing:
        raise click.MissingParameter(ctx=ctx, param=param)
    return value


def required_argument(name: str, metavar: str, **attrs: Any) -> Callable:
    """Decorator: a positional argument that is required, though a deprecated option (an
    `alias` of it) may stand in for it."""

    def deco(f: Callable) -> Callable:
        f = click.argument(name, required=False, metavar=metavar, callback=resolve, **attrs)(f)
        f.__click_params__[-1].required_here = True
        return f

    return deco


def _label(param: click.Parameter) -> str:
    """How a message names `param`: its long option (--out, not -o), or its metavar."""
    return max(param.opts, key=len) if isinstance(param, click.Option) else (param.metavar or param.name.upper())


# -- the output ---------------------------------------------------------------------------


def out_option(help: str, *, positional: str | None = None, required: bool = True, type: Any = None) -> Callable:
    """Decorator: `--out/-o` (parameter `out`); with `positional`, the old positional output
    (e.g. "OUT", "DUMP_TO") as its deprecated alias. Put it after the store's argument."""

    def deco(f: Callable) -> Callable:
        f = click.option("-o", "--out", "out", type=type, callback=resolve, help=help)(f)
        f.__click_params__[-1].required_here = required
        if positional:
            f = alias(positional, of="out", use="--out", argument=True, type=type)(f)
        return f

    return deco


def overwrite_option(help: str = "Replace an existing output (default: refuse it).") -> Callable:
    return click.option("--overwrite", is_flag=True, help=help)


def output_exists(location: str | os.PathLike) -> bool:
    """Whether `location` holds an output already: a file, a folder that is not empty, or an
    object-store prefix with objects under it (an empty folder is no output)."""
    from actstore.storage import is_url, open_storage

    if is_url(location):
        return next(iter(open_storage(location).list("")), None) is not None
    path = Path(location)
    if path.is_dir():
        return next(path.iterdir(), None) is not None
    return path.exists() or path.is_symlink()


def refuse_existing(location: str | os.PathLike, overwrite: bool, *, flag: str = "--out") -> None:
    """The one existing-output rule: an output that exists is replaced only with --overwrite."""
    if not overwrite and output_exists(location):
        raise OutputExistsError(
            f"{location} exists; pass --overwrite to replace it, or choose another {flag} (nothing was written)"
        )


# -- --quiet, --json ----------------------------------------------------------------------


def quiet_json(
    quiet: str = "No progress, nothing printed on success.",
    json: str = "Print one JSON summary on stdout instead of the text.",
    *,
    old_progress: bool = False,
) -> Callable:
    """Decorator: `--quiet` (parameter `quiet`) and `--json` (parameter `as_json`); with
    `old_progress`, the former `--progress/--no-progress` as deprecated aliases of --quiet."""

    def deco(f: Callable) -> Callable:
        f = click.option("--json", "as_json", is_flag=True, help=json)(f)
        f.__click_params__[-1].grammar = "quiet_json"  # what tests/test_cli_options.py reads
        f = click.option("--quiet", is_flag=True, callback=resolve, help=quiet)(f)
        f.__click_params__[-1].grammar = "quiet_json"
        if old_progress:
            f = alias("--no-progress", of="quiet", use="--quiet", value=lambda _: True, is_flag=True, default=None)(f)
            f = alias(
                "--progress",
                of="quiet",
                use="the default (progress is shown unless --quiet)",
                value=lambda _: False,
                is_flag=True,
                default=None,
            )(f)
        return f

    return deco


def echo_json(obj: Any) -> None:
    """The --json answer: one JSON document on stdout (a dataclass report: its shown fields)."""
    import json

    click.echo(json.dumps(report_fields(obj), default=str))


def report_fields(obj: Any) -> Any:
    """A dataclass report as a dict of its shown fields (a lock or a cache left out); else `obj`."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.repr}
    return obj


# -- special tokens -----------------------------------------------------------------------

READ_SPECIAL_HELP = (
    "Special and chat-template tokens (a text store whose labels mark token kinds): keep them, or drop them "
    "(leave them out). Default: as the loaders' default mask (drop for such a store)."
)


def special_option(
    choices: Sequence[str] = ("keep", "drop"),
    *,
    help: str = READ_SPECIAL_HELP,
    default: str | None = None,
    aliases: Sequence[tuple[str, str]] = (),
) -> Callable:
    """Decorator: `--special WORD` (parameter `special`), WORD one of `choices` (a subset of
    SPECIAL), and deprecated flags that stand for a word, e.g. ("--keep-special", "keep")."""
    bad = [c for c in choices if c not in SPECIAL]
    if bad:
        raise ValueError(f"--special words are {list(SPECIAL)}; {bad} is not one")

    def deco(f: Callable) -> Callable:
        for flag, word in aliases:
            f = alias(
                flag, of="special", use=f"--special {word}", value=lambda _v, w=word: w, is_flag=True, default=None
            )(f)
        return click.option(
            "--special",
            type=click.Choice(list(choices)),
            default=default,
            show_default=default is not None,
            callback=resolve,
            help=help,
        )(f)

    return deco


# -- the directions a command encodes a layer with ------------------------------------------

ENCODERS = (  # (option, help): parameters neurons, sae, saev, dictionary, directions, bias
    ("--neurons", "Directions: the stored dimensions themselves."),
    ("--sae", "Directions: an SAELens checkpoint folder (cfg.json + sae_weights.safetensors)."),
    ("--saev", "Directions: a saev checkpoint file."),
    ("--dictionary", "Directions: a dictionary_learning trainer folder (ae.pt + config.json)."),
    ("--directions", "Directions: a (d_model, F) matrix, .npy or .safetensors (probes)."),
    ("--bias", "With --directions: an (F,) bias .npy."),
)


def encoder_options(f: Callable) -> Callable:
    """Decorator: the encoder choice of every feature command (ENCODERS; the command hands
    them to actstore.features.encoders.sources.load). --neurons is a flag, the others existing paths."""
    for flag, text in reversed(ENCODERS):
        kind: dict[str, Any] = {"is_flag": True} if flag == "--neurons" else {"type": click.Path(exists=True)}
        f = click.option(flag, help=text, **kind)(f)
    return f


# -- the rest -----------------------------------------------------------------------------


def check_missing(command: click.Command, name: str, args: Sequence[str], parent: click.Context) -> None:
    """Name every missing required parameter of `command` in one usage error (click names the
    first only), before click parses `args`. A parameter is required when click's `required`
    or the grammar's `required_here` says so; an alias given stands for its parameter. It
    runs only on a line click parses: a typo (`--jsn`) is left to click's own answer, "No
    such option '--jsn'. Did you mean '--json'?", not reported as missing parameters."""
    # Not resilient: a resilient parse swallows the typo's error and stops there, so the
    # arguments after it would look missing (`info STORE --jsn` -> "Missing argument 'STORE'").
    ctx = click.Context(command, info_name=name, parent=parent)
    try:
        opts, _, _ = command.make_parser(ctx).parse_args(args=list(args))
    except click.UsageError:
        return  # click reports it when it parses for real
    params = command.get_params(ctx)
    if any(p.is_eager and _given(opts, p) and not hasattr(p, "alias_of") for p in params):
        return  # --help, --version: nothing is missing
    aliased = {p.alias_of for p in params if hasattr(p, "alias_of") and _given(opts, p)}
    missing = [
        p
        for p in params
        if (p.required or getattr(p, "required_here", False))
        and not _given(opts, p)
        and p.name not in aliased
        and _unset(p.default)
        and p.resolve_envvar_value(ctx) is None
    ]
    if not missing:
        return
    words = []
    for kind, group in (("argument", click.Argument), ("option", click.Option)):
        hints = [p.get_error_hint(ctx) for p in missing if isinstance(p, group)]
        if hints:
            words.append(f"{kind}{'s' if len(hints) > 1 else ''} {', '.join(hints)}")
    raise click.UsageError(f"Missing {' and '.join(words)}.", click.Context(command, info_name=name, parent=parent))


def _given(opts: dict[str, Any], param: click.Parameter) -> bool:
    return not _unset(opts.get(param.name))


def _unset(value: Any) -> bool:
    """None, an empty tuple, or click's UNSET sentinel (click >= 8.2; an Enum member)."""
    return value is None or value == () or isinstance(value, enum.Enum)


# The optional packages, by import name: (what pip installs, the extra of pyproject.toml that
# brings it). The `research` extra brings every one but ray's and the embedded models'.
OPTIONAL = {
    "torch": ("torch", "torch"),
    "transformers": ("transformers", "capture"),
    "PIL": ("pillow", "capture"),
    "datasets": ("datasets", "saelens"),
    "pyarrow": ("pyarrow", "views"),
    "safetensors": ("safetensors", "views"),
    "numba": ("numba", "views"),
    "threadpoolctl": ("threadpoolctl", "views"),
    "ray": ("ray", "ray"),
    "gguf": ("gguf", "embedded"),
}
RESEARCH = "research"  # the extra of the whole loop: capture, views, exports
_IN_RESEARCH = ("torch", "capture", "views", "saelens")  # the extras `research` holds

# What a command needs whatever its options, checked before it starts (`guard_extras`):
# (import names, the extra that brings them all). A need that depends on the options is
# checked where it arises (`write`, `show`), and an import that fails anyway is named by
# the group (`missing_module`).
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "export-saelens": (("torch", "datasets", "pyarrow"), "saelens"),
    "features": (("pyarrow",), "views"),
    "view": (("pyarrow",), "views"),
    "export-neuronpedia": (("pyarrow",), "views"),
}


def needs_message(command: str, missing: Sequence[str], extra: str) -> str:
    """The one line that refuses `actstore COMMAND` for want of `missing` (import names)."""
    names = " and ".join(OPTIONAL.get(m, (m,))[0] for m in missing)
    also = f" (or 'actstore[{RESEARCH}]': capture, views and every export)" if extra in _IN_RESEARCH else ""
    return f"`actstore {command}` needs {names}, not installed here: pip install 'actstore[{extra}]'{also}"


def require_extras(command: str, modules: tuple[str, ...], extra: str = "capture") -> None:
    """Exit 1 with the install command when a package `command` needs is missing (the core
    install, `pip install actstore`, has no torch)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        click.echo(f"actstore: error: {needs_message(command, missing, extra)}", err=True)
        sys.exit(1)


def missing_module(command: str | None, error: ModuleNotFoundError) -> str | None:
    """The one line for an optional package an import found missing (None: not one of them)."""
    top = (error.name or "").partition(".")[0]
    if top not in OPTIONAL:
        return None
    return needs_message(command or "", [top], OPTIONAL[top][1])


def guard_extras(group: click.Group) -> None:
    """Make every command of NEEDS refuse, before it starts (after its line is parsed, so
    that --help works anywhere), when a package it needs is missing."""
    for name, (modules, extra) in NEEDS.items():
        command = group.commands.get(name)
        if command is not None:  # (a command module that is not there registered nothing)
            command.callback = _guarded(command.callback, name, modules, extra)


def _guarded(callback: Callable, name: str, modules: tuple[str, ...], extra: str) -> Callable:
    import functools

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        require_extras(name, modules, extra)
        return callback(*args, **kwargs)

    return run
