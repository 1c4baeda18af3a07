"""The command and engine layers stay in rooms one can read: no function over ``LIMIT`` lines.

A function that grows past it is split along what its parts do (a section's checks, a figure, a
command), as every function of these layers was split to fit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fedmeta

LIMIT = 80  # lines, from its ``def`` to its last line, docstring included
LAYERS = (
    "cli",
    "loop",
    "run",
    "stopping",
    "campaign",
    "grid",
    "bench",
    "census",
    "profiling",
    "report",
    "tune",
    "config",
    "engine",
    "flower",
    "lease",
)


def function_sizes() -> dict[str, int]:
    sizes = {}
    root = Path(fedmeta.__file__).parent
    for module in LAYERS:
        tree = ast.parse((root / f"{module}.py").read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                    sizes[f"{module}.{owner}{child.name}"] = child.end_lineno - child.lineno + 1
    return sizes


def test_no_function_in_the_command_and_engine_layers_passes_the_limit():
    too_long = {name: n for name, n in function_sizes().items() if n > LIMIT}
    assert not too_long, f"split these functions (at most {LIMIT} lines): {too_long}"


def test_the_loop_module_does_not_grow():
    lines = len((Path(fedmeta.__file__).parent / "loop.py").read_text().splitlines())
    assert lines <= 320, (
        f"fedmeta/loop.py has {lines} lines: keep one screen per step: a new part goes in a module of its own"
    )
