"""The generation package imports at module level only: an import hidden inside a function is how the runner <->
importer cycle went unnoticed (cycles themselves are import-linter's contract in pyproject.toml). Static: reads the
source, imports nothing it checks."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle_pipeline.generation as generation

PACKAGE_DIR = Path(generation.__file__).resolve().parent


def _function_level_imports(tree: ast.Module) -> list[int]:
    lines = []
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines += [n.lineno for n in ast.walk(scope) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted(set(lines))


def test_generation_imports_only_at_module_level():
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert {"runner.py", "importer.py", "openrouter.py"} <= {p.name for p in files}
    hidden = {
        str(p.relative_to(PACKAGE_DIR)): lines
        for p in files
        if (lines := _function_level_imports(ast.parse(p.read_text(), filename=str(p))))
    }
    assert hidden == {}


def test_the_check_sees_an_import_inside_a_function():
    tree = ast.parse("import os\n\ndef f():\n    from json import dumps\n    return dumps\n")
    assert _function_level_imports(tree) == [4]
