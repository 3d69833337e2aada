"""The generation and simulation packages import at module level only: an import hidden inside a function is how the
runner <-> importer cycle went unnoticed (cycles themselves are import-linter's contract in pyproject.toml). The one
exception is the simulation seam (docs/architecture.md): the runner imports `eagle_pipeline.simulation` when a run
names a simulated backend, so a real run never loads it. Static: reads the source, imports nothing it checks."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle_pipeline.generation as generation
import eagle_pipeline.simulation as simulation

PACKAGE_DIR = Path(generation.__file__).resolve().parent
SIMULATION_DIR = Path(simulation.__file__).resolve().parent
# The simulation seam: (file, module imported inside a function) pairs allowed, each of which must exist.
SEAMS = {("run/runner.py", "eagle_pipeline.simulation")}


def _function_level_imports(tree: ast.Module, allowed: frozenset[str] = frozenset()) -> list[int]:
    """Lines of imports inside a function or class, other than those of a module in `allowed`."""
    lines = []
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for n in ast.walk(scope):
                if (isinstance(n, ast.Import) and not {a.name for a in n.names} <= allowed) or (
                    isinstance(n, ast.ImportFrom) and n.module not in allowed
                ):
                    lines.append(n.lineno)
    return sorted(set(lines))


def test_generation_imports_only_at_module_level():
    files = sorted(PACKAGE_DIR.rglob("*.py")) + sorted(SIMULATION_DIR.rglob("*.py"))
    assert {"runner.py", "importer.py", "openrouter.py"} <= {p.name for p in files}
    hidden = {}
    for p in files:
        tree = ast.parse(p.read_text(), filename=str(p))
        allowed = frozenset(
            m for f, m in SEAMS if p.is_relative_to(PACKAGE_DIR) and p.relative_to(PACKAGE_DIR).as_posix() == f
        )
        if lines := _function_level_imports(tree, allowed):
            hidden[p.name] = lines
        for module in allowed:  # a seam that no longer exists must leave this list
            assert _function_level_imports(tree) != _function_level_imports(tree, frozenset({module})), (p, module)
    assert hidden == {}


def test_the_check_sees_an_import_inside_a_function():
    tree = ast.parse("import os\n\ndef f():\n    from json import dumps\n    return dumps\n")
    assert _function_level_imports(tree) == [4]
    assert _function_level_imports(tree, frozenset({"json"})) == []  # a named seam
    assert _function_level_imports(tree, frozenset({"os"})) == [4]
