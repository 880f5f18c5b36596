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
