"""Hidden-state extraction: the plan (CPU, first), the shards (GPU pool), their checks, and trainer exports."""

import os
import socket
from pathlib import Path
from typing import Any

import dagster as dg

from eagle_pipeline.defs.automation import after_checks_pass
from eagle_pipeline.defs.merge import draft_vocab, merged_dataset
from eagle_pipeline.defs.partitions import shard_partitions
from eagle_pipeline.defs.progress import step_progress
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.storage import write_json_atomic

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
    from eagle_pipeline.hidden_states.runtime import PlanRefused, plan_for_config
    from eagle_pipeline.merge import MergeManifest

    cfg = pipeline.config()
    root = pipeline.data_root()
    manifest = MergeManifest.read(root.merged_dir)
    try:
        plans = plan_for_config(
            cfg,
            n_tokens=manifest.tokens_total,
            n_samples=manifest.rows_total,
            vocab_size=pipeline.tokenizer().vocab_size,
        )
    except PlanRefused as exc:
        raise dg.Failure(f"Extraction plan refused: {exc}", allow_retries=False) from None
    write_json_atomic({k: p.to_dict() for k, p in plans.items()}, root.hidden_states_dir / "plan.json")
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
    from eagle_pipeline.hidden_states import extract_shard
    from eagle_pipeline.hidden_states.runtime import MODEL_CACHE, fingerprint_for_config, shard_device
    from eagle_pipeline.hidden_states.shards import ShardMismatchError, prepare_shard

    root = pipeline.data_root()
    h = pipeline.config().hidden_states
    _check_disk_budget(root.hidden_states_dir / "plan.json", h.disk_budget_gb)
    shard = int(context.partition_key)
    vocab = pipeline.tokenizer().vocab_size
    wanted = fingerprint_for_config(h, merged_dir=root.merged_dir, vocab_size=vocab)
    # Deciding before the model loads spares minutes of loading a large target just to skip a done shard.
    try:
        decision = prepare_shard(root.hidden_states_dir, shard, wanted, on_mismatch=h.on_settings_change)
    except ShardMismatchError as exc:
        raise dg.Failure(
            str(exc),
            metadata={"differences": dg.MetadataValue.json({k: list(v) for k, v in exc.differences.items()})},
            allow_retries=False,
        ) from exc
    if decision.reuse is not None:
        summary, device = decision.reuse, "none (already done)"
    elif h.engine == "vllm":  # HTTP clients of running vLLM servers: no GPU, no model load here
        from eagle_pipeline.hidden_states.vllm_command import extract_shard_from_config

        summary, device = extract_shard_from_config(
            h,
            merged_dir=root.merged_dir,
            out_dir=root.hidden_states_dir,
            shard_index=shard,
            vocab_size=vocab,
            log=context.log.info,
            progress=step_progress(context, f"shard {shard:05d}", "rows", h.progress_every_s),
        )
    elif h.engine == "torchrun":  # one torchrun world of tp_size processes, started by this step
        from eagle_pipeline.hidden_states.engine_torchrun import extract_shard_from_config as extract_torchrun

        summary, device = extract_torchrun(
            h,
            merged_dir=root.merged_dir,
            out_dir=root.hidden_states_dir,
            shard_index=shard,
            vocab_size=vocab,
            model_identity=wanted.model,
            log=context.log.info,
        )
    else:
        from eagle_pipeline.hidden_states.trainer_layouts import plan_layout_target

        # A trainer's layout: the states go straight into its export folder, in its final-state convention.
        target = plan_layout_target(h.layout, root.exports_dir / h.layout, root.merged_dir)
        with shard_device(h.device, shard, prefer=MODEL_CACHE.devices(), log=context.log.info) as device:
            summary = extract_shard(
                MODEL_CACHE.get(h.model, h.family, h.seed, vocab, device),
                root.merged_dir,
                shard_index=shard,
                shard_size=h.shard_size,
                out_dir=root.hidden_states_dir,
                aux_layers=h.aux_layers,
                max_tokens_per_batch=h.max_tokens_per_batch,
                device=device,
                on_mismatch=h.on_settings_change,
                model_identity=wanted.model,
                progress=step_progress(context, f"shard {shard:05d}", "rows", h.progress_every_s),
                final_state=wanted.final_state,
                layout_target=target,
            )
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": summary.rows,
            "path": dg.MetadataValue.path(summary.path),
            "tokens": summary.tokens,
            "padding_fraction": float(summary.padding_fraction),
            "tokens_per_s": float(summary.tokens_per_s),
            "device": device,
            "model": h.model,
            "engine": h.engine,
            "layout": h.layout,
            "fingerprint": dg.MetadataValue.json(summary.fingerprint),
            "skipped_already_done": summary.skipped,
            "shard_status_before": decision.state.status,
            "host": socket.gethostname(),  # the pod's name on Kubernetes
            "pid": os.getpid(),
        }
    )


def _check_disk_budget(plan_path: Path, disk_budget_gb: float | None) -> None:
    """`check_disk_budget` as a non-retryable Failure with the planned bytes and the budget as metadata."""
    from eagle_pipeline.hidden_states.plan import DiskBudgetExceeded, check_disk_budget

    try:
        check_disk_budget(plan_path, disk_budget_gb)
    except FileNotFoundError as exc:
        raise dg.Failure(str(exc), allow_retries=False) from exc
    except DiskBudgetExceeded as exc:
        raise dg.Failure(
            str(exc),
            metadata={
                "planned_bytes": exc.planned_bytes,
                "budget_bytes": exc.budget_bytes,
                "plan": dg.MetadataValue.json(exc.plan),
            },
            allow_retries=False,
        ) from exc


def _shard_check(name: str, verify_key: str, description: str):
    @dg.asset_check(
        asset=hidden_states, name=name, blocking=True, partitions_def=shard_partitions, description=description
    )
    def _check(context: dg.AssetCheckExecutionContext, pipeline: PipelineResource) -> dg.AssetCheckResult:
        from eagle_pipeline.hidden_states import verify_shard

        root = pipeline.data_root()
        result = verify_shard(root.hidden_states_dir, int(context.partition_key), root.merged_dir)[verify_key]
        return dg.AssetCheckResult(
            passed=bool(result.passed),
            description=result.detail or None,
            metadata={
                "samples_checked": result.checked,
                "samples_failing": result.failing,
                "failing_sample_ids": dg.MetadataValue.json(list(result.failing_sample_ids)[:10]),
            },
        )

    return _check


hidden_state_checks = [
    _shard_check(
        "shapes_match_token_counts", "shapes", "Per sample, every state tensor has one row per token, width 3H / H."
    ),
    _shard_check(
        "no_nan_or_inf", "finite", "No NaN or Inf in any state: a bad sample fails the shard, never skipped silently."
    ),
    _shard_check(
        "ids_match_merged", "ids_match", "Stored input ids equal the merged dataset's ids for the same sample_id."
    ),
]


def _shard_audit(pipeline: PipelineResource, shard: int) -> dict:
    """The semantic audit of one shard (computed once, shared by its four checks; see hidden_states/audit.py)."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.audit import audit_shard_cached, teacher_judgement
    from eagle_pipeline.hidden_states.merged import merged_parts
    from eagle_pipeline.hidden_states.runtime import resolve_device

    root = pipeline.data_root()
    h = pipeline.config().hidden_states
    sources = {
        s for p in merged_parts(root.merged_dir) for s in pq.read_table(p, columns=["source"])["source"].to_pylist()
    }
    judgement = teacher_judgement(
        extraction_model=h.model,
        sources=sorted(sources, key=str),
        texts_by_extraction_model=h.texts_by_extraction_model,
    )
    settings: dict[str, Any] = {"expected_aux_layers": h.aux_layers, "judgement": judgement}
    if h.teacher_min_top1 is not None:
        settings["min_top1"] = h.teacher_min_top1
    return audit_shard_cached(
        root.hidden_states_dir, shard, root.merged_dir, device=resolve_device(h.device), **settings
    )


def _audit_check(name: str, audit_key: str, description: str):
    @dg.asset_check(
        asset=hidden_states, name=name, blocking=True, partitions_def=shard_partitions, description=description
    )
    def _check(context: dg.AssetCheckExecutionContext, pipeline: PipelineResource) -> dg.AssetCheckResult:
        result = _shard_audit(pipeline, int(context.partition_key))[audit_key]
        metadata: dict[str, Any] = {
            "verdict": result.verdict,
            "samples_checked": result.checked,
            "samples_failing": result.failing,
            "failing_sample_ids": dg.MetadataValue.json(list(result.failing_sample_ids)[:10]),
            "figures": dg.MetadataValue.json(result.metrics),
        }
        if audit_key == "teacher_agreement" and result.metrics.get("top1_agreement") is not None:
            metadata["top1_agreement"] = float(result.metrics["top1_agreement"])
            rows = "".join(
                f"| {ds} | {d['agreement']:.3f} | {d['positions']} |\n"
                for ds, d in result.metrics["per_dataset"].items()
            )
            metadata["per_dataset"] = dg.MetadataValue.md(
                f"| dataset | top-1 agreement | positions |\n|---|---|---|\n{rows}"
            )
        return dg.AssetCheckResult(passed=bool(result.passed), description=result.detail or None, metadata=metadata)

    return _check


hidden_state_checks += [
    _audit_check(
        "states_not_degenerate",
        "degenerate_states",
        "No all-zero or constant position in any layer, no layer that holds one vector at every position.",
    ),
    _audit_check(
        "layers_as_configured",
        "layer_layout",
        "Aux layers are the configured ones in the configured order, T = the merged row's tokens, no two stored "
        "layers identical (a wrong layer id).",
    ),
    _audit_check(
        "norm_convention_matches_states",
        "norm_convention",
        "The recorded final-state convention (pre/post final norm) agrees with the states' RMS statistics.",
    ),
    _audit_check(
        "teacher_agreement",
        "teacher_agreement",
        "lm_head(final_norm(final state)) predicts the next supervised token as top-1 at least "
        "hidden_states.teacher_min_top1 of the time; says NOT JUDGED when the texts were not written by the "
        "extraction model.",
    ),
]


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
    from eagle_pipeline.hidden_states.audit import audit_markdown, summarize_audits
    from eagle_pipeline.hidden_states.runtime import fingerprint_for_config
    from eagle_pipeline.hidden_states.shards import ShardsNotReadyError, require_shards_ready
    from eagle_pipeline.hidden_states.trainer_exports import export_specforge_states, export_speculators_states
    from eagle_pipeline.merge import export_hf_parquet, export_specforge_jsonl

    root = pipeline.data_root()
    cfg = pipeline.config()
    out = root.exports_dir
    # Every shard is checked before anything is written: a refused export leaves the previous one whole. The dtype
    # is left open because this step may run on another host than the extraction (a CPU pod after GPU pods).
    wanted = fingerprint_for_config(
        cfg.hidden_states, merged_dir=root.merged_dir, vocab_size=pipeline.tokenizer().vocab_size, pin_dtype=False
    )
    try:
        states = require_shards_ready(root.hidden_states_dir, root.merged_dir, wanted)
    except ShardsNotReadyError as exc:
        raise dg.Failure(
            str(exc),
            metadata={"shards": dg.MetadataValue.json({f"{s.shard_index:05d}": s.status for s in exc.states})},
        ) from exc
    shard_keys = [f"{s.shard_index:05d}" for s in states]
    spec = export_specforge_jsonl(root.merged_dir, out / "specforge" / "train.jsonl", split="train")
    hf = export_hf_parquet(root.merged_dir, out / "hf_parquet")
    # The layout extraction wrote directly is always completed (its small files); others are converted copies.
    layouts = set(cfg.hidden_states.trainer_layouts) | ({cfg.hidden_states.layout} - {"shards"})
    exported: dict[str, Any] = {}
    # Copied beside the states when built (the draft_vocab asset); the export's summary records where it is, or None.
    vocab_pt = root.draft_vocab_dir / "draft_vocab.pt"
    if "specforge" in layouts:
        exported["specforge_offline"] = export_specforge_states(
            root.hidden_states_dir,
            root.merged_dir,
            out / "specforge",
            draft_vocab_pt=vocab_pt if vocab_pt.exists() else None,
            drafters=cfg.hidden_states.drafters,
            layout=cfg.hidden_states.layout,
        )
    if "speculators" in layouts:
        exported["speculators_offline"] = export_speculators_states(
            root.hidden_states_dir,
            root.merged_dir,
            out / "speculators",
            draft_vocab_dir=root.draft_vocab_dir if vocab_pt.exists() else None,
            drafters=cfg.hidden_states.drafters,
            verifier=cfg.hidden_states.model if cfg.hidden_states.model != "tiny-random" else None,
        )
    manifest = {
        "specforge_jsonl": spec.to_dict(),
        "hf_parquet": hf.to_dict(),
        **{name: e.to_dict() for name, e in exported.items()},
        "hidden_state_audit": summarize_audits(root.hidden_states_dir),
        "hidden_states_dir": str(root.hidden_states_dir),
        "hidden_state_shards": shard_keys,
        "draft_vocab_dir": str(root.draft_vocab_dir),
        "config_hash": cfg.config_hash(),
    }
    write_json_atomic(manifest, out / "manifest.json")
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(out)),
            "specforge_rows": dg.MetadataValue.json(spec.rows),
            "hf_parquet_rows": dg.MetadataValue.json(hf.rows),
            **{f"{name}_rows": dg.MetadataValue.json(e.rows) for name, e in exported.items()},
            **(
                {"speculators_args": str(exported["speculators_offline"].extra["args"])}
                if "speculators_offline" in exported
                else {}
            ),
            "state_bytes_written": sum(e.bytes_written for e in exported.values()),
            "hidden_state_audit": dg.MetadataValue.md(audit_markdown(manifest["hidden_state_audit"])),
            "hidden_state_shards": len(shard_keys),
        }
    )


@dg.asset_check(
    asset=trainer_exports,
    name="draft_config_matches_capture",
    blocking=True,
    description=(
        "hidden_states.draft_config (a draft JSON or trainer flag file) reads exactly the captured layers, in its "
        "trainer's convention, at the captured width: neither trainer checks this itself (docs/drafters.md)."
    ),
)
def draft_config_matches_capture(pipeline: PipelineResource) -> dg.AssetCheckResult:
    from eagle_pipeline.hidden_states.drafter_check import check_drafter

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
