"""Hidden-state extraction: the plan (CPU, first), the shards (GPU pool), their checks, and trainer exports."""

import os
import socket
from typing import Any

import dagster as dg

from eagle_pipeline.defs.automation import after_checks_pass
from eagle_pipeline.defs.merge import draft_vocab, merged_dataset
from eagle_pipeline.defs.metadata import readable
from eagle_pipeline.defs.partitions import shard_partitions
from eagle_pipeline.defs.progress import step_progress
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.hidden_states.checks.registry import SHARD_CHECKS, ShardCheckContext
from eagle_pipeline.shared.checks import CheckResult, CheckSpec

# Scale-out: with the k8s_job_executor each shard step runs in its own pod with this GPU request (docs/scaling.md).
GPU_OP_TAGS = {
    "dagster-k8s/config": {
        "container_config": {"resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}},
        "pod_spec_config": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    }
}


@dg.asset(
    deps=[merged_dataset],
    group_name="hidden_states",
    automation_condition=after_checks_pass,
    kinds={"json"},
    owners=["team:ml"],
    description=(
        "Before any GPU time: bytes on disk and GPU-hours of extraction for the target model over the merged tokens, "
        "with the assumptions shown, under the configured engine. Refused when the engine cannot hold the weights; "
        "extraction refuses to start when this run's plan exceeds the disk budget."
    ),
)
def hidden_state_plan(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.plan.run_plan import PlanRefused
    from eagle_pipeline.hidden_states.run import plan_run

    cfg = pipeline.config()
    try:
        plans = plan_run(
            cfg.hidden_states,
            ExtractionPaths.of(pipeline.data_root()),
            target_model_config=cfg.target.model_config,
            vocab_size=pipeline.tokenizer().vocab_size,
            shard_runs=cfg.pools.gpu,
        )
    except PlanRefused as exc:
        raise dg.Failure(f"Extraction plan refused: {exc}", allow_retries=False) from None
    target, this_run = plans["target"], plans["this_run"]
    return dg.MaterializeResult(
        metadata={
            "target_plan": dg.MetadataValue.md(target.to_markdown()),
            "this_run_plan": dg.MetadataValue.md(this_run.to_markdown()),
            "target_bytes_on_disk": int(target.bytes_on_disk),
            "target_gpu_hours": round(float(target.gpu_hours), 2),
            "this_run_bytes_on_disk": int(this_run.bytes_on_disk),
            "exceeds_disk_budget": bool(this_run.exceeds_budget),
        }
    )


@dg.asset(
    partitions_def=shard_partitions,
    deps=[merged_dataset, hidden_state_plan],
    group_name="hidden_states",
    automation_condition=after_checks_pass,
    kinds={"safetensors", "pytorch"},
    owners=["team:ml"],
    pool="gpu",
    op_tags=GPU_OP_TAGS,
    backfill_policy=dg.BackfillPolicy.multi_run(1),
    description=(
        "EAGLE-3 training states for one shard of the merged dataset: auxiliary layers (low/mid/high) concatenated "
        "to [T, 3H] and the final hidden state, one safetensors file per shard keyed by sample_id, plus an index."
    ),
)
def hidden_states(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.plan.disk_plan import PLAN_FILE, DiskBudgetExceeded
    from eagle_pipeline.hidden_states.run import run_shard
    from eagle_pipeline.hidden_states.store.shards import ShardMismatchError

    paths = ExtractionPaths.of(pipeline.data_root())
    h = pipeline.config().hidden_states
    shard = int(context.partition_key)
    if not (paths.out_dir / PLAN_FILE).exists():  # the shard run's disk check is made against it
        raise dg.Failure(
            f"No extraction plan at {paths.out_dir / PLAN_FILE}: materialize hidden_state_plan first.",
            allow_retries=False,
        )
    try:
        run = run_shard(
            h,
            paths,
            shard,
            vocab_size=pipeline.tokenizer().vocab_size,
            progress=step_progress(context, f"shard {shard:05d}", "rows", h.progress_every_s),
            log=context.log.info,
        )
    except ShardMismatchError as exc:
        raise dg.Failure(
            str(exc),
            metadata={"differences": dg.MetadataValue.json({k: list(v) for k, v in exc.differences.items()})},
            allow_retries=False,
        ) from exc
    except DiskBudgetExceeded as exc:  # the disk check of a shard to extract (`disk_plan.check_disk_for_run`)
        raise dg.Failure(
            str(exc),
            metadata={
                "planned_bytes": exc.planned_bytes,
                "budget_bytes": exc.budget_bytes,
                "plan": dg.MetadataValue.json(exc.plan),
            },
            allow_retries=False,
        ) from exc
    summary = run.summary
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": summary.rows,
            "path": dg.MetadataValue.path(summary.path),
            "tokens": summary.tokens,
            "padding_fraction": readable(summary.padding_fraction),
            "tokens_per_s": readable(summary.tokens_per_s),
            "device": run.device,
            "model": h.model,
            "engine": h.engine,
            "layout": h.layout,
            "fingerprint": dg.MetadataValue.json(summary.fingerprint),
            "skipped_already_done": summary.skipped,
            "shard_status_before": run.status_before,
            "host": socket.gethostname(),  # the pod's name on Kubernetes
            "pid": os.getpid(),
        }
    )


def _shard_check(spec: CheckSpec[ShardCheckContext]) -> dg.AssetChecksDefinition:
    """One blocking check per shard for one entry of the core's registry (`hidden_states.checks.SHARD_CHECKS`)."""

    @dg.asset_check(
        asset=hidden_states,
        name=spec.name,
        blocking=True,
        partitions_def=shard_partitions,
        description=spec.description,
    )
    def _check(context: dg.AssetCheckExecutionContext, pipeline: PipelineResource) -> dg.AssetCheckResult:
        from eagle_pipeline.hidden_states.checks.audit import AuditCheck
        from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths

        paths, shard = ExtractionPaths.of(pipeline.data_root()), context.partition_key
        result = spec.run(ShardCheckContext(pipeline.config().hidden_states, paths, int(shard)))
        if isinstance(result, AuditCheck):
            metadata = _audit_metadata(shard, result)
        else:
            metadata = _check_counts(shard, result)
        return dg.AssetCheckResult(passed=bool(result.passed), description=result.detail or None, metadata=metadata)

    return _check


def _check_counts(shard: str, result: CheckResult) -> dict[str, Any]:
    # The numbers carry the shard in their key: Dagster plots a check's numeric metadata over time across all
    # partitions, so a key shared by every shard would draw them all as one line (token_samples' checks do the same).
    return {
        "shard": shard,
        f"shard {shard}: samples checked": result.checked,
        f"shard {shard}: samples failing": result.failing,
        "failing_sample_ids": dg.MetadataValue.json(list(result.failing_sample_ids)[:10]),
    }


def _audit_metadata(shard: str, result: Any) -> dict[str, Any]:
    """A semantic check's verdict, counts and figures; the teacher check's agreement per dataset as a table."""
    metadata: dict[str, Any] = {
        "verdict": result.verdict,
        **_check_counts(shard, result),
        "figures": dg.MetadataValue.json(result.metrics),
    }
    if result.name == "teacher_agreement" and result.metrics.get("top1_agreement") is not None:
        metadata[f"shard {shard}: top-1 agreement"] = readable(result.metrics["top1_agreement"])
        rows = "".join(
            f"| {ds} | {d['agreement']:.3f} | {d['positions']} |\n" for ds, d in result.metrics["per_dataset"].items()
        )
        metadata["per_dataset"] = dg.MetadataValue.md(
            f"| dataset | top-1 agreement | positions |\n|---|---|---|\n{rows}"
        )
    return metadata


hidden_state_checks = [_shard_check(spec) for spec in SHARD_CHECKS]


@dg.asset(
    deps=[merged_dataset, draft_vocab, hidden_states],
    group_name="exports",
    automation_condition=after_checks_pass,
    kinds={"parquet", "json"},
    owners=["team:ml"],
    description=(
        "Trainer-ready exports: SpecForge offline features (exports/specforge/{train,eval}/*.ckpt, post-norm) and "
        "pre-tokenized JSONL, speculators' offline data dir (exports/speculators: Arrow dataset + hs_{i}.safetensors, "
        "pre-norm), HF-datasets Parquet; refuses to start until every shard is done."
    ),
)
def trainer_exports(pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.hidden_states.checks.stored_audits import audit_markdown
    from eagle_pipeline.hidden_states.run import export_for_trainers
    from eagle_pipeline.hidden_states.store.shards import ShardsNotReadyError

    root = pipeline.data_root()
    cfg = pipeline.config()
    try:
        done = export_for_trainers(
            cfg.hidden_states, root, vocab_size=pipeline.tokenizer().vocab_size, config_hash=cfg.config_hash()
        )
    except ShardsNotReadyError as exc:
        raise dg.Failure(
            str(exc),
            metadata={"shards": dg.MetadataValue.json({f"{s.shard_index:05d}": s.status for s in exc.states})},
        ) from exc
    exported = done.exported
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(root.exports_dir)),
            "specforge_rows": dg.MetadataValue.json(done.specforge_jsonl.rows),
            "hf_parquet_rows": dg.MetadataValue.json(done.hf_parquet.rows),
            **{f"{name}_rows": dg.MetadataValue.json(e.rows) for name, e in exported.items()},
            **(
                {"speculators_args": str(exported["speculators_offline"].extra["args"])}
                if "speculators_offline" in exported
                else {}
            ),
            "state_bytes_written": sum(e.bytes_written for e in exported.values()),
            "hidden_state_audit": dg.MetadataValue.md(audit_markdown(done.manifest["hidden_state_audit"])),
            "hidden_state_shards": len(done.shard_keys),
        }
    )


@dg.asset_check(
    asset=trainer_exports,
    name="audits_still_current",
    blocking=True,  # as every check of the project; nothing is downstream of the exports: it marks the asset
    description=(
        "The dataset audits the exports were built from (their manifest's dataset_audits) are still the current "
        "ones: fails, naming each dataset, once a later run rebuilt a dataset's token samples or its audit fails."
    ),
)
def audits_still_current(pipeline: PipelineResource) -> dg.AssetCheckResult:
    from eagle_pipeline.hidden_states.checks.drafter_check import stale_export_problems

    exports = pipeline.data_root().exports_dir
    problems = stale_export_problems(exports)
    return dg.AssetCheckResult(
        passed=not problems,
        description=problems[0] if problems else "built from the current audit of every merged dataset",
        metadata={"export": dg.MetadataValue.path(str(exports)), "stale": bool(problems)},
    )


@dg.asset_check(
    asset=trainer_exports,
    name="draft_config_matches",
    blocking=True,
    description=(
        "hidden_states.draft_config (a draft JSON or trainer flag file) reads exactly the captured layers, in its "
        "trainer's convention, at the captured width: neither trainer checks this itself (docs/drafters.md)."
    ),
)
def draft_config_matches(pipeline: PipelineResource) -> dg.AssetCheckResult:
    from eagle_pipeline.hidden_states.checks.drafter_check import check_drafter

    draft = pipeline.config().hidden_states.draft_config
    if draft is None:
        return dg.AssetCheckResult(
            passed=True, description="Not judged: no hidden_states.draft_config.", metadata={"judged": False}
        )
    try:
        result = check_drafter(pipeline.data_root().exports_dir, draft)
    except (OSError, ValueError) as exc:  # no export of the draft config's trainer, an unreadable file
        return dg.AssetCheckResult(passed=False, description=str(exc), metadata={"judged": True})
    return dg.AssetCheckResult(
        passed=result.passed,
        description=result.describe(),
        metadata={
            "judged": True,
            "export": dg.MetadataValue.path(result.export_dir),
            "draft_config": dg.MetadataValue.path(str(draft)),
            "problems": dg.MetadataValue.json(result.problems),
        },
    )
