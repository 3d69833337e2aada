"""Assertions shared by the mutation tests."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_pipeline.audit import AuditReport, AuditSettings, run_audit


def pick_rows(
    table: pa.Table, k: int, pred: Callable[[dict[str, Any]], bool] = lambda r: True, seed: int = 1
) -> list[int]:
    """k row indices (sorted) whose row satisfies `pred`, chosen with a fixed seed."""
    rows = [i for i, r in enumerate(table.to_pylist()) if pred(r)]
    assert len(rows) >= k, f"only {len(rows)} rows match, need {k}"
    return sorted(random.Random(seed).sample(rows, k))


def assert_caught(
    table: pa.Table,
    rows: list[int],
    tok: Any,
    ids: Any,
    intended: str,
    *,
    allowed: Iterable[str] = (),
    exact: bool = True,
    settings: AuditSettings | None = None,
) -> AuditReport:
    """Audit a mutated table: `intended` flags exactly the mutated rows (or a subset when exact=False); every other
    gate flags nothing outside them, and only gates in `allowed` flag anything at all."""
    report = run_audit(table, tok, ids, settings)
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[rows] = True
    target = report.result(intended)
    if exact:
        missed = np.flatnonzero(mask & ~target.row_fail).tolist()
        assert not missed, f"{intended} missed mutated rows {missed[:10]} (details {target.details})"
    else:
        assert target.failing > 0, f"{intended} caught none of {len(rows)} mutated rows"
    fired = {}
    for r in report.results:
        stray = np.flatnonzero(r.row_fail & ~mask).tolist()
        assert not stray, f"{r.name} flagged untouched rows {stray[:10]}: {r.examples[:2]}"
        if r.name != intended and r.failing:
            fired[r.name] = r.failing
    assert set(fired) <= set(allowed), f"unexpected gates fired: {fired} (allowed: {sorted(allowed)})"
    return report
