"""What a GPU lease carries (scripts/gpu_kit.py): the job must find every package it imports, in the
card's image or in the kit, or the whole lease is lost at its first import."""

import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFF_THE_JOB = {"flower.py", "tune.py"}  # fedmeta flower and fedmeta tune: no job runs them


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "scripts" / "gpu_kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (not inside functions, not for type checkers)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                break
            if isinstance(inner, ast.Import):
                found |= {alias.name.split(".")[0] for alias in inner.names}
            elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                found.add(inner.module.split(".")[0])
    return found


def test_every_package_the_jobs_modules_import_is_in_the_kits_list():
    kit = _kit()
    listed = {kit.normalized(name) for name, _, _ in kit.NEEDED}
    distributions = importlib.metadata.packages_distributions()
    unlisted = {}
    for path in sorted((ROOT / "fedmeta").rglob("*.py")):
        if path.name in OFF_THE_JOB:
            continue
        for name in _module_level_imports(path) - set(sys.stdlib_module_names) - {"fedmeta"}:
            packages = {kit.normalized(d) for d in distributions.get(name, [name])}
            if not packages & listed:
                unlisted.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unlisted, (
        f"imported where every job imports it, and neither in scripts/gpu_kit.py's NEEDED nor carried: "
        f"{unlisted} (import it inside the function that needs it, or list it there)"
    )


def test_the_check_finds_a_module_level_import_and_ignores_one_inside_a_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import numpy as np\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pandas\n"
        "try:\n    import yaml\nexcept ImportError:\n    pass\n"
        "def solve():\n    from scipy.optimize import minimize\n"
    )
    assert _module_level_imports(source) == {"numpy", "typing", "yaml"}
