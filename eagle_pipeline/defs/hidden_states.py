"""Hidden-state extraction: the plan (CPU, first), the shards (GPU pool), their checks, and trainer exports."""

import os
import socket
import threading
import warnings
from typing import Any

import dagster as dg

from eagle_pipeline.defs.automation import after_checks_pass
from eagle_pipeline.defs.merge import draft_vocab, merged_dataset
from eagle_pipeline.defs.partitions import shard_partitions
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.progress import progress_reporter
from eagle_pipeline.storage import read_json, write_json_atomic

warnings.filterwarnings("ignore", category=dg.PreviewWarning)
warnings.filterwarnings("ignore", category=dg.BetaWarning)

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
        "with the assumptions shown. Extraction refuses to start when this run's plan exceeds the disk budget."
    ),
)
def hidden_state_plan(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.hidden_states.runtime import plan_for_run
    from eagle_pipeline.merge import MergeManifest

    cfg = pipeline.config()
    root = pipeline.data_root()
    manifest = MergeManifest.read(root.merged_dir)
    plans = plan_for_run(
        n_tokens=manifest.tokens_total,
        n_samples=manifest.rows_total,
        target_model_config=cfg.target.model_config,
        extraction_model=cfg.hidden_states.model,
        extraction_family=cfg.hidden_states.family,
        vocab_size=pipeline.tokenizer().vocab_size,
        aux_layers=cfg.hidden_states.aux_layers,
        shard_size=cfg.hidden_states.shard_size,
        disk_budget_gb=cfg.hidden_states.disk_budget_gb,
    )
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


_MAX_MODELS = 2
_MODELS: dict[tuple, Any] = {}  # (model, family, seed, vocab_size, device) -> model, least recently used first
_MODELS_LOCK = threading.Lock()
_INHERITED: list[dict] = []  # a forked child's copies of its parent's models: never used, never freed


def _forget_parent_models() -> None:
    # CUDA state does not survive fork: a child must load its own model. Its copies of the parent's stay referenced
    # so that no tensor destructor runs against the parent's device memory; a lock held by another parent thread
    # at fork time would never be released in the child, so the child gets a new one.
    global _MODELS, _MODELS_LOCK
    _INHERITED.append(_MODELS)
    _MODELS, _MODELS_LOCK = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_models)


def _cached_devices() -> list[str]:
    """Devices this process holds an extraction model on, most recently used first."""
    return [key[-1] for key in reversed(list(_MODELS))]


def _model_cached(model: str, family: str, seed: int, vocab_size: int, device: str):
    """The extraction model, loaded once per (configuration, device) per process, so consecutive shards in one
    process (in-process executor, `execute_in_process`) skip the load. Spawned step processes (the multiprocess
    executor's default) start empty; forked ones drop what they inherited; the lock stops threads loading twice."""
    from eagle_pipeline.hidden_states.runtime import load_extraction_model

    key = (model, family, seed, vocab_size, device)
    with _MODELS_LOCK:
        if key in _MODELS:
            _MODELS[key] = _MODELS.pop(key)
            return _MODELS[key]
        while len(_MODELS) >= _MAX_MODELS:
            del _MODELS[next(iter(_MODELS))]
        _MODELS[key] = load_extraction_model(model, family=family, seed=seed, vocab_size=vocab_size, device=device)
        return _MODELS[key]


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
    from eagle_pipeline.hidden_states import ShardSummary, extract_shard, shard_paths, shard_status
    from eagle_pipeline.hidden_states.format import read_index_meta
    from eagle_pipeline.hidden_states.runtime import shard_device

    cfg = pipeline.config()
    root = pipeline.data_root()
    h = cfg.hidden_states
    _refuse_over_budget(root.hidden_states_dir / "plan.json", h.disk_budget_gb)
    shard = int(context.partition_key)
    # Hashing a done shard here (extract_shard would hash it anyway) spares loading the model, minutes for a large
    # target, just to skip it; and it tells what a rerun found.
    before = shard_status(root.hidden_states_dir, shard)
    if before == "done":
        summary = ShardSummary(
            **{**read_index_meta(shard_paths(root.hidden_states_dir, shard)[1])["summary"], "skipped": True}
        )
        device = "none (already done)"
    else:
        with shard_device(h.device, shard, prefer=_cached_devices(), log=context.log.info) as device:
            model = _model_cached(h.model, h.family, h.seed, pipeline.tokenizer().vocab_size, device)
            summary = extract_shard(
                model,
                root.merged_dir,
                shard_index=shard,
                shard_size=h.shard_size,
                out_dir=root.hidden_states_dir,
                aux_layers=h.aux_layers,
                max_tokens_per_batch=h.max_tokens_per_batch,
                device=device,
                progress=progress_reporter(context.log.info, f"shard {shard:05d}", unit="samples"),
            )
    s = summary.to_dict()
    skipped = bool(s.get("skipped", False))
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": int(s["rows"]),
            "path": dg.MetadataValue.path(str(s["path"])),
            "tokens": int(s["tokens"]),
            "padding_fraction": float(s["padding_fraction"]),
            "tokens_per_s": float(s["tokens_per_s"]),
            "device": device,
            "model": h.model,
            "skipped_already_done": skipped,
            "shard_status_before": before,
            "host": socket.gethostname(),  # the pod's name on Kubernetes
            "pid": os.getpid(),
        }
    )


def _refuse_over_budget(plan_path, disk_budget_gb: float | None) -> None:
    """Raise a non-retryable Failure when this run's planned bytes exceed the disk budget in force now.

    The budget is read from the current configuration, not from plan.json, so lowering it takes effect without
    replanning.
    """
    if not plan_path.exists():
        raise dg.Failure(
            f"No extraction plan at {plan_path}: materialize hidden_state_plan first.", allow_retries=False
        )
    plan = read_json(plan_path)["this_run"]
    planned = int(plan["bytes_on_disk"])
    if disk_budget_gb is None or planned <= disk_budget_gb * 1e9:
        return
    raise dg.Failure(
        f"Extraction refused: this run's plan needs {planned:,} bytes ({planned / 1e9:.3g} GB) on disk, over the "
        f"budget of {int(disk_budget_gb * 1e9):,} bytes ({disk_budget_gb:g} GB, hidden_states.disk_budget_gb). "
        "Raise the budget, shrink the merged dataset, or extract fewer layers.",
        metadata={
            "planned_bytes": planned,
            "budget_bytes": int(disk_budget_gb * 1e9),
            "plan": dg.MetadataValue.json(plan),
        },
        allow_retries=False,
    )


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


@dg.asset(
    deps=[merged_dataset, draft_vocab, hidden_states],
    group_name="exports",
    automation_condition=after_checks_pass,
    kinds={"parquet", "json"},
    owners=["team:ml"],
    description="Trainer-ready exports: SpecForge pre-tokenized JSONL, HF-datasets Parquet, and a manifest of states.",
)
def trainer_exports(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.hidden_states import shard_status
    from eagle_pipeline.merge import export_hf_parquet, export_specforge_jsonl

    root = pipeline.data_root()
    cfg = pipeline.config()
    out = root.exports_dir
    spec = export_specforge_jsonl(root.merged_dir, out / "specforge" / "train.jsonl", split="train")
    hf = export_hf_parquet(root.merged_dir, out / "hf_parquet")
    shard_keys = context.instance.get_dynamic_partitions("hidden_state_shards")
    states = {k: shard_status(root.hidden_states_dir, int(k)) for k in shard_keys}
    not_done = sorted(k for k, st in states.items() if st != "done")
    if not_done:
        raise dg.Failure(f"Hidden-state shards not complete: {not_done}; materialize hidden_states for them first.")
    manifest = {
        "specforge_jsonl": spec.to_dict(),
        "hf_parquet": hf.to_dict(),
        "hidden_states_dir": str(root.hidden_states_dir),
        "hidden_state_shards": sorted(shard_keys),
        "draft_vocab_dir": str(root.draft_vocab_dir),
        "config_hash": cfg.config_hash(),
    }
    write_json_atomic(manifest, out / "manifest.json")
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(out)),
            "specforge_rows": dg.MetadataValue.json(spec.rows),
            "hf_parquet_rows": dg.MetadataValue.json(hf.rows),
            "hidden_state_shards": len(shard_keys),
        }
    )
