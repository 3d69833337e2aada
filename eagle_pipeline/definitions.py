"""The Dagster code location: `dagster dev -w workspace.yaml` or `dagster definitions validate`."""

from __future__ import annotations

import dagster as dg

from eagle_pipeline.defs.generation import prompts, responses
from eagle_pipeline.defs.hidden_states import hidden_state_checks, hidden_state_plan, hidden_states, trainer_exports
from eagle_pipeline.defs.jobs import (
    dataset_job,
    exports_job,
    hidden_states_job,
    merge_job,
    resume_incomplete_datasets,
    retire_responses_job,
    scale_out_jobs,
)
from eagle_pipeline.defs.merge import (
    draft_vocab,
    merged_dataset,
    merged_loss_mask_aligned,
    merged_row_count_matches_admitted,
    merged_sample_ids_unique,
    merged_spans_end_with_eot,
)
from eagle_pipeline.defs.pools import pool_limits
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.defs.tokens import build_gate_checks, token_samples


def build_defs() -> dg.Definitions:
    return dg.Definitions(
        assets=[
            prompts,
            responses,
            token_samples,
            merged_dataset,
            draft_vocab,
            hidden_state_plan,
            hidden_states,
            trainer_exports,
        ],
        asset_checks=[
            *build_gate_checks(),
            merged_row_count_matches_admitted,
            merged_sample_ids_unique,
            merged_loss_mask_aligned,
            merged_spans_end_with_eot,
            *hidden_state_checks,
        ],
        jobs=[dataset_job, merge_job, hidden_states_job, exports_job, retire_responses_job, *scale_out_jobs],
        schedules=[resume_incomplete_datasets],
        sensors=[pool_limits],
        resources={"pipeline": PipelineResource()},
    )


defs = build_defs()
