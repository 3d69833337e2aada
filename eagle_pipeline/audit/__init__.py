"""Structural audit gates over token-samples tables, vectorised over Arrow buffers.

    report = run_audit(table, tokenizer, profile.resolve(tokenizer), AuditSettings.from_dict(cfg))
    report.blocking_failed   # gates that stop the pipeline
    report.filter_mask       # rows to keep
See docs/audit.md for what each gate catches and what to do when it fails.
"""

from eagle_pipeline.audit.context import COMPLETE_FINISH_REASONS, ORIGINS, AuditInputError
from eagle_pipeline.audit.report import AuditReport, GateResult, gate_verdict, report_markdown, run_audit, run_gate
from eagle_pipeline.audit.spec import (
    ACTIONS,
    GATE_NAMES,
    GATES,
    GATES_BY_NAME,
    AuditSettings,
    AuditSettingsError,
    GateSpec,
    SettingsProblem,
    audit_settings_problems,
)
from eagle_pipeline.audit.tool_sections import tool_call_id_ok

__all__ = [
    "ACTIONS",
    "COMPLETE_FINISH_REASONS",
    "GATES",
    "GATES_BY_NAME",
    "GATE_NAMES",
    "ORIGINS",
    "AuditInputError",
    "AuditReport",
    "AuditSettings",
    "AuditSettingsError",
    "GateResult",
    "GateSpec",
    "SettingsProblem",
    "audit_settings_problems",
    "gate_verdict",
    "report_markdown",
    "run_audit",
    "run_gate",
    "tool_call_id_ok",
]
