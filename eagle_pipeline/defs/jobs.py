"""Jobs and schedules. Dataset jobs run one partition per run: partitioned audit checks need that."""

import dagster as dg
import pyarrow.parquet as pq

from eagle_pipeline.defs.generation import prompts, responses
from eagle_pipeline.defs.hidden_states import hidden_state_plan, hidden_states, trainer_exports
from eagle_pipeline.defs.merge import draft_vocab, merged_dataset
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.defs.tokens import token_samples

dataset_job = dg.define_asset_job(
    "dataset_job",
    selection=dg.AssetSelection.assets(prompts, responses, token_samples),
    # Fourteen audit checks as fourteen processes cost more than the checks themselves; one process per run.
    executor_def=dg.in_process_executor,
    description="Generate, reconstruct and audit one dataset (one partition per run).",
)
merge_job = dg.define_asset_job(
    "merge_job",
    selection=dg.AssetSelection.assets(merged_dataset, draft_vocab, hidden_state_plan),
    description="Merge and shuffle the audited datasets, build the draft vocabulary and plan the extraction.",
)
hidden_states_job = dg.define_asset_job(
    "hidden_states_job",
    selection=dg.AssetSelection.assets(hidden_states),
    description="Extract hidden states for one shard of the merged dataset.",
)
try:  # dagster-k8s is optional (the dev extra; the cluster's code image): without it the location loads without this job
    from dagster_k8s import k8s_job_executor
except ImportError:  # pragma: no cover - exercised only where dagster-k8s is not installed
    k8s_job_executor = None

# The same selection as hidden_states_job, each step in its own Kubernetes Job: the extraction step's pod asks for a
# GPU through the asset's op tags (GPU_OP_TAGS), the three check steps get CPU pods. Needs the K8sRunLauncher (or
# explicit kubeconfig/job_image execution config) only when a run starts, never to load. docs/scaling.md.
hidden_states_k8s_job = (
    dg.define_asset_job(
        "hidden_states_k8s_job",
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
    "exports_job",
    selection=dg.AssetSelection.assets(trainer_exports),
    description="Write the trainer exports once every hidden-state shard is done.",
)


def incomplete_datasets(pipeline: PipelineResource) -> list[str]:
    """Datasets whose committed responses do not yet cover every prompt, or that were never audited."""
    root = pipeline.data_root()
    todo = []
    for ds in pipeline.config().dataset_names:
        prompts_path = root.prompts(ds)
        if not prompts_path.exists() or not root.tokens(ds).exists():
            todo.append(ds)
            continue
        n_prompts = pq.read_metadata(prompts_path).num_rows
        done = sum(pq.read_metadata(p).num_rows for p in root.responses_dir(ds).glob("part-*.parquet"))
        if done < n_prompts:
            todo.append(ds)
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
        return dg.SkipReason("every dataset is complete")
    stamp = context.scheduled_execution_time.strftime("%Y%m%dT%H%M")
    return [dg.RunRequest(run_key=f"{stamp}-{ds}", partition_key=ds) for ds in todo]
