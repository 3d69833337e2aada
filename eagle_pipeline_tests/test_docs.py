"""The docs name the asset checks as the Dagster UI does: every check named in a docs table of checks (or in an audit
gate's heading) is a check the code location registers, and every registered check is documented so."""

from __future__ import annotations

import re
from pathlib import Path

from eagle_pipeline.definitions import defs

DOCS = Path(__file__).resolve().parents[1] / "docs"
# The audit's gates are documented one heading each under this section of docs/audit.md.
GATES_PAGE, GATES_SECTION = "audit.md", "## The gates"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def check_table_names(text: str) -> set[str]:
    """The names in the first column of every table whose header's first cell is `check`: one backticked name per
    cell (a cell without one, such as "(Python API only)", names no check)."""
    names: set[str] = set()
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if not in_table:
            in_table, header = True, cells
            continue
        if header[:1] != ["check"] or set(cells[0]) <= set("-: "):
            continue
        names.update(re.findall(r"^`([a-z0-9_]+)`$", cells[0]))
    return names


def gate_heading_names(text: str) -> set[str]:
    """The gate names of the `### `name` (...)` headings in the gates section of docs/audit.md."""
    section = text.split(GATES_SECTION, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^### `([a-z0-9_]+)`", section, flags=re.M))


def documented_checks() -> dict[str, set[str]]:
    """Check name -> the docs pages that document it (in a check table, or as a gate heading)."""
    out: dict[str, set[str]] = {}
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        names = check_table_names(text) | (gate_heading_names(text) if page.name == GATES_PAGE else set())
        for name in names:
            out.setdefault(name, set()).add(page.name)
    return out


def registered_checks() -> set[str]:
    """Every asset check's name in the code location: what the UI shows."""
    # From the asset graph: checks of their own and checks an asset computes itself (token_samples' gates).
    return {key.name for key in defs.resolve_asset_graph().asset_check_keys}


def test_the_table_reader_finds_names_and_ignores_other_tables():
    text = (
        "| check | fails when |\n|---|---|\n| `a_check` | x \\| y |\n| (Python API only) | z |\n\n"
        "| key | default |\n|---|---|\n| `not_a_check` | 1 |\n"
    )
    assert check_table_names(text) == {"a_check"}
    assert gate_heading_names("## The gates\n### `g1` (block)\n## Report\n### `g2` (warn)\n") == {"g1"}


def test_every_check_named_in_a_docs_check_table_is_registered():
    registered = registered_checks()
    unknown = {name: pages for name, pages in documented_checks().items() if name not in registered}
    assert not unknown, f"docs name checks the code location does not register (use the UI's names): {unknown}"


def test_every_registered_check_is_documented():
    undocumented = registered_checks() - set(documented_checks())
    assert not undocumented, f"checks with no row in a docs table of checks (or gate heading): {sorted(undocumented)}"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # a `#` line in a code block is no heading
    return {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_links_between_pages_reach_a_file_and_a_heading():
    """Relative links of the docs pages and benchmarks/README.md name a file that exists and, after `#`, one of its
    headings: moving a narrative from a user page to docs/testing.md or benchmarks/README.md keeps its links."""
    assert heading_anchor("Worker processes for streams (`stream_processes`)") == (
        "worker-processes-for-streams-stream_processes"
    )
    pages = [*sorted(DOCS.glob("*.md")), DOCS.parent / "benchmarks" / "README.md", DOCS.parent / "README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(DOCS.parent)}: {target} (no file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(DOCS.parent)}: {target} (no heading)")
    assert not broken, broken
