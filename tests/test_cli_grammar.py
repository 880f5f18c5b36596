"""The command line's grammar (docs/cli.md, "The grammar"), checked on every command the
click group holds, by introspection: a command another module registers is checked as soon
as it is registered; then the parts that need no store beyond the factory's (deprecated
spellings, missing options). tests/test_cli_workflow.py runs the grammar along a workflow."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from factory import vit_store

from actstore.cli import OTHER, SECTIONS, main, section_of
from actstore.cli import grammar as G

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = sorted(main.commands)
# Commands that derive files from a store (named with --out/-o) and those that make a store
# (taken positionally), by name; new export-* / import-* commands are placed by their prefix.
DERIVING = {"features", "view", "show", "export-neuronpedia"}
MAKING = {"write", "cp", "link-run"}
OLD_SPELLINGS = {"--keep-special", "--skip-special", "--no-progress", "--progress", "--run", "--hook"}


def _cmd(name: str) -> click.Command:
    return main.commands[name]


def _options(name: str, *, hidden: bool = False) -> list[click.Option]:
    return [p for p in _cmd(name).params if isinstance(p, click.Option) and p.hidden == hidden]


def _flags(name: str) -> set[str]:
    return {o for p in _options(name) for o in p.opts + p.secondary_opts}


def _arguments(name: str) -> list[click.Argument]:
    """The positional arguments of today's grammar (old positional outputs left out)."""
    return [p for p in _cmd(name).params if isinstance(p, click.Argument) and not hasattr(p, "alias_of")]


def _derives(name: str) -> bool:
    return name in DERIVING or name.startswith("export-")


def _makes(name: str) -> bool:
    return name in MAKING or name.startswith("import-")


@pytest.mark.parametrize("name", COMMANDS)
def test_quiet_and_json_on_every_command(name):
    opts = {p.opts[0]: p for p in _options(name)}
    assert "--quiet" in opts and "--json" in opts, f"actstore {name} lacks --quiet or --json"
    assert opts["--quiet"].is_flag and opts["--json"].is_flag and opts["--json"].name == "as_json"


def test_every_command_has_a_help_section():
    assert [n for n in COMMANDS if section_of(n) == OTHER] == [], "place them in actstore.cli.SECTIONS"
    text = CliRunner().invoke(main, ["--help"]).output
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["Options", *[s for s in SECTIONS if any(section_of(n) == s for n in COMMANDS)]]
    for name in COMMANDS:
        section = text.split(f"\n{section_of(name)}:\n", 1)[1].split("\n\n", 1)[0]
        assert re.search(rf"^  {re.escape(name)}\s", section, re.M), f"{name} is not listed under {section_of(name)}"
    assert section_of("bench") == "Developer tools"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_of_every_command(name):
    res = CliRunner().invoke(main, [name, "--help"])
    assert res.exit_code == 0 and res.output.startswith("Usage: ") and "--quiet" in res.output, res.output


@pytest.mark.parametrize("name", COMMANDS)
def test_outputs_are_named_with_out_and_never_replaced_silently(name):
    flags = _flags(name)
    out = [p for p in _options(name) if p.name == "out"]
    if _derives(name):
        assert out, f"actstore {name} derives files: name them with --out/-o"
    if out:
        assert set(out[0].opts) == {"-o", "--out"}, f"actstore {name}: the output is -o/--out"
        assert "--overwrite" in flags, f"actstore {name} writes --out: it refuses an existing one unless --overwrite"
    if _makes(name):
        assert not out and len(_arguments(name)) >= 1, f"actstore {name} makes a store: it takes it positionally"
    if _derives(name):  # the store (or the folder it derives from) is the one positional argument
        assert len(_arguments(name)) == 1, f"actstore {name}: {[a.name for a in _arguments(name)]}"


@pytest.mark.parametrize("name", COMMANDS)
def test_layers_take_numbers_and_names(name):
    for p in _options(name):
        if p.name in ("layer", "layers"):
            assert p.type is click.STRING, f"actstore {name} {p.opts[0]} must take names too, not {p.type}"


@pytest.mark.parametrize("name", COMMANDS)
def test_special_tokens_have_one_vocabulary(name):
    for p in _options(name):
        if any("special" in o for o in p.opts + p.secondary_opts):
            assert p.opts == ["--special"] and isinstance(p.type, click.Choice), f"actstore {name}: {p.opts}"
            assert set(p.type.choices) <= set(G.SPECIAL), p.type.choices


@pytest.mark.parametrize("name", COMMANDS)
def test_old_spellings_are_hidden_aliases_of_todays(name):
    assert not (_flags(name) & OLD_SPELLINGS), f"actstore {name} shows a deprecated spelling in --help"
    params = {p.name: p for p in _cmd(name).params}
    for p in _cmd(name).params:
        if hasattr(p, "alias_of"):
            target = params.get(p.alias_of)
            assert target is not None and target.callback is G.resolve, f"actstore {name}: {p.name} -> {p.alias_of}"
            assert p.is_eager and not p.expose_value and (isinstance(p, click.Argument) or p.hidden)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_missing_parameter_is_named_at_once(name):
    ctx = click.Context(_cmd(name), info_name=name)
    required = [
        p
        for p in _cmd(name).params
        if (p.required or getattr(p, "required_here", False)) and G._unset(p.default) and p.envvar is None
    ]
    if not required:  # (then the command runs: `bench` alone runs every benchmark)
        return
    res = CliRunner().invoke(main, [name])
    assert res.exit_code == 2, res.output
    message = res.output.strip().splitlines()[-1]
    assert message.startswith("Error: Missing "), res.output
    assert [p.name for p in required if p.get_error_hint(ctx) not in message] == [], message


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("typo", ["--jsn", "--quite"])
def test_a_typo_gets_clicks_own_answer(name, typo):
    """An unknown option is click's "No such option" naming it (and what it resembles), exit 2,
    wherever it stands: never "Missing argument" for the arguments a failed pre-check lost."""
    longs = sorted({o for p in _cmd(name).params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts})
    expected = click.NoSuchOption(typo, possibilities=[o for o in longs if o.startswith("--")]).format_message()
    assert typo in expected and ("--json" if typo == "--jsn" else "--quiet") in expected, expected
    positionals = [f"ARG{i}" for i in range(len(_arguments(name)))]
    for line in ([*positionals, typo], [typo, *positionals]):
        res = CliRunner().invoke(main, [name, *line])
        assert res.exit_code == 2, res.output
        assert res.output.strip().splitlines()[-1] == f"Error: {expected}", (line, res.output)


def test_a_typo_after_the_store_is_not_a_missing_store():
    res = CliRunner().invoke(main, ["info", "STORE", "--jsn"])
    assert res.exit_code == 2 and "Missing" not in res.output, res.output
    assert res.output.strip().splitlines()[-1] == "Error: No such option '--jsn'. Did you mean '--json'?"
    res = CliRunner().invoke(main, ["features", "STORE", "--layers", "8"])
    assert res.output.strip().splitlines()[-1] == "Error: No such option '--layers'. Did you mean '--layer'?"


@pytest.mark.parametrize("name", COMMANDS)
def test_docs_name_every_command_and_option(name):
    docs = (ROOT / "docs" / "cli.md").read_text()
    if name == "write":  # write's many options are explained in docs/capture.md
        docs += (ROOT / "docs" / "capture.md").read_text()
    assert f"### `actstore {name}" in docs, f"docs/cli.md has no section for actstore {name}"
    missing = sorted(o for o in _flags(name) if o.startswith("--") and o not in ("--help",) and o not in docs)
    assert missing == [], f"options of actstore {name} not in the docs: {missing}"


# -- the grammar at work, without a model or the views -----------------------------------------


def run(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, res.output
    return res


def test_old_positional_output_and_option_spellings_warn_and_still_work(tmp_path):
    store = vit_store(tmp_path / "s").path
    old = run("export-pkl", store, tmp_path / "a")  # OUT as an argument
    assert old.stderr == "actstore: warning: OUT as an argument is deprecated; use --out\n"
    assert (tmp_path / "a" / "metadata.json").exists()
    both = run("export-pkl", store, tmp_path / "b", "--out", tmp_path / "c", code=2)
    assert "OUT as an argument and --out say the same thing: give --out only" in both.output
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    link = run("link-run", "--run", tmp_path / "runs" / "r", "--train-shards", tmp_path / "nowhere", code=1)
    assert link.stderr.startswith("actstore: warning: --run is deprecated; use RUN as the first argument\n")


def test_missing_options_are_named_together(tmp_path):
    store = vit_store(tmp_path / "s").path
    res = run("features", code=2)
    assert (
        res.output.strip().splitlines()[-1] == "Error: Missing argument 'STORE' and options '--layer', '-o' / '--out'."
    )
    res = run("export-saelens", store, code=2)
    assert res.output.strip().splitlines()[-1] == "Error: Missing options '-o' / '--out', '--layer'."
    res = run("link-run", code=2)
    assert res.output.strip().splitlines()[-1] == "Error: Missing argument 'RUN' and option '--train-shards'."
    res = run("link-run", "--run", "r", code=2)  # the old spelling stands in for RUN
    assert res.output.strip().splitlines()[-1] == "Error: Missing option '--train-shards'."


def test_importers_layer_takes_a_name(tmp_path):
    from actstore.read.layers import number_in_name

    names = ("blocks.8.hook_resid_post", "model.layers.12.mlp", "transformer.h.3", "x")
    assert [number_in_name(n) for n in names] == [8, 12, 3, None]
    res = run("import-dictionary-learning", tmp_path, tmp_path / "s", "--layer", "embed", code=2)
    assert "'embed' is neither a layer number nor a name that holds one" in res.output
