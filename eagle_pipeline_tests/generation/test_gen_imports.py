"""The generation package's import graph: no cycles, and no imports hidden inside functions (which is how the
runner <-> importer cycle used to go unnoticed). Static: reads the source, imports nothing it checks."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle_pipeline.generation as generation

PACKAGE = "eagle_pipeline.generation"
ROOT = Path(generation.__file__).resolve().parents[2]


def _modules(package: str) -> dict[str, ast.Module]:
    """Every module of the package (subpackages included), by dotted name, parsed."""
    base = ROOT.joinpath(*package.split("."))
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _targets(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules of `known` an import statement loads (`from pkg import sub` loads pkg.sub when it is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level or node.module is None:
        raise AssertionError(f"relative import at line {node.lineno}: use absolute imports")
    found = {f"{node.module}.{a.name}" for a in node.names} & known
    return found or ({node.module} & known)


def _function_level_imports(tree: ast.Module) -> list[int]:
    lines = []
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines += [n.lineno for n in ast.walk(scope) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted(set(lines))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_generation_has_no_import_cycle():
    modules = _modules(PACKAGE)
    known = set(modules)
    assert {"eagle_pipeline.generation.runner", "eagle_pipeline.generation.importer"} <= known
    graph = {
        name: set().union(
            *(_targets(n, known) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        )
        - {name}
        for name, tree in modules.items()
    }
    assert "eagle_pipeline.generation.importer" in graph["eagle_pipeline.generation.runner"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_generation_imports_only_at_module_level():
    hidden = {name: lines for name, tree in _modules(PACKAGE).items() if (lines := _function_level_imports(tree))}
    assert hidden == {}


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
