"""Gate catalogue, AuditSettings validation and actions, the filter mask and the JSON report (demo tokenizer)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from eagle_pipeline.audit import (
    ACTIONS,
    GATE_NAMES,
    GATES,
    AuditSettings,
    AuditSettingsError,
    audit_settings_problems,
    run_audit,
    run_gate,
)
from eagle_pipeline.tokens import TOKEN_SAMPLES_SCHEMA, reconstruct_output

EXPECTED_GATES = {
    "ends_with_eot",
    "single_eot",
    "single_think_close",
    "think_close_before_eot",
    "no_think_open",
    "round_trip",
    "reasoning_nonempty",
    "billing_agreement",
    "tool_tokens_declared",
    "tool_sections_valid",
    "ids_in_vocab",
    "not_truncated",
    "text_agreement",
    "prompt_agreement",
}


def test_catalogue():
    assert set(GATE_NAMES) == EXPECTED_GATES and len(GATE_NAMES) == len(GATES)
    for g in GATES:
        assert g.default_action in ACTIONS and set(g.origin_defaults.values()) <= set(ACTIONS)
        assert g.title and len(g.description) > 40
    by_name = {g.name: g for g in GATES}
    assert (
        by_name["round_trip"].default_action == "block" and by_name["round_trip"].origin_defaults["returned"] == "warn"
    )
    assert by_name["not_truncated"].default_action == "filter"
    assert by_name["text_agreement"].default_action == "block" and not by_name["text_agreement"].origin_defaults
    assert AuditSettings().action_for("text_agreement", "reconstructed") == "block"
    assert (
        "text_agreement" not in AuditSettings().row_filter_gates()
    )  # block only: a passed audit implies no failing row


def test_settings_defaults_and_resolution_order():
    s = AuditSettings()
    assert s.billing_aggregate_bound == 0.005 and s.max_examples == 5 and s.excerpt_tokens == 24
    assert s.action_for("round_trip") == "block"
    assert s.action_for("round_trip", "reconstructed") == "block"
    assert s.action_for("round_trip", "returned") == "warn"
    s = AuditSettings(actions={"round_trip": "filter"})
    assert s.action_for("round_trip", "returned") == "filter"  # a gate-level setting beats the built-in origin default
    s = AuditSettings(actions={"round_trip": "filter", "round_trip@returned": "block"})
    assert s.action_for("round_trip", "returned") == "block" and s.action_for("round_trip", "reconstructed") == "filter"


def test_from_dict_accepts_plain_data():
    s = AuditSettings.from_dict(
        {"actions": {"not_truncated": "warn"}, "billing_row_abs_tolerance": 0, "billing_aggregate_bound": 0.01}
    )
    assert s.action_for("not_truncated") == "warn" and s.billing_row_abs_tolerance == 0
    assert AuditSettings.from_dict(None) == AuditSettings()
    assert AuditSettings.from_dict({"actions": None}) == AuditSettings()
    assert json.loads(json.dumps(s.to_dict()))["actions"] == {"not_truncated": "warn"}


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"actionz": {}}, "unknown key(s) ['actionz']"),
        ({"actions": {"no_such_gate": "block"}}, "unknown gate 'no_such_gate'"),
        ({"actions": {"round_trip": "drop"}}, "action 'drop' for 'round_trip'"),
        ({"actions": {"round_trip@server": "warn"}}, "unknown ids origin 'server'"),
        ({"actions": ["round_trip"]}, "actions must be a mapping"),
        ({"billing_row_abs_tolerance": -1}, "billing_row_abs_tolerance must be in"),
        ({"billing_row_abs_tolerance": 1.5}, "billing_row_abs_tolerance must be an integer"),
        ({"billing_row_rel_tolerance": True}, "billing_row_rel_tolerance must be a number"),
        ({"billing_aggregate_bound": 2}, "billing_aggregate_bound must be in"),
        ({"max_examples": "5"}, "max_examples must be an integer"),
        ({"excerpt_tokens": 0}, "excerpt_tokens must be in"),
    ],
)
def test_from_dict_rejects_bad_settings(data, fragment):
    with pytest.raises(AuditSettingsError) as exc:
        AuditSettings.from_dict(data)
    assert fragment in str(exc.value)


def test_every_problem_listed_at_once():
    with pytest.raises(AuditSettingsError) as exc:
        AuditSettings.from_dict({"actions": {"x": "y"}, "max_examples": -1})
    msg = str(exc.value)
    assert "unknown gate 'x'" in msg and "action 'y'" in msg and "max_examples" in msg


def test_one_validation_names_where_each_problem_is():
    """`audit_settings_problems` is the one check of audit settings: AuditSettings raises with exactly its problems,
    and each says where it is (for the configuration loader's `audit.<path>`)."""
    data = {
        "actions": {"ends_with_eot": "ignore", "no_such_gate": "block", "round_trip@server": "warn"},
        "max_examples": -1,
        "bogus": 1,
    }
    problems = audit_settings_problems(data)
    assert [p.path for p in problems] == [
        (),
        ("actions", "ends_with_eot"),
        ("actions", "no_such_gate"),
        ("actions", "round_trip@server"),
        ("max_examples",),
    ]
    assert "action 'ignore' for 'ends_with_eot' is not one of block, filter, warn" in str(problems[1])
    with pytest.raises(AuditSettingsError) as exc:
        AuditSettings.from_dict(data)
    assert str(exc.value).count("\n  - ") == len(problems) and all(str(p) in str(exc.value) for p in problems)
    assert audit_settings_problems(None) == [] and audit_settings_problems(AuditSettings().to_dict()) == []
    assert [p.path for p in audit_settings_problems({"actions": ["round_trip"]})] == [("actions",)]
    assert [p.path for p in audit_settings_problems([1])] == [()]  # type: ignore[arg-type]  (not a mapping)


# ---- a small table with one known defect per row ------------------------------------------------------------------


def _table(tok, ids):
    def out(reasoning, content, calls=None, thinking=True):
        return reconstruct_output(
            tok, ids, reasoning=reasoning, content=content, tool_calls=calls, thinking=thinking
        ).ids

    good = out("Thinking about it.", "The answer is 42.")
    rows = [
        ("ok", good, "stop", "reconstructed"),
        ("no_eot", good[:-1], "stop", "reconstructed"),
        ("cut", good[:-3], "length", "reconstructed"),
        ("ok_returned", good, "stop", "returned"),
        ("doubled_eot_returned", good + [ids.eot_id], "stop", "returned"),
    ]
    n = len(rows)
    return pa.table(
        {
            "sample_id": [r[0] for r in rows],
            "dataset": ["D"] * n,
            "source": ["vllm"] * n,
            "backend": ["vllm", "vllm", "or", "or", "or"],
            "provider": [None, None, "P", "P", "Q"],
            "prompt_ids": [[]] * n,
            "output_ids": [r[1] for r in rows],
            "ids_origin": [r[3] for r in rows],
            "finish_reason": [r[2] for r in rows],
            "usage_completion_tokens": [len(r[1]) for r in rows],
            "usage_prompt_tokens": [None] * n,
            "thinking": [True] * n,
            "dataset_has_tools": [False] * n,
            "n_tool_calls": [0] * n,
            "literal_special": [False] * n,
            "prompt_key": [r[0] for r in rows],
            "output_text_hash": [None] * n,  # hand-built rows: no source text, so no text digest
        },
        schema=TOKEN_SAMPLES_SCHEMA,
    )


def test_default_actions_and_filter_mask(demo_tok, demo_ids):
    report = run_audit(_table(demo_tok, demo_ids), demo_tok, demo_ids)
    assert report.blocking_failed == ["ends_with_eot", "single_eot"]
    assert not report.passed
    # Rows failing a 'filter' gate (cut) and rows failing a 'block' gate (no_eot, doubled eot) are both excluded.
    assert report.filter_mask.tolist() == [True, False, False, True, False]
    assert report.excluded_counts == {"ends_with_eot": 1, "single_eot": 2, "not_truncated": 1}
    ends = report.result("ends_with_eot")
    assert (
        ends.checked == 4
        and ends.failing_sample_ids == ["no_eot"]
        and ends.by_source
        == {
            "vllm/-": {"checked": 2, "failing": 1},
            "or/P": {"checked": 1, "failing": 0},
            "or/Q": {"checked": 1, "failing": 0},
        }
    )
    # The marked token is the row's last one, and the end of turn is indeed missing.
    assert ends.examples[0]["excerpt"].endswith("⟧") and "<|im_end|>" not in ends.examples[0]["excerpt"]


def test_action_overrides(demo_tok, demo_ids):
    table = _table(demo_tok, demo_ids)
    warn = run_audit(table, demo_tok, demo_ids, AuditSettings(actions={"ends_with_eot": "warn", "single_eot": "warn"}))
    assert warn.passed and warn.filter_mask.tolist() == [True, True, False, True, True]
    assert warn.result("ends_with_eot").failing == 1 and not warn.result("ends_with_eot").passed
    filt = run_audit(
        table, demo_tok, demo_ids, AuditSettings(actions={"ends_with_eot": "filter", "single_eot": "filter"})
    )
    assert filt.passed and filt.filter_mask.tolist() == [True, False, False, True, False]
    strict = run_audit(
        table, demo_tok, demo_ids, AuditSettings(actions={"not_truncated": "block", "single_eot": "filter"})
    )
    assert strict.blocking_failed == ["ends_with_eot", "not_truncated"]
    per_origin = run_audit(table, demo_tok, demo_ids, AuditSettings(actions={"single_eot@returned": "warn"}))
    single = per_origin.result("single_eot")
    # The returned row's failure only warns now; the reconstructed row without eot still blocks.
    assert single.failing == 2 and single.excluded == 1 and single.blocking
    assert single.origin_actions == {"reconstructed": "block", "returned": "warn"}
    assert per_origin.filter_mask.tolist() == [True, False, False, True, True]


def test_report_json(demo_tok, demo_ids, tmp_path):
    report = run_audit(_table(demo_tok, demo_ids), demo_tok, demo_ids, AuditSettings(max_examples=1))
    d = json.loads(json.dumps(report.to_dict()))
    assert set(d["gates"]) == EXPECTED_GATES
    assert d["n_rows"] == 5 and d["n_kept"] == 2 and d["n_excluded"] == 3 and d["passed"] is False
    assert d["tokenizer"]["name"] == "demo" and len(d["tokenizer"]["fingerprint"]) == 64
    g = d["gates"]["single_eot"]
    assert "row_fail" not in g and len(g["failing_sample_ids"]) == 1 and len(g["examples"]) == 1
    assert g["checked"] == 5 and g["failing"] == 2 and g["action"] == "block" and g["passed"] is False
    assert "PASSED" not in report.summary() and "BLOCKED by ends_with_eot, single_eot" in report.summary()


def test_run_gate_and_subsets(demo_tok, demo_ids):
    table = _table(demo_tok, demo_ids)
    r = run_gate("not_truncated", table, demo_tok, demo_ids)
    assert (
        r.failing == 1
        and r.details["finish_reasons"] == {"length": 1}
        and r.examples[0]["problem"] == "finish_reason='length'"
    )
    report = run_audit(table, demo_tok, demo_ids, gates=["not_truncated", "ids_in_vocab"])
    assert [x.name for x in report.results] == ["not_truncated", "ids_in_vocab"]
    with pytest.raises(AuditSettingsError, match="unknown gate"):
        run_gate("nope", table, demo_tok, demo_ids)
    with pytest.raises(AuditSettingsError, match="unknown gate"):
        run_audit(table, demo_tok, demo_ids, gates=["round_trip", "nope"])


def test_row_filter_gates():
    assert AuditSettings().row_filter_gates() == [
        "reasoning_nonempty",
        "tool_tokens_declared",
        "tool_sections_valid",
        "billing_agreement",
        "not_truncated",
    ]
    s = AuditSettings(actions={"round_trip@returned": "filter", "billing_agreement": "warn"})
    assert "round_trip" in s.row_filter_gates() and "billing_agreement" not in s.row_filter_gates()


def test_filter_pass_equals_full_audit_mask_when_nothing_blocks(demo_tok, demo_ids):
    table = _table(demo_tok, demo_ids)
    settings = AuditSettings(
        actions={"ends_with_eot": "filter", "single_eot@reconstructed": "filter", "single_eot@returned": "warn"}
    )
    full = run_audit(table, demo_tok, demo_ids, settings)
    assert full.passed
    partial = run_audit(table, demo_tok, demo_ids, settings, gates=settings.row_filter_gates())
    assert np.array_equal(full.filter_mask, partial.filter_mask)
