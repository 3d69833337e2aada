"""Audit verdicts on disk, and the cross-run gate that reads them.

Dagster's blocking checks hold only inside one run. Each audit check therefore also records its verdict beside the
data (`audit/{dataset}/{gate}.json`, with the sha256 of the token-samples file it judged), and the merge refuses to
start unless, for every dataset, every gate ran on the *current* token samples and every blocking gate passed. This
holds for UI clicks, schedules, backfills and the CLI alike, and does not depend on the Dagster instance database.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from eagle_pipeline.storage import DataRoot, file_sha256, read_json, write_json_atomic


def gate_record_path(root: DataRoot, dataset: str, gate: str) -> Path:
    return root.root / "audit" / dataset / f"{gate}.json"


def write_gate_record(
    root: DataRoot,
    dataset: str,
    gate: str,
    *,
    tokens_sha256: str,
    action: str,
    blocking_failed: bool,
    checked: int,
    failing: int,
) -> Path:
    """Record one gate's verdict on one dataset's token samples."""
    return write_json_atomic(
        {
            "dataset": dataset,
            "gate": gate,
            "tokens_sha256": tokens_sha256,
            "action": action,
            "blocking_failed": bool(blocking_failed),
            "checked": int(checked),
            "failing": int(failing),
            "at": _dt.datetime.now(_dt.UTC).isoformat(),
        },
        gate_record_path(root, dataset, gate),
    )


@dataclass(frozen=True)
class GateProblem:
    dataset: str
    gate: str
    reason: str

    def __str__(self) -> str:
        return f"{self.dataset}/{self.gate}: {self.reason}"


def audit_problems(root: DataRoot, datasets: Iterable[str], gates: Iterable[str]) -> list[GateProblem]:
    """Every reason the merge must not run: a missing, stale or failed blocking verdict, for any dataset."""
    problems: list[GateProblem] = []
    gates = list(gates)
    for ds in datasets:
        tokens = root.tokens(ds)
        if not tokens.exists():
            problems.append(GateProblem(ds, "*", "token samples not materialized"))
            continue
        current = file_sha256(tokens)
        for gate in gates:
            path = gate_record_path(root, ds, gate)
            if not path.exists():
                problems.append(GateProblem(ds, gate, "audit check never ran"))
                continue
            rec = read_json(path)
            if rec.get("tokens_sha256") != current:
                problems.append(GateProblem(ds, gate, "audit check did not run on the latest token samples"))
            elif rec.get("blocking_failed", True):
                problems.append(
                    GateProblem(ds, gate, f"blocking audit failed ({rec.get('failing')} of {rec.get('checked')} rows)")
                )
    return problems
