"""The audit view: fit to merge is the merge's own verdict, per dataset, with each gate's counts and the first failing
row; the check summaries name the dataset and the counts (demo tokenizer, real files)."""

from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.audit import GATE_NAMES, AuditSettings
from eagle_pipeline.audit.overview import (
    audit_overview,
    dataset_rows,
    first_failure,
    fit_line,
    gate_rows,
    gate_summary,
    grid_markdown,
    refusal_summary,
)
from eagle_pipeline.audit.records import audits_for_merge, current_audit, record_gate_verdict
from eagle_pipeline.shared.storage import DataRoot, write_parquet_atomic

from .corpus import build_clean_table, mutate

CUT = [0, 1]  # cut by max_tokens in both datasets: not_truncated (filter) excludes them
ROWS = 30


@pytest.fixture
def root(tmp_path, demo_tok, demo_ids):
    """B1 clean (two rows filtered), B6 over-billed by 15% on every row with usage: billing_agreement blocks."""
    table = build_clean_table(demo_tok, demo_ids, ROWS, seed=5)
    table = mutate(table, CUT, lambda ids, r: ids, finish_reason=lambda v, r: "length")
    root = DataRoot(tmp_path / "data")
    write_parquet_atomic(table, root.tokens("B1"))
    usage = table.column("usage_completion_tokens")
    billed = pc.cast(pc.round(pc.multiply(pc.cast(usage, "float64"), 1.15)), usage.type)
    over = table.set_column(table.schema.get_field_index("usage_completion_tokens"), "usage_completion_tokens", billed)
    write_parquet_atomic(over, root.tokens("B6"))
    return root


def _check_all(root, ds, tok, ids, settings):
    audit = current_audit(root, ds, tok, ids, settings)
    for name in GATE_NAMES:
        record_gate_verdict(root, audit, name)


def test_the_view_marks_the_over_billed_dataset_unfit_with_its_gate_and_counts(root, demo_tok, demo_ids):
    settings = AuditSettings()
    for ds in ("B1", "B6"):
        _check_all(root, ds, demo_tok, demo_ids, settings)
    with_usage = pq.read_table(root.tokens("B6")).column("usage_completion_tokens").drop_null()
    view = {a.dataset: a for a in audit_overview(root, ["B1", "B6", "B3"], demo_tok, demo_ids, settings)}

    assert view["B1"].fit and view["B1"].blocking_gates == []
    assert view["B1"].reason == f"every gate ran on the latest token samples and none blocks; {len(CUT)} rows excluded"
    bad = view["B6"]
    assert not bad.fit and bad.blocking_gates == ["billing_agreement"]
    billing = bad.gates["billing_agreement"]
    assert billing["checked"] == len(with_usage) and billing["failing"] > 0
    assert bad.reason.startswith(
        f"billing_agreement: {billing['failing']} of {len(with_usage)} rows over the per-row tolerance; aggregate "
    )
    assert "% > 0.50%" in bad.reason
    assert bad.first_failure.startswith(f"billing_agreement: {billing['examples'][0]['sample_id']}: len(output_ids)=")
    # A dataset never materialized is unfit, and says so.
    assert not view["B3"].fit and view["B3"].reason == "token samples not materialized"

    # The view's verdict is the merge's: the merge refuses for exactly the unfit datasets' problems.
    problems, _ = audits_for_merge(root, ["B1", "B6", "B3"], demo_tok, demo_ids, settings)
    assert {p.dataset for p in problems} == {d for d, a in view.items() if not a.fit}

    audits = [view["B1"], view["B6"]]
    assert fit_line(audits) == "1 of 2 datasets fit to merge: B1 yes; B6 NO (billing_agreement)"
    rows = {r["dataset"]: r for r in dataset_rows(audits)}
    assert rows["B1"]["fit"] == "yes" and rows["B1"]["excluded"] == len(CUT)
    assert rows["B6"]["fit"] == "NO" and rows["B6"]["rows"] == ROWS
    found = {(r["dataset"], r["gate"]): r for r in gate_rows(audits)}
    assert found[("B6", "billing_agreement")]["verdict"] == "FAIL (blocks)"
    assert found[("B6", "billing_agreement")]["failing"] == f"{billing['failing']} of {len(with_usage)}"
    assert found[("B1", "not_truncated")] == {
        "dataset": "B1",
        "gate": "not_truncated",
        "action": "filter",
        "failing": f"{len(CUT)} of {ROWS}",
        "verdict": f"{len(CUT)} rows filtered",
        "excluded": len(CUT),
    }
    assert ("B1", "billing_agreement") not in found  # a gate that found nothing is not listed
    grid = grid_markdown(audits)
    assert "| billing_agreement | pass (0/" in grid and f"| FAIL (blocks) ({billing['failing']}/" in grid
    assert grid.splitlines()[-1] == "| **fit to merge** | **yes** | **NO** |"

    # The refusal sends each unfit dataset where its cause is: a failing gate to docs/audit.md, a dataset that never
    # reached its audit (its prompts file, its backend) to its own run's failed step.
    what_to_do = refusal_summary([view["B1"], view["B6"], view["B3"]]).split("What to do: ")[1]
    assert "failing gate of B6 (docs/audit.md gives" in what_to_do
    assert "for B3, with no audited token samples, the failed step of its last EAGLE_dataset run" in what_to_do
    only_unaudited = refusal_summary([view["B1"], view["B3"]])
    assert "docs/audit.md" not in only_unaudited and "B3: token samples not materialized." in only_unaudited


def test_a_stale_audit_makes_the_dataset_unfit_until_its_checks_ran_again(root, demo_tok, demo_ids):
    settings = AuditSettings()
    _check_all(root, "B1", demo_tok, demo_ids, settings)
    table = pq.read_table(root.tokens("B1"))
    write_parquet_atomic(table.slice(0, ROWS - 1), root.tokens("B1"))  # re-generated, checks not run yet
    (entry,) = audit_overview(root, ["B1"], demo_tok, demo_ids, settings)
    assert not entry.fit and entry.gates == {}  # no stored audit of the new file: no figures that are not its own
    # One line per reason, not one per gate.
    assert entry.reason == "audit check did not run on the latest token samples (every gate)"
    assert fit_line([entry]) == f"0 of 1 datasets fit to merge: B1 NO ({entry.reason})"
    current_audit(root, "B1", demo_tok, demo_ids, settings)
    record_gate_verdict(root, current_audit(root, "B1", demo_tok, demo_ids, settings), "single_eot")
    (entry,) = audit_overview(root, ["B1"], demo_tok, demo_ids, settings)
    others = ", ".join(g for g in GATE_NAMES if g != "single_eot")
    assert entry.reason == f"audit check did not run on the latest token samples ({others})"
    _check_all(root, "B1", demo_tok, demo_ids, settings)
    (entry,) = audit_overview(root, ["B1"], demo_tok, demo_ids, settings)
    assert entry.fit and entry.rows == ROWS - 1


def test_gate_summaries_name_the_dataset_and_the_counts():
    billing = {
        "blocking": True,
        "failing": 4,
        "checked": 4,
        "excluded": 4,
        "details": {"aggregate_relative_error": 0.12966, "aggregate_bound": 0.005},
        "examples": [
            {"sample_id": "B3-7", "problem": "len(output_ids)=10 usage_completion_tokens=12", "excerpt": "hi"}
        ],
    }
    assert gate_summary("B3", billing) == (
        "B3: FAIL (blocks): 4 of 4 rows over the per-row tolerance; aggregate 12.97% > 0.50%; 4 excluded downstream"
    )
    assert first_failure(billing) == "B3-7: len(output_ids)=10 usage_completion_tokens=12; excerpt 'hi'"
    clean = {"blocking": False, "failing": 0, "checked": 8, "excluded": 0, "details": {}, "examples": []}
    assert gate_summary("B1", clean) == "B1: pass: 0 of 8 rows failing"
    assert first_failure(clean) is None
    filtered = {**clean, "failing": 2, "excluded": 2}
    assert gate_summary("B1", filtered) == "B1: 2 rows filtered: 2 of 8 rows failing; 2 excluded downstream"
    assert gate_summary("B1", {**clean, "checked": 0}) == "B1: pass: no row to check"
