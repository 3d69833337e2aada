"""The codebase's shape, as rules a test can break: import rules (no Dagster in the core, no cycles) and module sizes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
    assert {"generation", "tokens", "audit", "merge", "hidden_states", "config.py", "storage.py"} <= names
