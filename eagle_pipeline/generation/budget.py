"""Spend accounting: the dataset's ledger (committed spend plus this run's), the pipeline-wide cap, and the check that
stops new requests before a budget is overshot.

Committed rows carry their `cost_usd`, so a dataset's spend is rebuilt from disk at every start: a budget holds across
runs, resumes and kills. The pipeline-wide cap is shared while runs of the data root run in parallel through the
spend ledger of `spend_ledger` (`pipeline_budget`); `SpendTracker` is the in-process form (threads of one process).
The Dagster asset and any other caller (CLI, scripts) use the same functions.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from eagle_pipeline.generation import store
from eagle_pipeline.generation.spend_ledger import SharedSpend


class RunBudget(Protocol):
    """A pipeline-wide cap as one run sees it: `SpendTracker`, or a run's share of the data root's spend ledger."""

    budget_usd: float | None

    def add(self, usd: float) -> None: ...

    def reached(self, projected_extra_usd: float = 0.0) -> bool: ...

    def why_reached(self) -> str | None: ...

    @property
    def spent_usd(self) -> float: ...


class SpendTracker:
    """Spend shared by every dataset of one pipeline run (thread-safe: datasets may generate in parallel threads)."""

    def __init__(self, budget_usd: float | None = None) -> None:
        self.budget_usd = budget_usd
        self._spent = 0.0
        self._lock = threading.Lock()

    def add(self, usd: float) -> None:
        with self._lock:
            self._spent += usd

    @property
    def spent_usd(self) -> float:
        with self._lock:
            return self._spent

    def reached(self, projected_extra_usd: float = 0.0) -> bool:
        """True when the spend (plus what in-flight requests are expected to cost) reaches the budget."""
        if self.budget_usd is None:
            return False
        with self._lock:
            return self._spent + projected_extra_usd >= self.budget_usd

    def why_reached(self) -> str | None:
        if self.budget_usd is None or not self.reached():
            return None
        return f"run budget ${self.budget_usd:,.4f} reached (${self.spent_usd:,.4f} spent)"

    @contextlib.contextmanager
    def join(self, dataset: str, committed_usd: float) -> Iterator[SpendTracker]:
        """This tracker for a run of `dataset` (the same interface as `SharedSpend.join`; nothing to set up)."""
        yield self


def committed_spend(responses_dirs: Iterable[str | os.PathLike]) -> float:
    """The spend recorded by every committed response shard of these dataset directories."""
    return sum(store.committed_sample_ids(d)[1] for d in responses_dirs)


def pipeline_budget(
    budget_usd: float | None, responses_dirs: Iterable[str | os.PathLike], **ledger_options: Any
) -> SharedSpend | None:
    """The pipeline-wide spend cap over these dataset directories (`{data_root}/responses/{name}`; None when there is
    no cap), held by every run of the data root together while they run: each run joins the data root's spend ledger
    (`spend_ledger.SharedSpend`) and stops new requests once the committed spend of every dataset, the answers of
    every live run and what every live run has in flight reach `budget_usd`."""
    if budget_usd is None:
        return None
    return SharedSpend(budget_usd, [Path(d) for d in responses_dirs], **ledger_options)


class SpendLedger:
    """One dataset's spend during a run: what earlier runs committed, what this run's answers cost, and the caps.

    Not thread-safe: one run's workers share one event loop. The pipeline-wide `run_budget` is shared across threads
    and has its own lock.
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
