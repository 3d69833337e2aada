"""Merge and shuffle the audited datasets; the draft vocabulary; trainer exports."""

import dagster as dg
import pyarrow.compute as pc

from eagle_pipeline.audit.overview import dataset_overview
from eagle_pipeline.audit.records import GateProblem, audits_for_merge
from eagle_pipeline.defs.automation import after_checks_pass
from eagle_pipeline.defs.metadata import records_table
from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME, shard_key
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.defs.tokens import token_samples
from eagle_pipeline.generation.store.coverage import response_overview, stale_token_samples
from eagle_pipeline.merge.checks import MERGED_CHECKS, MergedCheckContext
from eagle_pipeline.shared.checks import CheckResult, CheckSpec
from eagle_pipeline.shared.figures import histogram_markdown


@dg.asset(
    deps=[token_samples],
    group_name="merge",
    kinds={"parquet"},
    owners=["team:data"],
    automation_condition=after_checks_pass,
    description=(
        "Audited rows of every dataset, deduplicated by prompt, shuffled with a fixed seed, with input_ids and "
        "loss_mask. Refuses to run while any dataset's latest audit failed or did not run on its latest data."
    ),
)
def merged_dataset(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.hidden_states.store.merged import num_shards
    from eagle_pipeline.merge import MergeInput, merge_datasets, read_merged

    cfg = pipeline.config()
    root = pipeline.data_root()
    problems, audits = audits_for_merge(
        root, cfg.dataset_names, pipeline.tokenizer(), pipeline.profile_ids(), pipeline.audit_settings()
    )
    # A passed audit of token samples built from rows that no longer count (another backend's) is no licence.
    for ds in cfg.dataset_names:
        reason = stale_token_samples(ds, root.tokens(ds), root.responses_dir(ds), pipeline.backend_identity(ds))
        if reason:
            problems.append(GateProblem(ds, "responses", reason))
    if problems:
        from eagle_pipeline.audit.overview import audit_overview, refusal_summary

        view = audit_overview(
            root, cfg.dataset_names, pipeline.tokenizer(), pipeline.profile_ids(), pipeline.audit_settings()
        )
        raise dg.Failure(
            description=refusal_summary(view) + "\n\nEvery problem found:\n" + "\n".join(f"- {p}" for p in problems),
            metadata={"problems": dg.MetadataValue.json([str(p) for p in problems])},
            allow_retries=False,
        )
    # Rows failing a filtering gate (or a per-row billing check) are excluded here and counted in the manifest; the
    # rows to keep come from each dataset's stored audit, bound to its current token samples.
    inputs = [
        MergeInput(
            dataset=ds,
            tokens_path=root.tokens(ds),
            keep_mask=audit.keep_mask,
            excluded_by_gate=audit.excluded_counts,
            upstream_version=audit.tokens_sha256[:16],
        )
        for ds, audit in audits.items()
    ]
    manifest = merge_datasets(inputs, root.merged_dir, cfg.merge, config_hash=cfg.config_hash())
    summary = manifest.to_dict()
    n_rows = manifest.rows_total
    # One hidden-state partition per extraction shard of the merged rows; stale keys from a larger merge go away.
    shards = [shard_key(i) for i in range(num_shards(n_rows, cfg.hidden_states.shard_size))]
    existing = set(context.instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME))
    new = [k for k in shards if k not in existing]
    if new:
        context.instance.add_dynamic_partitions(SHARD_PARTITIONS_NAME, new)
    for stale in sorted(existing - set(shards)):
        context.instance.delete_dynamic_partition(SHARD_PARTITIONS_NAME, stale)
    overview = dataset_overview(
        root,
        cfg.dataset_names,
        manifest.rows_per_dataset,
        {ds: response_overview(root, ds) for ds in cfg.dataset_names},
    )
    merged = read_merged(root.merged_dir, columns=["dataset", "n_tokens"])
    by_dataset = {ds: merged.filter(pc.equal(merged["dataset"], ds))["n_tokens"].to_numpy() for ds in cfg.dataset_names}
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": n_rows,
            "per_dataset_rows": records_table(overview, ROWS_COLUMNS),
            "per_dataset_requests": records_table(overview, REQUESTS_COLUMNS),
            "per_dataset_providers": records_table(overview, PROVIDERS_COLUMNS),
            "tokens_per_sample": dg.MetadataValue.md(
                histogram_markdown(by_dataset, title="Merged: tokens per sample by dataset", xlabel="tokens")
            ),
            "path": dg.MetadataValue.path(str(root.merged_dir)),
            "tokens_total": manifest.tokens_total,
            "supervised_tokens_total": manifest.supervised_tokens_total,
            "rows_per_dataset": dg.MetadataValue.json(summary["rows_per_dataset"]),
            "tokens_per_dataset": dg.MetadataValue.json(summary["tokens_per_dataset"]),
            "excluded": dg.MetadataValue.json(summary["excluded"]),
            "splits": dg.MetadataValue.json(summary["splits"]),
            "seed": cfg.merge.seed,
            "config_hash": cfg.config_hash(),
            "hidden_state_shards": len(shards),
        }
    )


# The per-dataset overview (audit.overview.dataset_overview) as three narrow tables rather than one of ten columns, so
# each fits a 1280 px window (the UI test measures it): where the rows went, what the requests cost, who served them.
# The provider split has a table of its own: beside four numeric columns it pushed the table past the window.
ROWS_COLUMNS = {
    "dataset": "dataset",
    "responses": "committed responses answering the current prompts",
    "token_samples": "rows of the dataset's token samples",
    "audit": "its stored audit: pass, or FAIL (a blocking gate)",
    "merged_rows": "rows of this dataset in the merged dataset",
}
REQUESTS_COLUMNS = {
    "dataset": "dataset",
    "spend_usd": "the ledger's spend on this dataset, retired rows included (USD)",
    "failed_requests": "requests that failed for good (errors/ parts)",
    "other_prompt_rows": "committed rows answering prompts no longer configured (kept, not used)",
}
PROVIDERS_COLUMNS = {
    "dataset": "dataset",
    "providers": "provider split of the current responses (provider:rows)",
}


def _merged_check(spec: CheckSpec[MergedCheckContext]) -> dg.AssetChecksDefinition:
    """One blocking check of the merged table for one entry of the core's registry (`merge.checks.MERGED_CHECKS`)."""

    @dg.asset_check(asset=merged_dataset, name=spec.name, blocking=True, description=spec.description)
    def _check(pipeline: PipelineResource) -> dg.AssetCheckResult:
        context = MergedCheckContext(pipeline.data_root().merged_dir, lambda: pipeline.profile_ids().eot_id)
        return _merged_check_result(spec.run(context))

    return _check


merged_checks = [_merged_check(spec) for spec in MERGED_CHECKS]


def _merged_check_result(result: CheckResult) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=bool(result.passed),
        description=result.detail,
        metadata={
            **{k: int(v) for k, v in result.counts.items()},
            "failing_sample_ids": dg.MetadataValue.json(list(result.failing_sample_ids)[:10]),
        },
    )


@dg.asset(
    deps=[merged_dataset],
    group_name="merge",
    automation_condition=after_checks_pass,
    kinds={"numpy", "pytorch"},
    owners=["team:data"],
    description="Draft vocabulary: top-K target ids over supervised tokens, as d2t/t2d for SpecForge and speculators.",
)
def draft_vocab(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.merge import build_draft_vocab

    cfg = pipeline.config()
    root = pipeline.data_root()
    tok = pipeline.tokenizer()
    k = min(cfg.merge.draft_vocab_size, tok.vocab_size)
    s = build_draft_vocab(root.merged_dir, tok.vocab_size, root.draft_vocab_dir, k=k)
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(root.draft_vocab_dir)),
            "draft_vocab_size": s.k,
            "target_vocab_size": s.target_vocab_size,
            "supervised_tokens": s.supervised_tokens,
            "distinct_supervised_tokens": s.distinct_supervised_tokens,
            "coverage_of_supervised_tokens": round(s.coverage, 6),
            "padded_unseen_ids": s.padded_unseen_ids,
            "files": dg.MetadataValue.json(s.files),
        }
    )
