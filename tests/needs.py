"""What a test module needs beyond the core install, from the imports at its top (tests/conftest.py
marks its tests `torch` or `dev` from this; without torch it does not import such a module)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Top-level imports that make a test module need torch (or the dev install), by module name prefix.
TORCH_IMPORTS = ("torch", "transformers", "tokenizers", "capture_support", "actstore.torch", "actstore.loaders")
DEV_IMPORTS = (
    "moto", "pandas", "pyarrow", "PIL", "numba", "datasets", "sae_lens", "sparsify", "ray", "matplotlib",
    "sklearn", "skimage", "safetensors", "onnx", "gguf", "accelerate", "socketio",
)  # fmt: skip


@functools.cache
def _top_imports(name: str) -> frozenset[str]:
    """The modules tests/NAME.py imports at its top, through the helper modules of tests/ too."""
    found: set[str] = set()
    for node in ast.parse((TESTS / f"{name}.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        else:
            continue
        for mod in mods:
            found.add(mod)
            local = mod.split(".")[0]
            if local != name and (TESTS / f"{local}.py").is_file():
                found |= _top_imports(local)
    return frozenset(found)


def module_needs(path: Path) -> set[str]:
    """{'torch', 'dev'} or a part: what a test module's top-level imports need."""
    imports = _top_imports(path.stem)

    def hit(prefixes):
        return any(m == p or m.startswith(p + ".") for m in imports for p in prefixes)

    return {mark for mark, prefixes in (("torch", TORCH_IMPORTS), ("dev", DEV_IMPORTS)) if hit(prefixes)}


def _module_fixtures(tree: ast.Module) -> set[str]:
    """The module-scoped fixtures a module defines, and its fixtures that use one."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "fixture":
                    if any(k.arg == "scope" and getattr(k.value, "value", None) == "module" for k in dec.keywords):
                        found.add(node.name)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and {a.arg for a in node.args.args} & found:
            found.add(node.name)
    return found


@functools.cache
def shares_module_fixture(path: Path) -> bool:
    """Whether a test module defines or uses a module-scoped fixture (conftest's too): then
    its tests run in one process of pytest-xdist, so that the fixture is made once."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if _module_fixtures(tree):
        return True
    shared = _module_fixtures(ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8")))
    used = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    return bool(used & shared)
