"""Spend accounting: the dataset's ledger (committed spend plus this run's), the pipeline-wide cap, and the check that
stops new requests before a budget is overshot.

Committed rows carry their `cost_usd`, so a dataset's spend is rebuilt from disk at every start: a budget holds across
runs, resumes and kills. The pipeline-wide cap is shared while runs of the data root run in parallel through the
spend ledger of `spend_ledger` (`pipeline_budget`).
The Dagster asset and any other caller (CLI, scripts) use the same functions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from eagle_pipeline.generation.spend.ledger import SharedSpend


class RunBudget(Protocol):
    """A pipeline-wide cap as one run sees it: its share of the data root's spend ledger (`SharedSpend.join`)."""

    budget_usd: float | None

    def add(self, usd: float) -> None: ...

    def reached(self, projected_extra_usd: float = 0.0) -> bool: ...

    def why_reached(self) -> str | None: ...

    @property
    def spent_usd(self) -> float: ...


def pipeline_budget(
    budget_usd: float | None, responses_dirs: Iterable[str | os.PathLike], **ledger_options: Any
) -> SharedSpend | None:
    """The pipeline-wide spend cap over these dataset directories (`{data_root}/responses/{name}`; None when there is
    no cap), held by every run of the data root together while they run: each run joins the data root's spend ledger
    (`ledger.SharedSpend`) and stops new requests once the committed spend of every dataset, the answers of
    every live run and what every live run has in flight reach `budget_usd`."""
    if budget_usd is None:
        return None
    return SharedSpend(budget_usd, [Path(d) for d in responses_dirs], **ledger_options)


class SpendLedger:
    """One dataset's spend during a run: what earlier runs committed, what this run's answers cost, and the caps.

    Not thread-safe: one run's workers share one event loop.
    """

    def __init__(
        self, *, committed_usd: float, budget_usd: float | None = None, run_budget: RunBudget | None = None
    ) -> None:
        self.committed_usd = committed_usd
        self.budget_usd = budget_usd
        self.run_budget = run_budget
        self.this_run_usd = 0.0
        self.answers = 0  # answered requests of this run, billed or not (the average cost per request)
        self.why: str | None = None  # which budget stopped the run, and the figures (set by `reached`)

    @property
    def dataset_total_usd(self) -> float:
        """Spend of every committed row of the dataset's directory, earlier runs included, plus this run's."""
        return self.committed_usd + self.this_run_usd

    def record(self, cost_usd: float | None) -> None:
        """Account for one answered request."""
        self.answers += 1
        if cost_usd:
            self.this_run_usd += cost_usd
            if self.run_budget is not None:
                self.run_budget.add(cost_usd)

    def reached(self, inflight: int) -> bool:
        """True when new requests must stop: a budget is reached, counting what the requests in flight will cost.

        The projection (in-flight count times the average cost so far) keeps 2,000 requests in flight from
        overshooting blindly.
        """
        avg = self.this_run_usd / self.answers if self.answers else 0.0
        projected = inflight * avg
        if self.budget_usd is not None and self.dataset_total_usd + projected >= self.budget_usd:
            self.why = (
                f"the dataset's budget_usd ${self.budget_usd:,.4f} reached (${self.dataset_total_usd:,.4f} spent, "
                f"${projected:,.4f} in flight)"
            )
            return True
        if self.run_budget is not None and self.run_budget.reached(projected):
            self.why = self.run_budget.why_reached() or "the pipeline budget reached"
            return True
        return False
