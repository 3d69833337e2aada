"""What a generation run reports: progress events while it runs, its summary when it ends, and the totals of a
dataset's committed tables (for the Dagster asset's metadata, the CLI, or any script).

Counts labelled "this run" cover only the requests of the current call; "dataset total" (and `done`) include the
rows committed by earlier runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from eagle_pipeline.shared.arrow import value_counts

# Seconds between progress reports of a run (`generation.progress_every_s`, the Python API's `progress_every_s`).
DEFAULT_PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report of a running dataset."""

    dataset: str
    done: int  # prompts of this call answered: committed by earlier runs or completed in this one
    total: int
    done_this_run: int  # prompts answered in this run (a regenerated conversation once its last turn is in)
    rate_per_s: float  # prompts answered per second in this run
    eta_s: float | None
    spend_usd: float  # this run
    spend_total_usd: float  # the dataset's recorded spend: every committed row, earlier runs included, plus this run
    errors: int  # failed requests of this run
    elapsed_s: float
    already_done: int = 0  # prompts of this call committed by earlier runs
    errors_by_class: dict[str, int] = field(default_factory=dict)  # failed requests of this run, by failure class
    # Response rows: one per answer, one per turn of a regenerated conversation (regenerate: all_turns).
    rows_this_run: int = 0  # committed (or about to be) by this run
    response_rows: int = 0  # answering the prompts of this call: earlier runs' rows plus this run's

    def figures(self) -> dict[str, Any]:
        """The figures as plain values, under the keys the final responses metadata gives the same quantities
        (`current_prompts_answered`, `response_rows`, `spend_usd_this_run`, ...), so that a live report and the
        materialization that ends the run read alike: prompts (conversations) under `current_prompts*` and
        `already_done`, response rows (turns) under `response_rows` and `completed_this_run`. In the order the UI
        lists them; `eta_s` is absent while no rate is known."""
        figures: dict[str, Any] = {
            "current_prompts_answered": self.done,
            "current_prompts": self.total,
            "percent_done": round(100.0 * self.done / self.total, 2) if self.total else 100.0,
            **({"eta_s": round(self.eta_s, 1)} if self.eta_s is not None else {}),
            "rate_per_s": round(self.rate_per_s, 3),
            "spend_usd_this_run": round(float(self.spend_usd), 6),
            "spend_usd_ledger": round(float(self.spend_total_usd), 6),
            "failed_this_run": self.errors,
            "errors_by_class_this_run": dict(sorted(self.errors_by_class.items())),
            "response_rows": self.response_rows,
            "completed_this_run": self.rows_this_run,
            "already_done": self.already_done,
            "current_prompts_missing": max(0, self.total - self.done),
            "elapsed_s": round(float(self.elapsed_s), 2),
        }
        return figures

    def headline(self) -> str:
        """The figures in a few words, for a run tag: `B1 12/40 (30%) 2.1/s eta 14s $0.1234 run $1.2345 total 3 failed`."""
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = "-" if self.eta_s is None else f"{self.eta_s:,.0f}s"
        return (
            f"{self.dataset} {self.done:,}/{self.total:,} ({pct:.0f}%) {self.rate_per_s:,.1f}/s eta {eta} "
            f"${self.spend_usd:,.4f} run ${self.spend_total_usd:,.4f} total {self.errors:,} failed"
        )

    def format(self) -> str:
        """One log line, each figure labelled with what it counts."""
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = "-" if self.eta_s is None else f"{self.eta_s:,.0f}s"
        by_class = ", ".join(f"{k} {v:,}" for k, v in sorted(self.errors_by_class.items()))
        by_class = f" ({by_class})" if by_class else ""
        return (
            f"[{self.dataset}] {self.done:,}/{self.total:,} done ({pct:.1f}%), {self.done_this_run:,} this run "
            f"at {self.rate_per_s:,.1f}/s, eta {eta}; {self.response_rows:,} response rows "
            f"({self.rows_this_run:,} this run); spend ${self.spend_usd:,.4f} this run, "
            f"${self.spend_total_usd:,.4f} dataset total; errors {self.errors:,} this run{by_class}; "
            f"elapsed {self.elapsed_s:,.0f}s"
        )


@dataclass
class GenerationSummary:
    """The outcome of one `generate_dataset` call (counts and spend are this run's; `already_done` earlier runs')."""

    dataset: str
    total_prompts: int
    already_done: int
    requested: int
    completed: int
    failed: int
    errors_by_class: dict[str, int]
    spend_usd: float
    prompt_tokens: int
    completion_tokens: int
    stopped_reason: str | None
    elapsed_s: float
    backend: str
    simulated: bool
    skipped_duplicates: int = 0  # prompts sharing a sample_id (requested once), or duplicate import records
    shards_written: int = 0
    recovered_from_log: int = 0  # answers of an interrupted run found in its answer log (counted in already_done)
    answer_log_s: float | None = None  # the answer log's write interval in this run; None: no log (an import)
    stopped_detail: str | None = None  # what stopped it, with the figures (which budget, its cap, the spend)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def committed_totals(responses: pa.Table, errors: pa.Table) -> dict[str, Any]:
    """Totals of a dataset's committed responses and errors tables: rows, spend, completion tokens, failures by
    class, the provider / source / finish-reason splits, and how regenerated conversations ended (plain values,
    JSON-friendly)."""
    has_rows = responses.num_rows > 0
    ends = responses.column("conversation_end").drop_null() if "conversation_end" in responses.column_names else []
    return {
        "rows": responses.num_rows,
        "spend_usd_total": round(float(pc.sum(responses.column("cost_usd")).as_py() or 0.0), 6) if has_rows else 0.0,
        "completion_tokens_total": int(pc.sum(responses.column("usage_completion_tokens")).as_py() or 0)
        if has_rows
        else 0,
        "errors_total": errors.num_rows,
        "errors_by_class": value_counts(errors.column("error_class")) if errors.num_rows else {},
        "provider_split": value_counts(responses.column("provider"), "unknown") if has_rows else {},
        "source_split": value_counts(responses.column("source")) if has_rows else {},
        "finish_reasons": value_counts(responses.column("finish_reason")) if has_rows else {},
        "conversation_ends": value_counts(ends) if len(ends) else {},  # regenerate: all_turns (turns.END_REASONS)
    }
