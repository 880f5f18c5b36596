"""Optional packages: a command that needs one it cannot import refuses in one line naming
`pip install 'actstore[EXTRA]'` (before any work where the need is known up front, and by
the group wherever an import fails later), and pyproject.toml's extras hold what the CLI
says they do. A missing package is simulated with `sys.modules[name] = None` (then
`import name` raises ModuleNotFoundError and find_spec finds nothing)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from factory import word_store, word_tokenizer

from actstore.cli import grammar as G
from actstore.cli import main

pytestmark = pytest.mark.torch  # word_store's tokenizer is a transformers one; export-saelens streams through torch

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
ALSO = " (or 'actstore[research]': capture, views and every export)"


def _packages(extra: str) -> set[str]:
    return {re.split(r"[<>=\[ ]", req, maxsplit=1)[0].lower() for req in EXTRAS[extra]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("extras")
    return word_store(root / "store", word_tokenizer(root / "tok"))


def _without(monkeypatch, *modules: str) -> None:
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def test_export_saelens_without_datasets_is_one_line_before_any_work(store, tmp_path, monkeypatch):
    _without(monkeypatch, "datasets")
    res = CliRunner().invoke(main, ["export-saelens", str(store), "-o", str(tmp_path / "out"), "--layer", "4"])
    assert res.exit_code == 1, res.output
    assert res.output == (
        "actstore: error: `actstore export-saelens` needs datasets, not installed here: "
        f"pip install 'actstore[saelens]'{ALSO}\n"
    )
    assert not (tmp_path / "out").exists()
    _without(monkeypatch, "torch", "pyarrow")
    res = CliRunner().invoke(main, ["export-saelens", str(store), "-o", str(tmp_path / "out"), "--layer", "4"])
    assert res.output.startswith("actstore: error: `actstore export-saelens` needs torch and datasets and pyarrow,")
    assert CliRunner().invoke(main, ["export-saelens", "--help"]).exit_code == 0  # help needs nothing


def test_an_import_that_fails_later_is_named_by_the_group(store, tmp_path, monkeypatch):
    """Past the up-front check (taken away here), the export's own `import datasets` fails:
    the group turns it into the same one line, and the export leaves nothing behind."""
    command = main.commands["export-saelens"]
    monkeypatch.setattr(command, "callback", command.callback.__wrapped__)
    _without(monkeypatch, "datasets")
    res = CliRunner().invoke(main, ["export-saelens", str(store), "-o", str(tmp_path / "out"), "--layer", "4"])
    assert res.exit_code == 1 and res.exception is not None and isinstance(res.exception, SystemExit)
    assert res.output.splitlines()[-1] == (
        "actstore: error: `actstore export-saelens` needs datasets, not installed here: "
        f"pip install 'actstore[saelens]'{ALSO}"
    )
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_module_that_is_no_optional_package_is_left_alone():
    assert G.missing_module("x", ModuleNotFoundError("no", name="not_a_package_of_ours")) is None
    said = G.missing_module("features", ModuleNotFoundError("no", name="safetensors.numpy"))
    assert said == f"`actstore features` needs safetensors, not installed here: pip install 'actstore[views]'{ALSO}"
    said = G.missing_module("write", ModuleNotFoundError("no", name="ray"))
    assert said == "`actstore write` needs ray, not installed here: pip install 'actstore[ray]'"  # research has no ray


@pytest.mark.parametrize("name", sorted(G.NEEDS))
def test_every_command_that_needs_a_package_refuses_without_it(name, tmp_path, monkeypatch):
    modules, extra = G.NEEDS[name]
    args = {
        "export-saelens": ["--layer", "4"],
        "features": ["--layer", "4", "--neurons"],
    }.get(name, [])
    for m in modules:
        with monkeypatch.context() as mp:
            _without(mp, m)
            res = CliRunner().invoke(main, [name, str(tmp_path), "-o", str(tmp_path / "out"), *args])
            assert res.exit_code == 1, res.output
            package = G.OPTIONAL[m][0]
            assert res.output == (
                f"actstore: error: `actstore {name}` needs {package}, not installed here: "
                f"pip install 'actstore[{extra}]'{ALSO}\n"
            )
            assert not (tmp_path / "out").exists()


def test_the_extras_hold_what_the_cli_names():
    for module, (package, extra) in G.OPTIONAL.items():
        assert package.lower() in _packages(extra), f"pyproject's [{extra}] lacks {package} ({module})"
    for name, (modules, extra) in G.NEEDS.items():
        missing = {G.OPTIONAL[m][0].lower() for m in modules} - _packages(extra)
        assert missing == set(), f"actstore {name}: [{extra}] lacks {missing}"
    research = _packages(G.RESEARCH)
    for extra in G._IN_RESEARCH:
        assert _packages(extra) <= research, f"[research] lacks {_packages(extra) - research} of [{extra}]"
    assert "datasets" in research  # export-saelens's, which only the dev extra had
    for doc in ("README.md", "docs/cli.md", "docs/export.md"):
        assert "actstore[research]" in (ROOT / doc).read_text(), doc
