"""Each option spelled once (issue 43): `write`'s click options are generated from the
fields of CaptureOptions (default and help written once, in the field), every option of
every command has help, --quiet/--json come from the one grammar on every command, the
encoder choice is one group, record()'s keywords are typed by one TypedDict of the
fields, and no public function takes untyped `**kwargs: Any` beyond a known list."""

from __future__ import annotations

import ast
import enum
import inspect
import typing
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import click
import pytest

from actstore.capture.options import FIELDS, CaptureOptions, OldRecordSettings, RecordSettings
from actstore.cli import grammar as G
from actstore.cli import main
from actstore.cli.capture import options as write_options
from actstore.cli.fields import to_field, to_option
from actstore.optionspec import spec_of
from actstore.write.options import WriterOptions

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "actstore"
COMMANDS = sorted(main.commands)
WRITE_ONLY_CLI = {"no_system", "quiet", "as_json"}  # options of `write` that are no field


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option)]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help(name):
    for p in _options(main.commands[name]):
        if p.hidden:
            continue  # an old spelling: hidden from --help
        assert p.help and p.help.strip(), f"actstore {name} {p.opts[0]} has no help"


@pytest.mark.parametrize("name", COMMANDS)
def test_quiet_and_json_come_from_the_one_grammar(name):
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert "**Every command takes `--quiet` and `--json`**" in doc  # the grammar this test holds the code to
    by_flag = {p.opts[0]: p for p in _options(main.commands[name])}
    for flag in ("--quiet", "--json"):
        assert flag in by_flag, f"actstore {name} lacks {flag}"
        assert getattr(by_flag[flag], "grammar", None) == "quiet_json", (
            f"actstore {name}: {flag} is written by hand; use cli.grammar.quiet_json"
        )


def test_write_options_are_generated_from_the_fields_with_their_defaults():
    write = main.commands["write"]
    offered = {f.name for f in fields(CaptureOptions) if spec_of(f) is not None}
    seen = set()
    for p in _options(write):
        if getattr(p, "alias_of", None) or p.name in WRITE_ONLY_CLI:
            continue
        f = getattr(p, "field", None)
        assert f is not None and p.name in FIELDS, f"write {p.opts[0]} is no generated field option"
        spec = spec_of(f)
        seen.add(f.name)
        if spec.required:
            assert p.required and (p.default is None or isinstance(p.default, enum.Enum)), (
                f"write {p.opts[0]} is required: it has no default"
            )  # (click >= 8.2: an UNSET member)
        else:
            assert p.default == to_option(spec, f.default), f"write {p.opts[0]}'s default differs from its field's"
            assert to_field(spec, p.default) == f.default
        assert p.help == spec.help
    assert seen == offered, f"fields with an OptionSpec that write does not offer: {sorted(offered - seen)}"


@pytest.mark.parametrize("name", ["import-activault", "import-saelens", "import-dictionary-learning"])
def test_the_importers_take_writes_zarr_format_option(name):
    """--zarr-format of an importer is the writer's field, as `write` offers it: one default, one help."""
    from actstore.importers.driver import run_import
    from actstore.write.options import LayoutOptions

    mine = {p.name: p for p in _options(main.commands[name])}["zarr_format"]
    write = {p.name: p for p in _options(main.commands["write"])}["zarr_format"]
    field = {f.name: f for f in fields(LayoutOptions)}["zarr_format"]
    assert mine.field is field and write.field is field
    assert (
        (mine.default, mine.help, mine.opts)
        == (write.default, write.help, write.opts)
        == ("3", spec_of(field).help, ["--zarr-format"])
    )
    assert inspect.signature(run_import).parameters["zarr_format"].default == field.default == 3


def test_no_option_of_write_spells_a_default_in_its_source():
    """The option decorators of cli/capture.py give no `default=`: the fields do."""
    tree = ast.parse((PKG / "cli" / "capture.py").read_text())
    spelled = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and any(k.arg in ("default", "show_default") for k in node.keywords)
    ]
    assert not spelled, f"cli/capture.py spells option defaults at lines {spelled}"


def test_a_bare_write_line_means_the_python_defaults(tmp_path):
    """`actstore write STORE --model M --data D --layers 6` builds the CaptureOptions that
    CaptureOptions(store=..., model=..., data=..., layers=(6,)) is: no default differs."""
    write = main.commands["write"]
    line = [str(tmp_path / "s"), "--model", "m", "--data", "d", "--layers", "6,8-9"]
    with write.make_context("write", list(line)) as ctx:  # (click consumes the list it parses)
        got = write_options(ctx.params["store"], dict(ctx.params))
    assert got == CaptureOptions(store=str(tmp_path / "s"), model="m", data="d", layers=(6, 8, 9))
    line += ["--no-stats", "--commit-mb", "1.5", "--zarr-format", "2", "--shard-examples", "auto", "--no-finalize"]
    with write.make_context("write", [*line, "--quiet", "--no-system", "--chat-template", "--runner", "ray"]) as ctx:
        got = write_options(ctx.params["store"], dict(ctx.params))
    assert (got.stats, got.commit_bytes, got.zarr_format, got.shard_examples, got.finalize) == (
        False,
        int(1.5 * 2**20),
        2,
        "auto",
        False,
    )
    assert (got.progress, got.system, got.runner) == (False, "", "ray")


def test_writer_options_is_the_writers_value():
    o = CaptureOptions(commit_bytes=4096, fsync=True, on_overflow="clip", writer_threads=3, resume=True, stats=False)
    assert o.writer_options(4) == WriterOptions(
        resume=True, commit_bytes=4096, on_overflow="clip", stats=False, fsync=True, world_size=4, io_threads=3
    )
    # each layer's part is a value of its own, and the parts make the whole
    parts = {**vars(o.inputs), **vars(o.pipeline), **vars(o.layout)}
    assert CaptureOptions(**parts) == o and len(parts) == len(FIELDS)


def test_record_settings_are_the_fields_typed():
    hints = typing.get_type_hints(CaptureOptions)
    typed = typing.get_type_hints(RecordSettings)
    assert set(typed) == set(FIELDS)
    widened = {"layers": Sequence[int | str]}  # record(layers=[6, 11]): any sequence
    for name, t in typed.items():
        assert t == widened.get(name, hints[name]), f"RecordSettings.{name} is {t}; the field is {hints[name]}"
    assert set(typing.get_type_hints(OldRecordSettings)) - set(typed) == {"engine", "drop_cls"}


@pytest.mark.parametrize("name", ["features", "export-delphi"])
def test_every_feature_command_names_its_encoder_one_way(name):
    by_flag = {p.opts[0]: p for p in _options(main.commands[name])}
    for flag, text in G.ENCODERS:
        assert by_flag[flag].help == text


# Public functions that still take `**kwargs: Any` (or untyped `**kwargs`), each with why;
# a new one fails the test below. Shrink this list; never grow it.
KNOWN_UNTYPED_KWARGS = {
    "actstore.importers.import_activault": "the importers' keywords (issue 43: config=/options=)",
    "actstore.importers.import_saelens": "the importers' keywords (issue 43: config=/options=)",
    "actstore.importers.import_dictionary_learning": "the importers' keywords (issue 43: config=/options=)",
    "actstore.loaders.aligned.AlignedTokenStream.__init__": "TokenStream's spec (issue 43, item 4)",
    "actstore.loaders.aligned.AlignedTokenStream.loader": "torch DataLoader's keywords",
    "actstore.loaders.follow.FollowStream.loader": "torch DataLoader's keywords",
    "actstore.loaders.pairs.PairDataset.sampler": "PairBatchSampler's keywords",
    "actstore.loaders.pairs.PairDataset.loader": "torch DataLoader's keywords",
    "actstore.progress.bar": "tqdm's keywords",
    "actstore.read.saevstore.SaevStore.__init__": "the opener's keywords, ignored by this reader",
    "actstore.saelens.adapter.saelens_data_provider": "TokenStream's keywords",
    "actstore.trainers.dictionary_learning.DictionaryLearningSource.__init__": "TokenStream's keywords",
    "actstore.trainers.dictionary_learning.paired_source": "PairDataset's keywords",
    "actstore.trainers.sparsify.ReplayModel.forward": "a model's forward keywords, ignored",
    "actstore.trainers.sparsify.sparsify_inputs": "TokenStream's keywords",
    "actstore.verify.check.Checker.add": "where a problem is: fields of the report",
    "actstore.verify.check.Checker.odd_entry": "where a problem is: fields of the report",
    "actstore.verify.check.Checker.not_a_chunk_file": "where a problem is: fields of the report",
    "actstore.verify.check.Checker.symlink": "where a problem is: fields of the report",
    "actstore.write.writer.ShardWriter.append": "segment name -> activations",
}
_PUBLIC_DUNDERS = ("__init__", "__new__", "__call__")


def _untyped_kwargs() -> list[str]:
    """Public functions and public classes' methods of the package (the CLI aside) whose
    `**kwargs` is typed Any or not at all."""
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        parts = [x for x in path.relative_to(PKG.parent).with_suffix("").parts if x != "__init__"]
        if parts[1:2] == ["cli"] or any(x.startswith("_") for x in parts[1:]):
            continue
        module = ".".join(parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                hits += _check(node, module)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        not m.name.startswith("_") or m.name in _PUBLIC_DUNDERS
                    ):
                        hits += _check(m, f"{module}.{node.name}")
    return hits


def _check(fn: ast.FunctionDef | ast.AsyncFunctionDef, owner: str) -> list[str]:
    kw = fn.args.kwarg
    if kw is None:
        return []
    ann = kw.annotation
    untyped = ann is None or (isinstance(ann, ast.Name) and ann.id == "Any")
    return [f"{owner}.{fn.name}"] if untyped else []


def test_no_public_function_takes_untyped_keywords():
    found = _untyped_kwargs()
    new = sorted(set(found) - set(KNOWN_UNTYPED_KWARGS))
    assert not new, f"public functions with `**kwargs: Any` (type them: a TypedDict with Unpack, or a value): {new}"
    assert "actstore.capture.record.record" not in found and "actstore.optionspec.option" not in found
    assert not [h for h in found if h.startswith("actstore.capture.")]  # record() and the runners: typed


def test_the_scan_finds_an_untyped_keywords_signature():
    """The scan itself: it sees `**kw: Any` and bare `**kw`, and not `**kw: Unpack[...]`."""
    tree = ast.parse("def a(**kw: Any): ...\ndef b(**kw): ...\ndef c(**kw: Unpack[RecordSettings]): ...\ndef d(x): ...")
    assert [h for fn in tree.body for h in _check(fn, "m")] == ["m.a", "m.b"]
