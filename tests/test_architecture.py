"""The architecture, enforced: imports point down the layers (type-checking imports
included), no circles, small modules,
and the format's record keys spelled only in actstore/layout/ (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "actstore"

# The layer order, written once: a module may import modules of its own layer's
# lower entries and of lower layers only. Within a layer, earlier entries sit below
# later ones (an entry may import the entries before it, never those after).
LAYERS: list[list[str]] = [
    ["actstore.errors", "actstore._version", "actstore.progress", "actstore.devices", "actstore.optionspec"],
    ["actstore.layout"],
    ["actstore.storage"],
    [
        "actstore.dtypes",
        "actstore.index",
        "actstore.stats",
        "actstore.catalog",
        "actstore.chunkio",
        "actstore.spoolstate",
    ],
    ["actstore.hostmem"],
    ["actstore.verify", "actstore.write"],
    ["actstore.read"],
    [
        "actstore.inputs",
        "actstore.saev",
        "actstore.legacy",
        "actstore.copy",
        "actstore.loaders",
        "actstore.saelens",
        "actstore.capture",
        "actstore.torch",
        "actstore.importers",
        "actstore.trainers",
    ],
    [
        "actstore.opener",
        "actstore.xarray_backend",
        # features/ along its flow: encoders -> the top-k pass -> views and exports of it
        "actstore.features.staging",
        "actstore.features.encoders",
        "actstore.features.topk",
        "actstore.features.views",
        "actstore.features.exports",
        "actstore.features",
        "actstore",
    ],
    ["actstore.cli"],
]
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _rank(module: str) -> tuple[int, int]:
    """(layer, position in the layer) of the longest matching entry."""
    best = None
    for li, layer in enumerate(LAYERS):
        for ei, entry in enumerate(layer):
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > len(best[2]):
                    best = (li, ei, entry)
    assert best is not None, f"module {module} is in no layer of tests/test_architecture.py: place it"
    return best[0], best[1]


def _entry(module: str) -> str:
    li, ei = _rank(module)
    return LAYERS[li][ei]


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every actstore module `module` imports (also inside functions, and under `if
    TYPE_CHECKING:`: a type a module names is a dependency too), with line numbers."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "actstore"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "actstore":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
    return out


def test_every_module_has_a_layer():
    for m in MODULES:
        _rank(m)


def test_imports_point_down_the_layers():
    bad = []
    for m, path in MODULES.items():
        mine = _rank(m)
        for target, line in _imports(m, path):
            if target not in MODULES:
                target = target.rpartition(".")[0] if target.rpartition(".")[0] in MODULES else target
            theirs = _rank(target)
            if _entry(target) == _entry(m):
                continue  # inside one package: checked for circles below
            if theirs > mine:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {m} imports {target}, which sits above it")
    assert not bad, "imports that run back up the layers:\n" + "\n".join(bad)


def test_no_import_circles():
    graph = {m: {t for t, _ in _imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # A package's __init__ re-exporting its modules is not a circle through them.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


# The only modules that import torch at their top (docs/architecture.md, "Rules"); every
# other use imports it inside the function that needs it, so `import actstore` works without.
TORCH_AT_TOP = ("actstore.loaders", "actstore.torch", "actstore.trainers.sparsify")
# Imports the design rules out though the layers would allow them: the views read stores
# and inputs, never capture.
NEVER = {"actstore.features": ("actstore.capture",)}


def test_torch_is_imported_at_the_top_only_where_the_doc_says():
    bad = []
    for m, path in MODULES.items():
        if m.startswith(TORCH_AT_TOP):
            continue
        for node in _outside_functions(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "torch" or n.startswith("torch.") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "torch imported at a module's top (import it inside the function that needs it):\n" + "\n".join(bad)


def _outside_functions(tree: ast.AST):
    """Every node that runs when the module is imported (under if/try too), not inside a function."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef))]


# The host-memory package's floor: below capture, write and loaders, it needs only these.
HOSTMEM_FLOOR = ("actstore.errors", "actstore.progress", "actstore.dtypes", "actstore.hostmem")


def test_the_host_memory_package_imports_only_its_floor_and_torch_inside_functions():
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("actstore.hostmem"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bad += [
            f"{path.relative_to(ROOT)}:{line}: {t}" for t, line in _imports(m, path) if not t.startswith(HOSTMEM_FLOOR)
        ]
        for node in _outside_functions(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n} at the top" for n in names if n.split(".")[0] == "torch"
            ]
    assert not bad, (
        "actstore.hostmem imports beyond errors, progress and dtypes (torch only inside functions):\n" + "\n".join(bad)
    )


def test_the_views_never_import_capture():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {m} imports {target}"
        for m, path in MODULES.items()
        for prefix, banned in NEVER.items()
        if m.startswith(prefix)
        for target, line in _imports(m, path)
        if target.startswith(banned)
    ]
    assert not bad, "\n".join(bad)


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


# Keys that name fields of the commit record, block records and the manifest only: spelled as
# strings only in actstore/layout/. (Generic words such as "n_examples" or "shards" also
# name fields of the project's APIs -- `store.meta`, `actstore info --json` -- and of saev's
# own documents, so they cannot be told apart by a grep; those records are parsed only by
# actstore/layout/records.py all the same.)
RECORD_KEYS = ("n_committed", "n_blocks", "text_bytes", "stats_file", "format_version", "shard-major")


def test_record_keys_are_spelled_only_in_the_layout_package():
    pattern = re.compile(r"""["'](%s)["']""" % "|".join(RECORD_KEYS))
    bad = []
    for m, path in MODULES.items():
        if m.startswith("actstore.layout"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "record keys spelled outside actstore/layout/:\n" + "\n".join(bad)


def test_ruff_finds_nothing():
    """ruff (configured in pyproject.toml) over the package, tests, benchmarks and examples."""
    import subprocess
    import sys

    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.exists(), f"ruff is a dev dependency: install it in {Path(sys.executable).parent.parent}"
    res = subprocess.run(
        [str(ruff), "check", "src", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_architecture_doc_names_every_module_where_it_is():
    """docs/architecture.md names each module of the package (the CLI's commands aside), and
    each module it names exists: a reader finds each job where the doc says."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = {n for n in re.findall(r"`([\w/]+\.py)`", doc) if not n.startswith("tests/")}
    files = {p.relative_to(PKG).as_posix() for p in MODULES.values() if p.name != "__init__.py"}
    assert not sorted(named - files), f"docs/architecture.md names modules that do not exist: {sorted(named - files)}"
    unnamed = sorted(f for f in files - named if not f.startswith("cli/"))
    assert not unnamed, f"modules docs/architecture.md does not place: {unnamed}"


def test_ruff_format_is_applied():
    """`ruff format` (line length in pyproject.toml) leaves every file as it is."""
    import subprocess
    import sys

    ruff = Path(sys.executable).with_name("ruff")
    res = subprocess.run(
        [str(ruff), "format", "--check", "src", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, "run `ruff format src tests benchmarks examples`:\n" + res.stdout[-3000:] + res.stderr


def test_star_imports_reach_only_what_a_module_exports():
    """Every module a star import reaches declares `__all__` (so `from actstore import *` takes
    no `os` or `annotations` with it), and errors.py's lists each exception it defines."""
    bad = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                tree = ast.parse(MODULES[node.module].read_text(encoding="utf-8"))
                if not any(
                    isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "__all__" for n in tree.body
                ):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} has no __all__")
    assert not bad, "\n".join(bad)
    import actstore.errors as errors

    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and v.__module__ == errors.__name__}
    assert sorted(errors.__all__) == sorted(defined)
