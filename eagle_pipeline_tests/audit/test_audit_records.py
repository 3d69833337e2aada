"""The audit of one token-samples file runs once and is stored bound to the file's sha256 and the settings; checks
and the merge read it, and a missing or stale result is recomputed, never trusted (demo tokenizer, real files)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.audit import GATE_NAMES, AuditSettings, run_audit
from eagle_pipeline.audit.records import (
    audit_key,
    audit_token_samples,
    audits_for_merge,
    current_audit,
    gate_record_path,
    read_stored_audit,
    record_gate_verdict,
)
from eagle_pipeline.shared.storage import DataRoot, file_sha256, write_parquet_atomic

from .corpus import build_clean_table, mutate

# Rows 0..3 are cut by max_tokens: not_truncated (filter) excludes them, so the keep mask is not all true.
CUT = [0, 1, 2, 3]


@pytest.fixture
def root(tmp_path, demo_tok, demo_ids):
    table = build_clean_table(demo_tok, demo_ids, 40, seed=3)
    table = mutate(table, CUT, lambda ids, r: ids, finish_reason=lambda v, r: "length")
    root = DataRoot(tmp_path / "data")
    write_parquet_atomic(table, root.tokens("B1"))
    return root


def _rewrite_report(root: DataRoot, edit) -> None:
    path = root.audit_report("B1")
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def test_stored_audit_is_the_full_audit_bound_to_the_file(root, demo_tok, demo_ids):
    settings = AuditSettings()
    stored = audit_token_samples(root, "B1", demo_tok, demo_ids, settings)
    full = run_audit(pq.read_table(root.tokens("B1")), demo_tok, demo_ids, settings)
    assert stored.tokens_sha256 == file_sha256(root.tokens("B1"))
    assert stored.audit_key == audit_key(demo_tok, demo_ids, settings)
    assert np.array_equal(stored.keep_mask, full.filter_mask) and not stored.keep_mask[CUT].any()
    assert stored.excluded_counts == full.excluded_counts == {"not_truncated": len(CUT)}
    on_disk = json.loads(root.audit_report("B1").read_text())
    assert on_disk["tokens_sha256"] == stored.tokens_sha256 and set(on_disk["gates"]) == set(GATE_NAMES)
    again = read_stored_audit(root, "B1", tokens_sha256=stored.tokens_sha256, key=stored.audit_key)
    assert again is not None and np.array_equal(again.keep_mask, full.filter_mask)
    assert again.gate("not_truncated")["failing"] == len(CUT) and again.passed


def test_checks_read_the_stored_result_instead_of_auditing_again(root, demo_tok, demo_ids):
    settings = AuditSettings()
    audit_token_samples(root, "B1", demo_tok, demo_ids, settings)
    # An edit that keeps the binding is what a reader of the stored result sees; an audit run again would not.
    _rewrite_report(root, lambda raw: raw["gates"]["single_eot"].update(failing=7, blocking=True))
    audit = current_audit(root, "B1", demo_tok, demo_ids, settings)
    assert audit.gate("single_eot")["failing"] == 7
    verdict = record_gate_verdict(root, audit, "single_eot")
    record = json.loads(gate_record_path(root, "B1", "single_eot").read_text())
    assert verdict["blocking"] and record["blocking_failed"] and record["failing"] == 7
    assert record["tokens_sha256"] == audit.tokens_sha256 and record["audit_key"] == audit.audit_key


@pytest.mark.parametrize(
    "stale", ["missing", "other_file", "other_settings", "no_keep_mask", "short_keep_mask", "unreadable"]
)
def test_a_missing_or_stale_result_is_recomputed(root, demo_tok, demo_ids, stale):
    settings = AuditSettings()
    audit_token_samples(root, "B1", demo_tok, demo_ids, settings)
    _rewrite_report(root, lambda raw: raw["gates"]["single_eot"].update(failing=7, blocking=True))
    if stale == "missing":
        root.audit_report("B1").unlink()
    elif stale == "other_file":
        # New token samples: two more rows cut short; the old report must not stand for them.
        table = pq.read_table(root.tokens("B1"))
        write_parquet_atomic(
            mutate(table, [4, 5], lambda ids, r: ids, finish_reason=lambda v, r: "length"), root.tokens("B1")
        )
    elif stale == "other_settings":
        settings = AuditSettings(actions={"not_truncated": "warn"})
    elif stale == "no_keep_mask":
        _rewrite_report(root, lambda raw: raw.pop("keep_mask"))  # written before the mask was stored
    elif stale == "short_keep_mask":
        _rewrite_report(root, lambda raw: raw["keep_mask"].update(n_rows=3))  # damaged: rows and mask disagree
    else:
        root.audit_report("B1").write_text("{not json")
    audit = current_audit(root, "B1", demo_tok, demo_ids, settings)
    assert audit.gate("single_eot")["failing"] == 0 and audit.passed
    assert audit.tokens_sha256 == file_sha256(root.tokens("B1"))
    assert audit.audit_key == audit_key(demo_tok, demo_ids, settings)
    expected = {"other_file": 6, "other_settings": 0}.get(stale, len(CUT))
    assert audit.excluded_counts.get("not_truncated", 0) == expected
    # ... and the recomputed result is what is stored now.
    assert read_stored_audit(root, "B1", tokens_sha256=audit.tokens_sha256, key=audit.audit_key) is not None


def _check_all(root, tok, ids, settings):
    audit = current_audit(root, "B1", tok, ids, settings)
    for name in GATE_NAMES:
        record_gate_verdict(root, audit, name)


def test_merge_admission_needs_every_current_verdict(root, demo_tok, demo_ids):
    settings = AuditSettings()
    problems, audits = audits_for_merge(root, ["B1"], demo_tok, demo_ids, settings)
    assert audits == {} and len(problems) == len(GATE_NAMES)
    assert all("never ran" in p.reason for p in problems)

    _check_all(root, demo_tok, demo_ids, settings)
    problems, audits = audits_for_merge(root, ["B1"], demo_tok, demo_ids, settings)
    assert problems == [] and not audits["B1"].keep_mask[CUT].any()

    # Verdicts reached under other settings are stale, even on the same file.
    problems, audits = audits_for_merge(
        root, ["B1"], demo_tok, demo_ids, AuditSettings(actions={"not_truncated": "warn"})
    )
    assert audits == {} and {p.reason for p in problems} == {
        "audit check ran under other audit settings, tokenizer or model profile"
    }

    # New token samples without their checks: every verdict is stale.
    table = pq.read_table(root.tokens("B1"))
    write_parquet_atomic(table.slice(1), root.tokens("B1"))
    problems, _ = audits_for_merge(root, ["B1"], demo_tok, demo_ids, settings)
    assert {p.reason for p in problems} == {"audit check did not run on the latest token samples"}

    # A blocking failure is named with its counts.
    strict = AuditSettings(actions={"not_truncated": "block"})
    _check_all(root, demo_tok, demo_ids, strict)
    problems, audits = audits_for_merge(root, ["B1"], demo_tok, demo_ids, strict)
    assert audits == {} and [str(p) for p in problems] == ["B1/not_truncated: blocking audit failed (3 of 39 rows)"]
    problems, _ = audits_for_merge(root, ["B1", "B2"], demo_tok, demo_ids, strict)
    assert "B2/*: token samples not materialized" in [str(p) for p in problems]
