"""The core without torch: writer (float32 -> float16 and float16 appends, statistics),
finalize, read, verify and the CLI work, with the bytes numpy computes; the torch-only
features (loaders, capture) say how to install torch.

Where torch is not installed (scripts/test_core.sh) each check runs here; where it is
(the main suite) each runs in a child Python with torch blocked (`sys.modules["torch"] =
None`, so `import torch` raises ModuleNotFoundError). Either way it runs: nothing skips.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TORCH_INSTALLED = importlib.util.find_spec("torch") is not None
LAYERS, T, D = [3, 7], 6, 40


def _torch_is_gone() -> None:
    """The check must run in a Python where torch cannot be imported and was not."""
    with pytest.raises(ImportError):
        import torch  # noqa: F401
    assert sys.modules.get("torch") is None


def _acts(seed: int) -> np.ndarray:
    """(5, L, T, D) float32 with float16 rounding ties and their neighbours among normal values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, len(LAYERS), T, D)) * 3).astype(np.float32)
    tie = np.float32(1 + 2**-11)  # halfway between two float16s: rounds to even (1.0)
    edges = np.array(
        [tie, np.nextafter(tie, np.float32(2)), np.nextafter(tie, np.float32(0)), -tie, 65504, -65504, 6e-8, 0.0, -0.0],
        np.float32,
    )
    x.reshape(-1)[: edges.size] = edges
    return x


def check_appends_with_stats_equal_numpy(root: Path) -> None:
    """float32 and float16 appends (stats=True): stored bytes and statistics equal numpy's."""
    import actstore
    from actstore.dtypes import _torch
    from actstore.verify import verify_store

    _torch_is_gone()
    x32 = _acts(0)
    want = x32.astype(np.float16)  # numpy rounds to nearest even, as the torch path does
    for name, x in (("from-f32", x32), ("from-f16", want)):
        with actstore.ShardWriter(root / name, shard=0, layers=LAYERS, d_model=D, tokens=T, stats=True) as w:
            w.append(x[:2])
            w.commit()
            w.append(x[2:])
        actstore.finalize(root / name)
        store = actstore.ActStore(root / name)
        assert len(store) == 5 and store.dtype == "float16"
        for ex in range(5):
            for lp, layer in enumerate(LAYERS):
                assert store[ex, layer].tobytes() == want[ex, lp].tobytes(), (name, ex, layer)
        st = store.stats()
        for lp, layer in enumerate(LAYERS):
            v = want[:, lp].reshape(-1, D).astype(np.float64)
            key = f"layer{layer}/tokens"
            k = st.keys.index(key)
            assert int(st.count[k]) == len(v) and int(st.nonfinite[k]) == 0
            assert (st.min[k], st.max[k]) == (v.min(), v.max())
            np.testing.assert_allclose(st.mean[k], v.mean(0), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(st.variance(key), v.var(0), rtol=1e-10, atol=1e-12)
            assert st.norm_sum[k] == pytest.approx(np.linalg.norm(v, axis=1).sum(), rel=1e-12)
        report = verify_store(root / name, deep=True)
        assert report.ok and report.problems == [], report.problems
    assert _torch() is None and sys.modules.get("torch") is None


def check_cli_finalize_info_verify(root: Path) -> None:
    """`actstore finalize`, `info`, `info --json`, `verify --deep` (click's runner, in this process)."""
    from click.testing import CliRunner

    import actstore
    from actstore.cli import main

    _torch_is_gone()
    path = root / "s"
    with actstore.ShardWriter(path, shard=0, layers=LAYERS, d_model=D, tokens=T, stats=True) as w:
        w.append(_acts(1))
    run = CliRunner().invoke
    for args in (["finalize"], ["info"], ["verify", "--deep", "--quiet"]):
        res = run(main, [*args, str(path)])
        assert res.exit_code == 0, (args, res.output)
    res = run(main, ["info", "--json", str(path)])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)  # (the sink warning of _acts's token 0 goes to stderr)
    assert (
        info["n_examples"] == 5 and info["layers"] == LAYERS and info["statistics"]["layer7/tokens"]["count"] == 5 * T
    )
    assert sys.modules.get("torch") is None


def check_torch_features_name_their_install(root: Path) -> None:
    """The loaders and capture fail with the command that installs what they need."""
    from click.testing import CliRunner

    from actstore.cli import main

    _torch_is_gone()
    for module in ("actstore.torch", "actstore.loaders"):
        sys.modules.pop(module, None)
        with pytest.raises(
            ModuleNotFoundError, match=r"needs torch, which is not installed: pip install 'actstore\[torch\]'"
        ):
            importlib.import_module(module)
    res = CliRunner().invoke(main, ["write", str(root / "s"), "--model", "m", "--data", "d", "--layers", "0"])
    assert (
        res.exit_code == 1
        and "`actstore write` needs torch" in res.output
        and "pip install 'actstore[capture]'" in res.output
    )
    assert len(res.output.strip().splitlines()) == 1 and not (root / "s").exists()


CHECKS = [check_appends_with_stats_equal_numpy, check_cli_finalize_info_verify, check_torch_features_name_their_install]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_without_torch(check, tmp_path):
    if not TORCH_INSTALLED:
        check(tmp_path)
        return
    code = (
        "import sys, pathlib\n"
        "sys.modules['torch'] = None  # import torch -> ModuleNotFoundError, as without torch\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import test_notorch\n"
        f"test_notorch.{check.__name__}(pathlib.Path(sys.argv[1]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], check=False, capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_importing_actstore_and_its_cli_does_not_import_torch():
    code = "import actstore, actstore.cli, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr


def test_the_core_job_selects_by_marker_and_leaves_out_every_module_that_imports_torch():
    """scripts/test_core.sh runs `-m core` (no file list): tests/conftest.py marks torch every
    test of a module that imports torch, transformers or the loaders at its top (so that the
    core job, without torch, does not import it), and core every test marked neither torch nor dev."""
    script = (ROOT / "scripts" / "test_core.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert "-m core" in code and not re.findall(r"tests/test_\w+\.py", code)
    from needs import module_needs

    top_torch = re.compile(
        r"^(import torch|from torch|from actstore\.(torch|loaders)|import transformers)", re.MULTILINE
    )
    imports_torch = {p.name for p in TESTS.glob("test_*.py") if top_torch.search(p.read_text(encoding="utf-8"))}
    assert len(imports_torch) > 20  # the check looks at the real files
    unmarked = sorted(n for n in imports_torch if "torch" not in module_needs(TESTS / n))
    assert not unmarked, f"import torch at their top but are not marked torch: {unmarked}"
    assert module_needs(TESTS / "test_notorch.py") == set() and "torch" in module_needs(TESTS / "test_matrix.py")
