"""Generation assets: prompts -> responses, one partition per dataset."""

import dataclasses
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_pipeline.config import DatasetConfig, PipelineConfig
from eagle_pipeline.defs.partitions import dataset_partitions
from eagle_pipeline.defs.progress import report_progress
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.run.runner import generate_dataset
from eagle_pipeline.generation.spec import BackendSpec
from eagle_pipeline.generation.spend.budget import pipeline_budget
from eagle_pipeline.generation.store.coverage import current_responses
from eagle_pipeline.generation.store.identity import tokenizer_label
from eagle_pipeline.generation.store.shards import committed_sample_ids, read_errors, read_responses
from eagle_pipeline.generation.summary import GenerationSummary, ProgressEvent, committed_totals
from eagle_pipeline.prompts import PromptFileError, dataset_prompts_table
from eagle_pipeline.shared.arrow import text_lengths
from eagle_pipeline.shared.figures import histogram_markdown
from eagle_pipeline.shared.storage import file_sha256, write_parquet_atomic


@dg.asset(
    partitions_def=dataset_partitions,
    group_name="generation",
    kinds={"parquet"},
    owners=["team:data"],
    description="The dataset's prompts with stable sample ids (hash of dataset, prompt and sampling config).",
)
def prompts(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    cfg = pipeline.config()
    ds = cfg.datasets[context.partition_key]
    table = _prompts_table_or_fail(cfg, ds)
    path = write_parquet_atomic(table, pipeline.data_root().prompts(ds.name))
    digest = file_sha256(path)
    with_tools = sum(1 for t in table.column("tools_json").to_pylist() if t)
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": table.num_rows,
            "path": dg.MetadataValue.path(str(path)),
            "prompt_file": dg.MetadataValue.path(str(ds.prompts)),
            "domain": ds.domain,
            "prompts_with_tools": with_tools,
            "dataset_declares_tools": ds.tools,
            "sha256": digest,
        },
        data_version=dg.DataVersion(digest[:16]),
    )


def _prompts_table_or_fail(cfg: PipelineConfig, ds: DatasetConfig) -> pa.Table:
    """The dataset's prompts, or a failure of this dataset alone whose message is the problem: a missing file by
    its line in the configuration, a malformed one by its own file and line (no traceback to read through)."""
    problem = cfg.prompts_problem(ds.name)
    if problem is not None:
        raise dg.Failure(description=f"{ds.name}: {cfg.source}: {problem}", allow_retries=False)
    try:
        return dataset_prompts_table(ds)
    except PromptFileError as exc:
        raise dg.Failure(description=f"{ds.name}: {exc}", allow_retries=False) from None


def provider_token_counters(tok, profile):
    """Token counters that bill like a real provider: completion and prompt tokens of the target tokenizer."""
    from eagle_pipeline.tokens import reconstruct_output, render_prompt_ids

    def count_completion(reasoning: str, content: str, tool_calls: list) -> int:
        return len(reconstruct_output(tok, profile, reasoning=reasoning, content=content, tool_calls=tool_calls).ids)

    def count_prompt(messages: list, tools: list | None, thinking: bool = True) -> int:
        return len(render_prompt_ids(tok, messages, tools, thinking=thinking))

    return count_completion, count_prompt


def _with_target_counters(pipeline: PipelineResource, spec: BackendSpec) -> BackendSpec:
    """A simulated backend without an endpoint (the runner starts its loopback server) counts tokens with the target
    tokenizer, as a provider bills them; any other spec is returned as it is."""
    if spec.kind != "simulated" or spec.endpoint:
        return spec
    count_completion, count_prompt = provider_token_counters(pipeline.tokenizer(), pipeline.profile())
    counters = {"count_completion_tokens": count_completion, "count_prompt_tokens": count_prompt}
    return dataclasses.replace(spec, simulated={**counters, **spec.simulated})


@dg.asset(
    partitions_def=dataset_partitions,
    deps=[prompts],
    group_name="generation",
    kinds={"parquet"},
    owners=["team:data"],
    pool="llm_api",
    description=(
        "The target model's responses, one row per prompt, committed in atomic Parquet shards. Reruns resume: "
        "completed sample ids are never requested again. Failed requests go to the errors table."
    ),
)
def responses(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.tokens import render_prompt_ids

    cfg = pipeline.config()
    root = pipeline.data_root()
    ds = cfg.datasets[context.partition_key]
    prompt_table = pq.read_table(root.prompts(ds.name))
    tok = pipeline.tokenizer()
    thinking = ds.sampling.thinking

    def render(messages, tools):
        return render_prompt_ids(tok, messages, tools, thinking=thinking)

    spec = _with_target_counters(pipeline, cfg.backends[ds.backend])
    simulated = spec.kind == "simulated"
    context.log.info(
        f"{ds.name}: {prompt_table.num_rows} prompts via backend {spec.name!r} ({spec.kind}"
        f"{', SIMULATED loopback server' if simulated else ''}) at {spec.endpoint or 'a server started for the run'}"
    )
    summary = generate_dataset(
        dataset=ds.name,
        prompts=prompt_table,
        backend=spec,
        sampling=ds.sampling,
        out_dir=root.responses_dir(ds.name),
        errors_dir=root.errors_dir(ds.name),
        options=RunOptions.from_settings(cfg.generation, budget_usd=ds.budget_usd, regenerate=ds.regenerate),
        render_prompt_ids=render,
        usage_tokenizer=tokenizer_label(tok),
        run_budget=pipeline_budget(cfg.generation.budget_usd, [root.responses_dir(name) for name in cfg.dataset_names]),
        progress=lambda event: _report(context, event),
    )
    # Only the rows answering the current prompts describe this materialization; the others are counted.
    table, cov = current_responses(
        ds.name,
        read_responses(root.responses_dir(ds.name)),
        prompt_table.column("sample_id").to_pylist(),
        pipeline.backend_identity(ds.name),
    )
    errors = read_errors(root.errors_dir(ds.name))
    metadata = {
        **generation_metadata(summary, table, errors, simulated=simulated),
        **cov.metadata(),
        # What the budgets count: every committed row's spend, rows for other prompts and retired rows included.
        "spend_usd_ledger": round(committed_sample_ids(root.responses_dir(ds.name))[1], 6),
    }
    if summary.stopped_reason:
        # Committed rows stay on disk; the rerun resumes from them. A partial dataset is never materialized.
        raise dg.Failure(
            description=(
                f"{ds.name}: generation stopped early ({summary.stopped_reason}) after {summary.completed} new rows"
                f"{' (' + summary.stopped_detail + ')' if summary.stopped_detail else ''}; "
                f"{cov.describe()}. Fix the cause and rerun to resume."
            ),
            metadata=metadata,
            allow_retries=False,
        )
    context.log.info(f"{ds.name}: {cov.describe()}, {cov.missing} missing, {summary.failed} failed this run")
    return dg.MaterializeResult(metadata=metadata)


def _report(context: dg.AssetExecutionContext, event: ProgressEvent) -> None:
    context.log.info(event.format())
    report_progress(context, event.figures(), event.headline())


def generation_metadata(
    summary: GenerationSummary, table: pa.Table, errors: pa.Table, *, simulated: bool
) -> dict[str, Any]:
    """Asset metadata for a responses partition: rows, spend, tokens, failures by class, provider split, lengths.

    `table` holds the rows answering the dataset's current prompts (coverage.current_responses).
    """
    totals = committed_totals(table, errors)
    return {
        "dagster/row_count": totals["rows"],
        "response_rows": totals["rows"],  # the same, under the key live progress reports use (one row per turn)
        "generation_mode": "simulated (loopback OpenRouter-format server)" if simulated else "live",
        "simulated": simulated,
        "backend": summary.backend,
        "requested_this_run": summary.requested,
        "already_done": summary.already_done,
        "recovered_from_log": summary.recovered_from_log,  # a killed run's answers, committed from its answer log
        "answer_log_s": summary.answer_log_s,  # the answer log's write interval (generation.answer_log_s); None: none
        "completed_this_run": summary.completed,
        "failed_this_run": summary.failed,
        "errors_by_class_this_run": dg.MetadataValue.json(dict(sorted(summary.errors_by_class.items()))),
        "spend_usd_total": totals["spend_usd_total"],
        "spend_usd_this_run": round(float(summary.spend_usd), 6),
        "completion_tokens_total": totals["completion_tokens_total"],
        "errors_total": totals["errors_total"],
        "errors_by_class": dg.MetadataValue.json(totals["errors_by_class"]),
        "provider_split": dg.MetadataValue.json(totals["provider_split"]),
        "source_split": dg.MetadataValue.json(totals["source_split"]),
        "finish_reasons": dg.MetadataValue.json(totals["finish_reasons"]),
        "conversation_ends": dg.MetadataValue.json(totals["conversation_ends"]),
        "elapsed_s": round(float(summary.elapsed_s), 2),
        "reasoning_content_lengths": dg.MetadataValue.md(
            histogram_markdown(
                {
                    "reasoning": text_lengths(table.column("reasoning")),
                    "content": text_lengths(table.column("content")),
                },
                title="Reasoning and content length per response",
                xlabel="characters",
            )
        ),
    }
