"""Hidden-state extraction: the plan (CPU, first), the shards (GPU pool), their checks, and trainer exports."""


import functools
import warnings

import dagster as dg

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


@functools.lru_cache(maxsize=2)
def _model_cached(model: str, family: str, seed: int, vocab_size: int, device: str):
    from eagle_pipeline.hidden_states.runtime import load_extraction_model

    return load_extraction_model(model, family=family, seed=seed, vocab_size=vocab_size, device=device)


@dg.asset(
    partitions_def=shard_partitions,
    deps=[merged_dataset, hidden_state_plan],
    group_name="hidden_states",
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
    from eagle_pipeline.hidden_states.runtime import resolve_device

    cfg = pipeline.config()
    root = pipeline.data_root()
    h = cfg.hidden_states
    plan = read_json(root.hidden_states_dir / "plan.json")["this_run"]
    if plan.get("exceeds_budget"):
        raise dg.Failure(
            f"Extraction refused: the plan needs {plan['bytes_on_disk'] / 1e9:.2f} GB on disk, over the "
            f"configured budget of {h.disk_budget_gb} GB (hidden_states.disk_budget_gb).",
            allow_retries=False,
        )
    device = resolve_device(h.device)
    model = _model_cached(h.model, h.family, h.seed, pipeline.tokenizer().vocab_size, device)
    shard = int(context.partition_key)
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
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": int(s["rows"]),
            "path": dg.MetadataValue.path(str(s["path"])),
            "tokens": int(s["tokens"]),
            "padding_fraction": float(s["padding_fraction"]),
            "tokens_per_s": float(s["tokens_per_s"]),
            "device": device,
            "model": h.model,
            "skipped_already_done": bool(s.get("skipped", False)),
        }
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
    _shard_check("shapes_match_token_counts", "shapes", "Per sample, every state tensor has one row per token, width 3H / H."),
    _shard_check("no_nan_or_inf", "finite", "No NaN or Inf in any state: a bad sample fails the shard, never skipped silently."),
    _shard_check("ids_match_merged", "ids_match", "Stored input ids equal the merged dataset's ids for the same sample_id."),
]


@dg.asset(
    deps=[merged_dataset, draft_vocab, hidden_states],
    group_name="exports",
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
