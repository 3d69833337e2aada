"""The codebase's shape, as rules a test can break: import rules (no Dagster in the core, no cycles) and module sizes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "eagle_pipeline"
# The Dagster shell and the entry points that drive it; everything else is the functional core.
SHELL = {"defs", "definitions.py", "demo.py"}
MAX_CORE_LINES = 450
LONG_MODULE_MARK = "Why this module is long:"


def test_import_rules_hold():
    """`lint-imports` with the contracts in pyproject.toml: the core imports neither Dagster nor the shell, and no two
    sibling modules or packages import each other, counting imports inside functions (which hide cycles)."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout


def _core_modules() -> list[Path]:
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] not in SHELL and p.name != "__init__.py"
    ]


def test_no_core_module_is_long_without_a_reason():
    """A core module over ~450 lines says why in its docstring (a paragraph starting with the mark), or is split."""
    long = []
    for path in _core_modules():
        source = path.read_text()
        n = source.count("\n")
        if n <= MAX_CORE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if LONG_MODULE_MARK not in doc:
            long.append(f"{path.relative_to(REPO)}: {n} lines")
    assert not long, f"split these or say '{LONG_MODULE_MARK} ...' in their docstring: {long}"


def test_the_core_list_is_not_empty():
    # Guards the two tests above against a layout change that would make them vacuous.
    names = {p.relative_to(PACKAGE).parts[0] for p in _core_modules()}
    assert {"generation", "tokens", "audit", "merge", "hidden_states", "config", "prompts", "shared"} <= names


def _architecture_map() -> set[str]:
    """The paths the module map in docs/architecture.md lists (its first code block, an indented tree)."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    block = doc[doc.index("```\neagle_pipeline/") + 4 :]
    block = block[: block.index("\n```")]
    listed: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the folders above the current line
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        name = line.strip().split(" ", 1)[0] if line.strip() else ""
        if indent > 8 or not name.endswith((".py", ".toml", ".txt", "/")):
            continue  # a description's continuation line
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([p for _, p in stack] + [name.rstrip("/")])
        listed.add(path)
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
    return listed


def test_architecture_map_lists_every_module():
    """docs/architecture.md's map names every module of the package and of its first-level packages (deeper packages
    by their folder), and nothing that is not there: a newcomer finds the room for any change from it."""
    listed = _architecture_map()
    present: set[str] = set()
    for p in PACKAGE.rglob("*"):
        rel = p.relative_to(PACKAGE)
        if "__pycache__" in rel.parts or p.name == "__init__.py" or p.suffix not in (".py", ".toml", ".txt", ""):
            continue
        if p.is_dir() and not (p / "__init__.py").exists():
            continue
        if len(rel.parts) > 3 or (len(rel.parts) == 3 and p.is_dir()):
            continue  # inside a second-level package: its folder stands for it
        if len(rel.parts) == 3 and (PACKAGE / rel.parts[0] / rel.parts[1]).is_dir():
            continue
        present.add(rel.as_posix())
    missing = sorted(present - listed)
    stale = sorted(x for x in listed - present if not (PACKAGE / x).exists())
    assert not missing, f"modules missing from docs/architecture.md's map: {missing}"
    assert not stale, f"docs/architecture.md's map lists what is not in the tree: {stale}"


def _contracts() -> dict[str, dict]:
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    # By type; of the two forbidden contracts, "forbidden" is the one that forbids Dagster (the other, the tests); of
    # the layers contracts, "layers" is the package's own and "layers:<package>" a package's layers inside.
    by_key = {}
    for c in contracts:
        inside = c.get("containers", ["eagle_pipeline"])[0]
        key = c["type"] if inside == "eagle_pipeline" else f"{c['type']}:{inside}"
        if c["type"] != "forbidden" or "dagster" in c["forbidden_modules"]:
            by_key[key] = c
    return by_key


def _layers() -> list[set[str]]:
    """The layers contract's layers, top first, each as the set of its top-level names."""
    return [{m.strip() for m in layer.replace(":", "|").split("|")} for layer in _contracts()["layers"]["layers"]]


def _top_level_names() -> set[str]:
    return {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }


def test_the_layers_contract_places_every_top_level_module():
    """The layers contract is exhaustive over eagle_pipeline (lint-imports then fails on a module given no layer), and
    its layers are exactly the top-level modules and packages on disk; the shell is its top."""
    layers = _contracts()["layers"]
    assert layers["containers"] == ["eagle_pipeline"] and layers["exhaustive"] is True
    assert "exhaustive_ignores" not in layers  # no module escapes the layers
    placed = set().union(*_layers())
    tops = _top_level_names()
    assert placed == tops, f"on disk, not in the layers: {sorted(tops - placed)}; " + (
        f"in the layers, not on disk: {sorted(placed - tops)}"
    )
    shell_layers = _layers()[: len(SHELL)]
    assert set().union(*shell_layers) == {s.removesuffix(".py") for s in SHELL}


@pytest.mark.parametrize("package", ["generation", "hidden_states"])
def test_a_stage_s_layers_place_every_module_of_the_stage(package):
    """A stage's layers contract (its sub-packages in the order of the data) is exhaustive, and its layers are exactly
    the stage's sub-packages and modules on disk: a new one fails until it is given a layer."""
    layers = _contracts()[f"layers:eagle_pipeline.{package}"]
    assert layers["exhaustive"] is True and "exhaustive_ignores" not in layers
    placed = {m.strip() for layer in layers["layers"] for m in layer.split("|")}
    stage = PACKAGE / package
    on_disk = {
        p.name.removesuffix(".py")
        for p in stage.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }
    assert placed == on_disk, f"on disk, not in the layers: {sorted(on_disk - placed)}; " + (
        f"in the layers, not on disk: {sorted(placed - on_disk)}"
    )


def test_the_core_contract_covers_every_core_module():
    """The 'no Dagster in the core' contract names its source modules: exactly the layers below the shell, so no
    module escapes the rule unnoticed."""
    contracts = _contracts()
    covered = {m.removeprefix("eagle_pipeline.") for m in contracts["forbidden"]["source_modules"]}
    below_shell = set().union(*_layers()[len(SHELL) :])
    assert covered == below_shell, f"add: {sorted(below_shell - covered)}; remove: {sorted(covered - below_shell)}"
    tops = {p.relative_to(PACKAGE).parts[0] for p in _core_modules()}
    core_tops = {t.removesuffix(".py") for t in tops if t.endswith(".py") or (PACKAGE / t).is_dir()}
    assert not core_tops - covered, f"add to the core contract in pyproject.toml: {sorted(core_tops - covered)}"


TESTS_PACKAGE = "eagle_pipeline_tests"


def _imports_of_the_tests(source: str) -> list[str]:
    """What a module's source imports from the tests package: import statements at any depth (inside functions and
    `TYPE_CHECKING` blocks too) and module paths named as strings (what `importlib.import_module` would load)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            names = [node.value]
        else:
            continue
        found += [n for n in names if n == TESTS_PACKAGE or n.startswith(TESTS_PACKAGE + ".")]
    return found


def test_no_product_module_imports_a_test_double():
    """The doubles used only by tests and benchmarks live in eagle_pipeline_tests/doubles/, which the wheel leaves out:
    a module of eagle_pipeline that imported one would fail in an installed wheel. (lint-imports holds the same rule
    as a forbidden contract; this scan also sees module paths given as strings.)"""
    assert _imports_of_the_tests("def f():\n    from eagle_pipeline_tests.doubles import SimulatedVLLMServer\n")
    assert _imports_of_the_tests("import importlib\nimportlib.import_module('eagle_pipeline_tests.doubles.synthetic')")
    assert not _imports_of_the_tests('"""Doubles live in eagle_pipeline_tests/doubles/ (see eagle_pipeline_tests)."""')
    offenders = {
        str(p.relative_to(REPO)): hits
        for p in sorted(PACKAGE.rglob("*.py"))
        if (hits := _imports_of_the_tests(p.read_text()))
    }
    assert not offenders, f"product modules import the tests package: {offenders}"
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert [c for c in contracts if c["type"] == "forbidden" and TESTS_PACKAGE in c["forbidden_modules"]]


def test_the_product_loads_the_simulation_only_when_the_configuration_names_it():
    """The simulation seam (docs/architecture.md): importing the runner, the hidden-state engines and the code location
    loads no simulated server; starting a `simulated` backend does."""
    probe = (
        "import sys, eagle_pipeline.generation.run.runner as r, eagle_pipeline.hidden_states.run, eagle_pipeline.definitions\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('eagle_pipeline.simulation'))\n"
        "from eagle_pipeline.generation.spec import BackendSpec\n"
        "with r.backend_endpoint(BackendSpec(name='sim', kind='simulated', model='m')) as spec:\n"
        "    started = spec.endpoint.startswith('http://127.0.0.1:') and 'eagle_pipeline.simulation' in sys.modules\n"
        "print(loaded, started)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[] True", proc.stdout[-2000:]


MAX_FUNCTION_LINES = 80
# Functions that may stay longer for now, each with its reason (keep this short; remove an entry once it is split).
LONG_FUNCTIONS: dict[str, str] = {}


def _long_functions(root: Path = PACKAGE) -> dict[str, int]:
    """'module path:qualified name' -> lines (from `def` to its last line) of every function over the limit."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found[f"{rel}:{name}"] = lines
                visit(child, f"{name}.", rel)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), "", path.relative_to(root).as_posix())
    return found


def test_no_function_is_longer_than_80_lines():
    """A function (method, nested function) of the package over 80 lines, `def` to last line, is split into named
    pieces, or listed in LONG_FUNCTIONS with its reason."""
    long = _long_functions()
    unexplained = {k: n for k, n in long.items() if k not in LONG_FUNCTIONS}
    assert not unexplained, f"split these functions (lines): {unexplained}"
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"LONG_FUNCTIONS lists functions that are not over {MAX_FUNCTION_LINES} lines: {stale}"


def test_the_function_length_rule_finds_methods_and_nested_functions(tmp_path):
    # Guards the test above against a scan that misses what it should see (a vacuous pass).
    body = "        x = 1\n" * 79
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"class C:\n    async def long(self):\n{body}        return x\n\n    def short(self):\n        return 1\n\n"
        f"def outer():\n    def inner():\n{body}        return x\n    return inner\n"
    )
    assert _long_functions(tmp_path) == {"pkg/m.py:C.long": 81, "pkg/m.py:outer": 83, "pkg/m.py:outer.inner": 81}
