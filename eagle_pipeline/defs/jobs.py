"""Jobs and schedules. Dataset jobs run one partition per run: partitioned audit checks need that."""

import dagster as dg

from eagle_pipeline.defs.generation import prompts, responses
from eagle_pipeline.defs.hidden_states import (
    audits_still_current,
    hidden_state_plan,
    hidden_states,
    trainer_exports,
)
from eagle_pipeline.defs.merge import draft_vocab, merged_dataset
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.defs.tokens import audit_overview, token_samples

# Job names start with "EAGLE_" so that they sort before Dagster's implicit "__ASSET_JOB" ('E' < '_'): the UI launches
# a selection made in the asset graph as the first job, in sorted order, that holds every selected asset, so such a
# run carries the project's job name (docs/ui.md, "Job names"). Where two jobs hold an asset, the shorter name sorts
# first: the hidden_states shards launch as EAGLE_hidden_states, not EAGLE_hidden_states_k8s.
dataset_job = dg.define_asset_job(
    "EAGLE_dataset",
    selection=dg.AssetSelection.assets(prompts, responses, token_samples),
    # Three steps as three processes cost more than the steps themselves on a small dataset; one process per run.
    executor_def=dg.in_process_executor,
    description="Generate, reconstruct and audit one dataset (one partition per run).",
)
audit_view_job = dg.define_asset_job(
    "EAGLE_audit_view",
    selection=dg.AssetSelection.assets(audit_overview),
    description=(
        "Refresh the audit view (audit_overview): every dataset's fit-to-merge verdict. The audit_view sensor "
        "refreshes it by itself after each audit; `make demo` runs this job."
    ),
)
merge_job = dg.define_asset_job(
    "EAGLE_merge",
    selection=dg.AssetSelection.assets(merged_dataset, draft_vocab, hidden_state_plan),
    description="Merge and shuffle the audited datasets, build the draft vocabulary and plan the extraction.",
)
hidden_states_job = dg.define_asset_job(
    "EAGLE_hidden_states",
    selection=dg.AssetSelection.assets(hidden_states),
    description="Extract hidden states for one shard of the merged dataset.",
)
try:  # dagster-k8s is optional (the dev extra; the cluster's code image): without it the location loads without this job
    from dagster_k8s import k8s_job_executor as _k8s_executor

    k8s_job_executor: dg.ExecutorDefinition | None = _k8s_executor
except ImportError:  # pragma: no cover - exercised only where dagster-k8s is not installed
    k8s_job_executor = None

# The same selection as EAGLE_hidden_states, each step in its own Kubernetes Job: the extraction step's pod asks for a
# GPU through the asset's op tags (GPU_OP_TAGS), the three check steps get CPU pods. Needs the K8sRunLauncher (or
# explicit kubeconfig/job_image execution config) only when a run starts, never to load. docs/scaling.md.
hidden_states_k8s_job = (
    dg.define_asset_job(
        "EAGLE_hidden_states_k8s",
        selection=dg.AssetSelection.assets(hidden_states),
        executor_def=k8s_job_executor,
        description="Extract one hidden-state shard on a Kubernetes GPU node (one pod per step; k8s_job_executor).",
    )
    if k8s_job_executor is not None
    else None
)
# Jobs that exist only where their executor's library is installed; definitions.py adds them.
scale_out_jobs = [j for j in (hidden_states_k8s_job,) if j is not None]

exports_job = dg.define_asset_job(
    "EAGLE_exports",
    selection=dg.AssetSelection.assets(trainer_exports),
    description="Write the trainer exports once every hidden-state shard is done.",
)

export_freshness_job = dg.define_asset_job(
    "EAGLE_exports_freshness",
    selection=dg.AssetSelection.checks(audits_still_current),
    description="Judge the trainer exports on disk again: are the dataset audits they were built from still current? "
    "(the demo runs it after a refused audit, so the UI marks a stale export).",
)


def incomplete_datasets(pipeline: PipelineResource) -> dict[str, str]:
    """Datasets that need a run, each with the reason (coverage.resume_reason), judged by the sample ids of the
    prompts the configuration asks for now, so a changed limit or seed counts as incomplete."""
    from eagle_pipeline.generation.store.coverage import resume_reason
    from eagle_pipeline.prompts import PromptFileError, dataset_prompts_table

    cfg = pipeline.config()
    root = pipeline.data_root()
    todo = {}
    for name in cfg.dataset_names:
        ds = cfg.datasets[name]
        # A dataset whose prompts cannot be read is launched too: its run fails with the problem, the others go on.
        reason = cfg.prompts_problem(name)
        if reason is None:
            try:
                ids = dataset_prompts_table(ds).column("sample_id").to_pylist()
            except PromptFileError as exc:
                reason = str(exc)
            else:
                reason = resume_reason(
                    name, ids, root.responses_dir(name), root.tokens(name), pipeline.backend_identity(name)
                )
        if reason is not None:
            todo[name] = reason
    return todo


@dg.schedule(
    cron_schedule="0 */6 * * *",
    job=dataset_job,
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Every 6 hours: resume generation, reconstruction and audit for datasets that are not yet complete.",
)
def resume_incomplete_datasets(context: dg.ScheduleEvaluationContext, pipeline: PipelineResource):
    todo = incomplete_datasets(pipeline)
    if not todo:
        return dg.SkipReason(
            "every dataset is complete: each current prompt has a committed response and audited tokens"
        )
    # The reason travels as a tag (shown by the UI's dry run and on the run), not in the tick's log: context.log
    # opens an instance the caller's context manager must close.
    stamp = context.scheduled_execution_time.strftime("%Y%m%dT%H%M")
    return [
        dg.RunRequest(run_key=f"{stamp}-{ds}", partition_key=ds, tags={"eagle/resume_reason": reason[:200]})
        for ds, reason in todo.items()
    ]


class RetireResponsesConfig(dg.Config):
    """Which committed responses of one dataset to retire; no backend and no provider retires them all."""

    dataset: str
    backend: str | None = None
    provider: str | None = None


@dg.op(description="Archive a dataset's committed responses (all, or one backend's / provider's); spend stays counted.")
def retire_responses_op(
    context: dg.OpExecutionContext, config: RetireResponsesConfig, pipeline: PipelineResource
) -> dict:
    from eagle_pipeline.generation.store.retire import retire_responses

    summary = retire_responses(
        pipeline.data_root().responses_dir(config.dataset),
        dataset=config.dataset,
        backend=config.backend,
        provider=config.provider,
    )
    context.log.info(summary.describe())
    context.add_output_metadata({"summary": dg.MetadataValue.json(summary.to_dict())})
    return summary.to_dict()


@dg.job(
    name="EAGLE_retire_responses",
    description=(
        "Retire a dataset's committed responses into responses/<dataset>/retired/<stamp>/ (docs/generation.md). "
        "Then rerun EAGLE_dataset to request the retired prompts again."
    ),
)
def retire_responses_job():
    retire_responses_op()
