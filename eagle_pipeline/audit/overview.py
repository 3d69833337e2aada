"""The audit view: for every dataset, whether its latest token samples are fit to merge and why, gate by gate; and
the one-line summaries the audit checks show (dataset and counts); and the per-dataset overview table of the merged
dataset's metadata (`dataset_overview`). No Dagster imports.

Fit to merge is the merge's own verdict (`records.merge_verdict`), never a second judgement; the gate figures
come from the stored audit of the dataset's current token-samples file (bound to its sha256 and the settings).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from eagle_pipeline.audit.records import GateProblem, merge_verdict
from eagle_pipeline.audit.report import gate_verdict
from eagle_pipeline.audit.spec import GATE_NAMES, AuditSettings
from eagle_pipeline.shared.storage import DataRoot, read_json

EXAMPLE_CHARS = 160


def _pct(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.2%}"


def gate_counts(gate: Mapping[str, Any]) -> str:
    """What a gate counted, in words: `4 of 4 rows over the per-row tolerance; aggregate 12.97% > 0.50%`."""
    details = gate.get("details") or {}
    if "aggregate_bound" in details:  # billing: rows over their tolerance, and the aggregate that decides
        agg, bound = details.get("aggregate_relative_error"), float(details["aggregate_bound"])
        relation = ">" if agg is None or agg > bound else "≤"
        text = (
            f"{gate['failing']} of {gate['checked']} rows over the per-row tolerance; "
            f"aggregate {_pct(agg)} {relation} {_pct(bound)}"
        )
    elif gate["checked"] == 0:
        text = "no row to check"
    else:
        text = f"{gate['failing']} of {gate['checked']} rows failing"
    if gate.get("excluded"):
        text += f"; {gate['excluded']} excluded downstream"
    return text


def gate_summary(dataset: str, gate: Mapping[str, Any]) -> str:
    """One gate's result on one dataset as one line: `B3: FAIL (blocks): 4 of 4 rows over the per-row tolerance;
    aggregate 12.97% > 0.50%`. The asset check's description."""
    return f"{dataset}: {gate_verdict(gate)}: {gate_counts(gate)}"


def first_failure(gate: Mapping[str, Any]) -> str | None:
    """The first failing row of a gate as plain text (sample id, problem, excerpt), or None when no row failed."""
    examples = gate.get("examples") or []
    if not examples:
        return None
    e = examples[0]
    excerpt = str(e.get("excerpt", ""))[:EXAMPLE_CHARS]
    return f"{e['sample_id']}: " + (f"{e['problem']}; " if e.get("problem") else "") + f"excerpt {excerpt!r}"


def audit_failure_summary(dataset: str, name: str, gate: Mapping[str, Any]) -> str:
    """The paragraph a run that a blocking gate stopped starts with: what failed, the figures, the first failing row,
    what to do."""
    example = first_failure(gate)
    return (
        f"Audit failed: {name} blocks {dataset}: {gate_counts(gate)}."
        + (f" First failing row: {example}." if example else "")
        + f" What to do: the `{name}` section of docs/audit.md gives its usual causes; fix the data or the configuration, then "
        f"rerun EAGLE_dataset for {dataset}. The merge refuses until every blocking gate passes on {dataset}'s latest "
        "token samples; audit_overview shows every dataset's verdict."
    )


@dataclass(frozen=True)
class DatasetAudit:
    """One dataset in the audit view. `gates` maps a gate to its stored result (`GateResult.to_dict()`) on the
    current token samples ({} when no audit of them is stored); `fit` and `problems` are the merge's verdict."""

    dataset: str
    fit: bool
    problems: list[GateProblem]
    rows: int | None
    rows_kept: int | None
    gates: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def blocking_gates(self) -> list[str]:
        return [g for g in _ordered(self.gates) if self.gates[g]["blocking"]]

    @property
    def reason(self) -> str:
        """Why the dataset is or is not fit to merge: each blocking gate's summary, then any other problem."""
        if self.fit:
            excluded = (
                "" if not self.rows or self.rows_kept is None else f"; {self.rows - self.rows_kept} rows excluded"
            )
            return f"every gate ran on the latest token samples and none blocks{excluded}"
        blocking = [f"{g}: {gate_counts(self.gates[g])}" for g in self.blocking_gates]
        return "; ".join([*blocking, *self._other_problems()])

    def _other_problems(self) -> list[str]:
        """The merge's problems other than the blocking gates, one line per reason with the gates it concerns."""
        by_reason: dict[str, list[str]] = {}
        for problem in self.problems:
            if problem.gate not in self.blocking_gates:
                by_reason.setdefault(problem.reason, []).append(problem.gate)
        lines = []
        for why, gates in by_reason.items():
            if gates == ["*"]:
                lines.append(why)
            elif set(gates) >= set(GATE_NAMES):
                lines.append(f"{why} (every gate)")
            else:
                lines.append(f"{why} ({', '.join(gates)})")
        return lines

    @property
    def first_failure(self) -> str | None:
        """The first failing row of the first blocking gate (else of the first gate with a failing row)."""
        order = [*self.blocking_gates, *(g for g in _ordered(self.gates) if self.gates[g]["failing"])]
        for g in order:
            found = first_failure(self.gates[g])
            if found:
                return f"{g}: {found}"
        return None


def _ordered(gates: Mapping[str, Any]) -> list[str]:
    return [*(n for n in GATE_NAMES if n in gates), *(n for n in gates if n not in GATE_NAMES)]


def audit_overview(
    root: DataRoot, datasets: Iterable[str], tokenizer: Any, profile_ids: Any, settings: AuditSettings
) -> list[DatasetAudit]:
    """Every dataset's audit view entry, from the stored audits and the merge's verdict."""
    out = []
    for ds in datasets:
        verdict = merge_verdict(root, ds, tokenizer, profile_ids, settings)
        report = verdict.audit.report if verdict.audit is not None else None
        out.append(
            DatasetAudit(
                dataset=ds,
                fit=verdict.fit,
                problems=verdict.problems,
                rows=None if report is None else int(report["n_rows"]),
                rows_kept=None if report is None else int(report["n_kept"]),
                gates={} if report is None else dict(report["gates"]),
            )
        )
    return out


def fit_line(audits: Sequence[DatasetAudit]) -> str:
    """`1 of 2 datasets fit to merge: B1 yes; B6 NO (billing_agreement)`: the blocking gates, else the reason."""
    parts = [
        f"{a.dataset} yes" if a.fit else f"{a.dataset} NO ({', '.join(a.blocking_gates) or a.reason})" for a in audits
    ]
    return f"{sum(a.fit for a in audits)} of {len(audits)} datasets fit to merge: " + "; ".join(parts)


def dataset_rows(audits: Sequence[DatasetAudit]) -> list[dict[str, Any]]:
    """One row per dataset: fit to merge, rows audited and excluded (None: no audit of the current file), the
    reason. Short column names: the table must fit beside the UI's event list in a 1280 px window."""
    return [
        {
            "dataset": a.dataset,
            "fit": "yes" if a.fit else "NO",
            "rows": a.rows,
            "excluded": None if a.rows is None or a.rows_kept is None else a.rows - a.rows_kept,
            "reason": a.reason,
        }
        for a in audits
    ]


def gate_rows(audits: Sequence[DatasetAudit]) -> list[dict[str, Any]]:
    """One row per dataset and gate that found something (a failing row or a block): action, failing rows of rows
    checked, verdict, rows excluded downstream."""
    return [
        {
            "dataset": a.dataset,
            "gate": name,
            "action": g["action"],
            "failing": f"{g['failing']} of {g['checked']}",
            "verdict": gate_verdict(g),
            "excluded": int(g["excluded"]),
        }
        for a in audits
        for name in _ordered(a.gates)
        if (g := a.gates[name])["failing"] or g["blocking"]
    ]


def grid_markdown(audits: Sequence[DatasetAudit]) -> str:
    """Datasets × gates as a Markdown table: each cell is `verdict (failing/checked rows, action)`."""
    names = [n for n in GATE_NAMES if any(n in a.gates for a in audits)] or list(GATE_NAMES)
    lines = [
        "Each cell: verdict (failing rows / rows checked, action). Fit to merge is the merge's own verdict.",
        "",
        "| gate | " + " | ".join(a.dataset for a in audits) + " |",
        "|---|" + "---|" * len(audits),
    ]
    for name in names:
        cells = []
        for a in audits:
            g = a.gates.get(name)
            cells.append(
                "not audited" if g is None else f"{gate_verdict(g)} ({g['failing']}/{g['checked']}, {g['action']})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **fit to merge** | " + " | ".join("**yes**" if a.fit else "**NO**" for a in audits) + " |")
    return "\n".join(lines)


def refusal_summary(audits: Sequence[DatasetAudit]) -> str:
    """The one paragraph a refused merge starts with: which datasets are unfit, each one's figures, what to do."""
    unfit = [a for a in audits if not a.fit]
    reasons = " ".join(f"{a.dataset}: {a.reason}." for a in unfit)
    # A dataset with no audited token samples stopped before its audit (a prompt file, the backend): docs/audit.md
    # has nothing to say about it; its own run's failed step does.
    audited = [a.dataset for a in unfit if a.gates]
    unaudited = [a.dataset for a in unfit if not a.gates]
    fixes = []
    if audited:
        fixes.append(
            f"fix the data or the configuration behind each failing gate of {', '.join(audited)} (docs/audit.md gives "
            "each gate's usual causes)"
        )
    if unaudited:
        fixes.append(
            f"for {', '.join(unaudited)}, with no audited token samples, the failed step of its last EAGLE_dataset run "
            "says what stopped it before the audit (a prompt file, the backend)"
        )
    return (
        f"Merge refused: {len(unfit)} of {len(audits)} datasets are not fit to merge. {reasons} Nothing was merged. "
        f"What to do: {'; '.join(fixes)}; rerun EAGLE_dataset for each so every gate runs on its latest token "
        "samples, then run EAGLE_merge again; the audit_overview asset shows every dataset's verdict."
    )


def dataset_overview(
    root: DataRoot,
    datasets: Sequence[str],
    merged_rows: Mapping[str, int] | None = None,
    responses: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict]:
    """One row per dataset: responses, spend, failed requests, provider split, token samples, audit verdict, merged
    (the gates behind a verdict are in the audit view, audit_overview).

    Reads only Parquet columns it needs and the audit reports. `responses` maps a
    dataset to its responses columns (generation.store.coverage.response_overview: rows answering the current prompts,
    rows answering other prompts, the ledger's spend, the provider split).
    """
    rows = []
    for ds in datasets:
        errs = sorted(root.errors_dir(ds).glob("part-*.parquet"))
        n_errors = sum(pq.read_metadata(p).num_rows for p in errs)
        audit = read_json(root.audit_report(ds)) if root.audit_report(ds).exists() else None
        rows.append(
            {
                "dataset": ds,
                **dict((responses or {}).get(ds, {"responses": 0, "other_prompt_rows": 0, "spend_usd": 0.0})),
                "failed_requests": n_errors,
                "token_samples": pq.read_metadata(root.tokens(ds)).num_rows if root.tokens(ds).exists() else 0,
                "audit": "-" if audit is None else ("pass" if audit.get("passed") else "FAIL"),
                "merged_rows": int((merged_rows or {}).get(ds, 0)),
            }
        )
    return rows
