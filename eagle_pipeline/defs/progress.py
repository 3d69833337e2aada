"""Live progress in the UI: each progress report of a running step (generation, a hidden-state shard) becomes an
observation of its asset partition and the run's `eagle/progress` tag.

The observation carries the core's figures under the keys the step's final materialization uses for the same
quantities: the UI's metadata table of a partition shows an observation newer than the latest materialization in
place of that materialization's value (with an eye icon), so the partition page shows the live figures while the run
goes on. The tag puts the figures in one line on the run page's header and in the runs list.
"""

from collections.abc import Mapping
from typing import Any

import dagster as dg

from eagle_pipeline.shared.progress import ProgressCallback, WorkProgress, progress_reporter

PROGRESS_TAG = "eagle/progress"


def progress_metadata(figures: Mapping[str, Any]) -> dict[str, Any]:
    """Core figures (plain values) as Dagster metadata: mappings as JSON, numbers and text as they are."""
    return {k: dg.MetadataValue.json(v) if isinstance(v, Mapping) else v for k, v in figures.items()}


def report_progress(context: dg.AssetExecutionContext, figures: Mapping[str, Any], headline: str) -> None:
    """Observe the running step's asset partition with `figures` and set the run's progress tag to `headline`."""
    context.log_event(
        dg.AssetObservation(
            asset_key=context.asset_key,
            partition=context.partition_key if context.has_partition_key else None,
            description=headline,
            metadata=progress_metadata(figures),
        )
    )
    context.instance.add_run_tags(context.run.run_id, {PROGRESS_TAG: headline})


def step_progress(context: dg.AssetExecutionContext, label: str, unit: str, every_s: float) -> ProgressCallback:
    """The core's progress callback for a running step: every `every_s` (and at the end) a log line and
    `report_progress` with the `WorkProgress` figures. A report that cannot be recorded is logged, never raised: the
    engines abort on an exception from their callback."""

    def report(progress: WorkProgress) -> None:
        context.log.info(progress.format())
        try:
            report_progress(context, progress.figures(), progress.headline())
        except Exception as exc:  # an exception here would abort the shard: a report is never worth its work
            context.log.warning(f"{progress.label}: progress not recorded ({exc!r})")

    return progress_reporter(report, label, unit=unit, every_s=every_s)
