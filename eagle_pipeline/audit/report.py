"""Running gates and the results they produce: per-gate results, the audit report, the row filter mask, and the
verdict each gate's result reads as (for the asset checks and the UI)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_pipeline.audit.context import ORIGINS, AuditContext
from eagle_pipeline.audit.gates import Outcome
from eagle_pipeline.audit.spec import GATE_NAMES, GATES_BY_NAME, AuditSettings, AuditSettingsError
from eagle_pipeline.tokens.tokenizer import EncodingMemo

EXCLUDING_ACTIONS = ("block", "filter")


@dataclass
class GateResult:
    """What one gate found.

    Its own type, not `shared.checks.CheckResult`: a gate is vectorised over the whole table and the audit acts on
    its per-row arrays (`row_fail`, `row_excluded` make the filter mask), its action ('block' | 'filter' | ...) and
    its breakdowns by source and origin; a CheckResult only reports pass or fail with counts and ids.

    `passed` is "no failing row" (billing: the aggregate is within its bound). `blocking` is True when the
    failure stops the pipeline (a failing row whose action is 'block'; billing: aggregate failed under 'block').
    `row_excluded` marks the failing rows whose action is 'block' or 'filter': they never reach training data.
    """

    name: str
    title: str
    action: str
    origin_actions: dict[str, str]
    checked: int
    failing: int
    rate: float
    passed: bool
    blocking: bool
    row_fail: np.ndarray
    row_excluded: np.ndarray
    failing_sample_ids: list[str]
    examples: list[dict[str, Any]]
    by_source: dict[str, dict[str, Any]]
    by_origin: dict[str, dict[str, Any]]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def excluded(self) -> int:
        return int(np.count_nonzero(self.row_excluded))

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "name": self.name,
                "title": self.title,
                "action": self.action,
                "origin_actions": self.origin_actions,
                "checked": self.checked,
                "failing": self.failing,
                "rate": self.rate,
                "passed": self.passed,
                "blocking": self.blocking,
                "excluded": self.excluded,
                "failing_sample_ids": self.failing_sample_ids,
                "examples": self.examples,
                "by_source": self.by_source,
                "by_origin": self.by_origin,
                "details": self.details,
            }
        )


@dataclass
class AuditReport:
    results: list[GateResult]
    n_rows: int
    n_tokens: int
    settings: AuditSettings
    tokenizer: dict[str, Any] = field(default_factory=dict)

    def result(self, name: str) -> GateResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"gate {name!r} was not run; run: {[r.name for r in self.results]}")

    @property
    def blocking_failed(self) -> list[str]:
        return [r.name for r in self.results if r.blocking]

    @property
    def passed(self) -> bool:
        return not self.blocking_failed

    @property
    def filter_mask(self) -> np.ndarray:
        """Rows to keep: those failing no gate whose action is 'filter' or 'block'."""
        keep = np.ones(self.n_rows, dtype=bool)
        for r in self.results:
            keep &= ~r.row_excluded
        return keep

    @property
    def excluded_counts(self) -> dict[str, int]:
        """Rows each gate excludes (a row failing two gates counts for both)."""
        return {r.name: r.excluded for r in self.results if r.excluded}

    def to_dict(self) -> dict[str, Any]:
        kept = int(np.count_nonzero(self.filter_mask))
        return _json_safe(
            {
                "passed": self.passed,
                "blocking_failed": self.blocking_failed,
                "n_rows": self.n_rows,
                "n_tokens": self.n_tokens,
                "n_kept": kept,
                "n_excluded": self.n_rows - kept,
                "excluded_counts": self.excluded_counts,
                "tokenizer": self.tokenizer,
                "settings": self.settings.to_dict(),
                "gates": {r.name: r.to_dict() for r in self.results},
            }
        )

    def summary(self) -> str:
        """One line per gate, for terminals and logs."""
        lines = []
        for r in self.results:
            status = (
                "BLOCK" if r.blocking else "FILTER" if r.excluded else "WARN" if not r.passed or r.failing else "ok"
            )
            lines.append(f"{r.name:<26} {status:<6} failing {r.failing}/{r.checked}  excluded {r.excluded}")
        kept = int(np.count_nonzero(self.filter_mask))
        lines.append(
            f"kept {kept}/{self.n_rows} rows; {'PASSED' if self.passed else 'BLOCKED by ' + ', '.join(self.blocking_failed)}"
        )
        return "\n".join(lines)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _finish(name: str, ctx: AuditContext, out: Outcome, settings: AuditSettings) -> GateResult:
    spec = GATES_BY_NAME[name]
    origin_actions = {o: settings.action_for(name, o) for o in ORIGINS}
    n = ctx.n
    checked, fail = (
        np.asarray(out.checked, dtype=bool),
        np.asarray(out.fail, dtype=bool) & np.asarray(out.checked, dtype=bool),
    )
    if checked.shape != (n,) or fail.shape != (n,):
        raise AssertionError(f"gate {name} returned masks of the wrong shape")
    n_checked, n_fail = int(np.count_nonzero(checked)), int(np.count_nonzero(fail))
    origin = ctx.origin
    excl_origin = np.array([origin_actions[o] in EXCLUDING_ACTIONS for o in ORIGINS])
    block_origin = np.array([origin_actions[o] == "block" for o in ORIGINS])
    row_excluded = fail & excl_origin[origin]
    passed = (n_fail == 0) if out.passed is None else bool(out.passed)
    if out.passed is None:
        blocking = bool(np.any(fail & block_origin[origin]))
    else:
        blocking = (not passed) and bool(np.any(checked & block_origin[origin]))

    fail_rows = np.flatnonzero(fail)
    first = fail_rows[: settings.max_examples]
    ids = ctx.sample_ids(first)
    examples = []
    for sid, row in zip(ids, first.tolist()):
        p = int(out.pos[row])
        if p < 0:
            p = max(int(ctx.lengths[row]) - 1, 0)
        ex: dict[str, Any] = {"sample_id": sid, "row": row, "position": p}
        if row in out.reasons:
            ex["problem"] = out.reasons[row]
        ex["excerpt"] = out.excerpts[row] if row in out.excerpts else ctx.excerpt(row, p, settings.excerpt_tokens)
        examples.append(ex)

    codes, keys = ctx.sources
    src_checked = np.bincount(codes[checked], minlength=len(keys))
    src_fail = np.bincount(codes[fail], minlength=len(keys))
    by_source = {}
    for k, key in enumerate(keys):
        if src_checked[k] == 0:
            continue
        entry: dict[str, Any] = {"checked": int(src_checked[k]), "failing": int(src_fail[k])}
        entry.update(out.source_extra.get(key, {}))
        by_source[key] = entry
    by_origin = {}
    for k, o in enumerate(ORIGINS):
        c = int(np.count_nonzero(checked & (origin == k)))
        if c:
            by_origin[o] = {
                "checked": c,
                "failing": int(np.count_nonzero(fail & (origin == k))),
                "action": origin_actions[o],
            }

    return GateResult(
        name=name,
        title=spec.title,
        action=settings.action_for(name),
        origin_actions=origin_actions,
        checked=n_checked,
        failing=n_fail,
        rate=(n_fail / n_checked) if n_checked else 0.0,
        passed=passed,
        blocking=blocking,
        row_fail=fail,
        row_excluded=row_excluded,
        failing_sample_ids=ids,
        examples=examples,
        by_source=by_source,
        by_origin=by_origin,
        details=out.details,
    )


def _check_gate_names(gates: Iterable[str]) -> list[str]:
    names = list(gates)
    unknown = [g for g in names if g not in GATES_BY_NAME]
    if unknown:
        raise AuditSettingsError(f"unknown gate(s) {unknown}; gates: {', '.join(GATE_NAMES)}")
    return names


def run_gate(
    name: str, table: pa.Table, tokenizer: Any, profile_ids: Any, settings: AuditSettings | None = None
) -> GateResult:
    """Run one gate over a token-samples table."""
    _check_gate_names([name])
    settings = settings or AuditSettings()
    ctx = AuditContext(table, tokenizer, profile_ids)
    return _finish(name, ctx, GATES_BY_NAME[name].run(ctx, settings), settings)


def run_audit(
    table: pa.Table,
    tokenizer: Any,
    profile_ids: Any,
    settings: AuditSettings | None = None,
    *,
    gates: Iterable[str] | None = None,
    memo: EncodingMemo | None = None,
) -> AuditReport:
    """Run `gates` (default: every gate, in GATES order) over one table, sharing the Arrow -> numpy work. `memo`: the
    encodings the table's reconstruction made (`reconstruct_table(..., memo=)`), so the round trip re-encodes none
    of them; the report is the same with or without it."""
    names = _check_gate_names(GATE_NAMES if gates is None else gates)
    settings = settings or AuditSettings()
    ctx = AuditContext(table, tokenizer, profile_ids, memo)
    results = [_finish(name, ctx, GATES_BY_NAME[name].run(ctx, settings), settings) for name in names]
    return AuditReport(
        results=results,
        n_rows=ctx.n,
        n_tokens=ctx.n_tokens,
        settings=settings,
        tokenizer=_tokenizer_info(tokenizer),
    )


def _tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"name": getattr(tokenizer, "name", None), "vocab_size": int(tokenizer.vocab_size)}
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if callable(fingerprint):
        info["fingerprint"] = fingerprint()
    return info


def gate_verdict(gate: Mapping[str, Any]) -> str:
    """What one gate's result (`GateResult.to_dict()`) means for the data: `FAIL (blocks)`, `pass`, or how many
    failing rows are filtered out and how many are only warned about."""
    if gate["blocking"]:
        return "FAIL (blocks)"
    if gate["failing"] == 0:
        return "pass"
    warned = gate["failing"] - gate["excluded"]
    return f"{gate['excluded']} rows filtered" + (f", {warned} warned" if warned else "")


def report_markdown(report: Mapping[str, Any]) -> str:
    """A Markdown table of a report (`AuditReport.to_dict()`), one row per gate in catalogue order."""
    gates = report["gates"]
    lines = ["| gate | action | checked | failing | rate | verdict |", "|---|---|---|---|---|---|"]
    for name in [*(n for n in GATE_NAMES if n in gates), *(n for n in gates if n not in GATE_NAMES)]:
        r = gates[name]
        lines.append(
            f"| {name} | {r['action']} | {r['checked']} | {r['failing']} | {r['rate']:.4%} | {gate_verdict(r)} |"
        )
    return "\n".join(lines)
