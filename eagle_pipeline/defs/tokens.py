"""Token samples (exact target ids) and the structural audit: one blocking asset check per gate."""

from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from eagle_pipeline.audit import GATES, GateSpec, report_markdown
from eagle_pipeline.audit.overview import audit_failure_summary, first_failure, gate_counts, gate_summary
from eagle_pipeline.audit.records import StoredAudit, audit_token_samples, current_audit, record_gate_verdict
from eagle_pipeline.defs.automation import after_any_audit
from eagle_pipeline.defs.generation import responses
from eagle_pipeline.defs.metadata import readable, records_table
from eagle_pipeline.defs.partitions import dataset_partitions
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.shared.arrow import list_lengths, value_counts
from eagle_pipeline.shared.figures import histogram_markdown
from eagle_pipeline.shared.storage import file_sha256, write_parquet_atomic

if TYPE_CHECKING:
    from eagle_pipeline.generation.store.coverage import Coverage
    from eagle_pipeline.tokens import TargetTokenizer

TOKEN_SAMPLES = dg.AssetKey("token_samples")


def _gate_check_spec(gate: GateSpec) -> dg.AssetCheckSpec:
    return dg.AssetCheckSpec(
        gate.name,
        asset="token_samples",
        description=f"{gate.title}. {gate.description}",
        blocking=True,
        partitions_def=dataset_partitions,
    )


# The asset and its gate checks are one computation: the checks judge the file this step writes, and a blocking
# failure must fail the partition itself (Dagster marks a partition failed only when its run failed without
# materializing it), so the list of datasets shows a refused one in red, not a green dot beside a red check.
# can_subset: a run may select the asset without its checks, or the checks alone (they then judge the file on disk).
@dg.multi_asset(
    specs=[
        dg.AssetSpec(
            "token_samples",
            partitions_def=dataset_partitions,
            deps=[responses],
            group_name="tokens",
            kinds={"parquet"},
            owners=["team:data"],
            description=(
                "Exact target token ids per response: prompt rendered through the target's chat template; output "
                "rebuilt from API text (reasoning, </think>, content, tool-call section, <|im_end|>) or taken as "
                "returned by SGLang/vLLM. Audited by one blocking check per gate; a blocking failure fails the "
                "partition (nothing is materialized)."
            ),
        )
    ],
    check_specs=[_gate_check_spec(g) for g in GATES],
    partitions_def=dataset_partitions,
    can_subset=True,
    name="token_samples",
)
def token_samples(context: dg.AssetExecutionContext, pipeline: PipelineResource):
    dataset = context.partition_key
    gates = [g.name for g in GATES if dg.AssetCheckKey(TOKEN_SAMPLES, g.name) in context.selected_asset_check_keys]
    root = pipeline.data_root()
    building = TOKEN_SAMPLES in context.selected_asset_keys
    if building:
        metadata, audit = _build_token_samples(context, pipeline)
    else:
        # The checks alone: they judge the file on disk (its stored audit, recomputed only if it is not bound to
        # the current file and settings).
        metadata = {}
        audit = current_audit(root, dataset, pipeline.tokenizer(), pipeline.profile_ids(), pipeline.audit_settings())
    results = {name: record_gate_verdict(root, audit, name) for name in gates}
    checks = [gate_check_result(dataset, name, r, audit.tokens_sha256) for name, r in results.items()]
    if not building or any(r["blocking"] for r in results.values()):
        # A refusal materializes nothing: the evaluations are recorded (their metadata names the judged file by its
        # sha256), then the step fails with the summary, and the partition shows as failed.
        yield from checks
        _refuse_if_blocked(dataset, results, metadata)
        return
    yield dg.MaterializeResult(
        asset_key=TOKEN_SAMPLES,
        metadata=metadata,
        data_version=dg.DataVersion(str(metadata["sha256"])[:16]),
        check_results=checks,
    )


def _refuse_if_blocked(dataset: str, results: dict[str, dict], metadata: dict) -> None:
    """Fail the step when a blocking gate failed, with a summary of what failed, the figures and what to do (rather
    than Dagster's generic "blocking asset check failed"). Not retried: regenerating would not fix the data."""
    blocking = [name for name, r in results.items() if r["blocking"]]
    if not blocking:
        return
    first = blocking[0]
    summary = audit_failure_summary(dataset, first, results[first])
    if len(blocking) > 1:
        also = "; ".join(f"{name} ({gate_counts(results[name])})" for name in blocking[1:])
        summary += f"\n\nAlso blocking {dataset}: {also}."
    raise dg.Failure(
        description=summary,
        metadata={
            "dataset": dataset,
            "blocking_gates": dg.MetadataValue.json(blocking),
            "counts": gate_counts(results[first]),
            **metadata,
        },
        allow_retries=False,
    )


def _build_token_samples(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> tuple[dict, StoredAudit]:
    """Reconstruct, write and audit the dataset's token samples: the materialization's metadata and the stored
    audit of the file."""
    from eagle_pipeline.generation.store.coverage import CURRENT_COLUMNS, current_responses, prompt_sample_ids
    from eagle_pipeline.generation.store.shards import read_responses
    from eagle_pipeline.tokens import EncodingMemo, reconstruct_table
    from eagle_pipeline.tokens.samples import RECONSTRUCTION_COLUMNS

    cfg = pipeline.config()
    root = pipeline.data_root()
    ds = cfg.datasets[context.partition_key]
    tok = pipeline.tokenizer()
    prompt_ids = prompt_sample_ids(root.prompts(ds.name))
    # Rows committed for other prompts (an earlier limit or seed) stay on disk and are counted, never used.
    # So are rows another backend produced (another kind, model or endpoint class, or simulated usage counted with
    # another tokenizer): generation/store/identity.py.
    committed = read_responses(root.responses_dir(ds.name), columns=CURRENT_COLUMNS + RECONSTRUCTION_COLUMNS)
    resp, cov = current_responses(ds.name, committed, prompt_ids, pipeline.backend_identity(ds.name))
    if resp.num_rows == 0:
        raise dg.Failure(
            f"{ds.name}: no committed response under {root.responses_dir(ds.name)} answers a current prompt "
            f"({cov.describe()})",
            allow_retries=False,
        )
    # The audit below re-encodes the decoding of every span reconstruction encoded (its round trip): the memo gives
    # it those encodings instead of a second BPE pass over every answer (tokens/tokenizer.py, EncodingMemo).
    memo = EncodingMemo()
    table = reconstruct_table(resp, tok, pipeline.profile(), dataset_has_tools=ds.tools, memo=memo)
    # The run id makes every materialization a distinct file, so an audit verdict binds to exactly one of them.
    table = table.replace_schema_metadata(
        {
            **(table.schema.metadata or {}),
            b"eagle.run_id": context.run.run_id.encode(),
            b"eagle.tokenizer": tok.fingerprint().encode(),
        }
    )
    path = write_parquet_atomic(table, root.tokens(ds.name))
    digest = file_sha256(path)
    # The dataset's one audit: every check and the merge read this stored result (bound to the file's sha256).
    audit = audit_token_samples(
        root,
        ds.name,
        tok,
        pipeline.profile_ids(),
        pipeline.audit_settings(),
        table=table,
        tokens_sha256=digest,
        memo=memo,
    )

    context.log.info(
        f"{ds.name}: {table.num_rows} token samples with tokenizer {tok.name} ({tok.kind}); {cov.describe()}"
    )
    return _token_samples_metadata(ds.name, table, tok, cov, audit, path, digest), audit


def _token_samples_metadata(
    dataset: str, table: pa.Table, tok: "TargetTokenizer", cov: "Coverage", audit: StoredAudit, path: Path, digest: str
) -> dict[str, Any]:
    """The materialization's metadata: counts, lengths, the tokenizer, the audit's summary and the file's sha256."""
    lengths = pc.list_value_length(table.column("output_ids"))
    prompt_lengths = pc.list_value_length(table.column("prompt_ids"))
    origin = value_counts(table.column("ids_origin"))
    return {
        "dagster/row_count": table.num_rows,
        **cov.metadata(),
        "path": dg.MetadataValue.path(str(path)),
        "tokenizer": f"{tok.name} ({tok.kind})",
        "tokenizer_is_demo": tok.kind == "demo",
        "tokenizer_fingerprint": tok.fingerprint()[:16],
        "output_tokens": int(pc.sum(lengths).as_py() or 0),
        "prompt_tokens": int(pc.sum(prompt_lengths).as_py() or 0),
        "mean_output_tokens": round(float(pc.mean(lengths).as_py() or 0.0), 1),
        "max_output_tokens": int(pc.max(lengths).as_py() or 0),
        "ids_origin": dg.MetadataValue.json(origin),
        "rows_with_literal_special_strings": int(pc.sum(table.column("literal_special").cast("int64")).as_py() or 0),
        "audit_summary": dg.MetadataValue.md(report_markdown(audit.report)),
        "rows_kept_after_filters": int(audit.keep_mask.sum()),
        "token_lengths": dg.MetadataValue.md(
            histogram_markdown(
                {
                    "prompt": list_lengths(table.column("prompt_ids")),
                    "output": list_lengths(table.column("output_ids")),
                },
                title=f"{dataset}: tokens per sample ({tok.name})",
                xlabel="tokens",
            )
        ),
        "sha256": digest,
    }


def gate_check_result(dataset: str, gate: str, result: dict, tokens_sha256: str) -> dg.AssetCheckResult:
    """One gate's stored result (`GateResult.to_dict()`) on `dataset` as a check result: blocking failure -> ERROR
    (stops downstream); rows only filtered -> pass, counted; rows only warned -> WARN. The description names the
    dataset and the counts."""
    if result["blocking"]:
        passed, severity = False, dg.AssetCheckSeverity.ERROR
    elif result["failing"] - result["excluded"]:  # rows only warned
        passed, severity = False, dg.AssetCheckSeverity.WARN
    else:
        passed, severity = True, dg.AssetCheckSeverity.ERROR
    return dg.AssetCheckResult(
        asset_key=TOKEN_SAMPLES,
        check_name=gate,
        passed=passed,
        severity=severity,
        metadata={**gate_check_metadata(dataset, result), "token_samples_sha256": tokens_sha256},
        description=gate_summary(dataset, result),
    )


def gate_check_metadata(dataset: str, result: dict) -> dict:
    # The numbers carry the dataset in their key: Dagster plots a check's numeric metadata over time across all
    # partitions, so a key shared by every dataset would draw B1, B3 and B6 as one zig-zag line.
    examples = "\n".join(
        f"- `{e['sample_id']}`: "
        + (f"{e['problem']}; " if e.get("problem") else "")
        + f"`{str(e.get('excerpt', ''))[:160].replace('`', chr(39))}`"
        for e in result["examples"]
    )
    meta = {
        "dataset": dataset,
        "action": result["action"],
        "counts": gate_counts(result),
        f"{dataset}: rows checked": result["checked"],
        f"{dataset}: rows failing": result["failing"],
        f"{dataset}: failure rate": readable(float(result["rate"])),
        f"{dataset}: rows excluded downstream": result["excluded"],
        "actions_by_origin": dg.MetadataValue.json(result["origin_actions"]),
        "failing_sample_ids": dg.MetadataValue.json(list(result["failing_sample_ids"])),
        "by_backend_provider": dg.MetadataValue.json(result["by_source"]),
        "by_ids_origin": dg.MetadataValue.json(result["by_origin"]),
    }
    example = first_failure(result)
    if example:
        meta["first_failure_example"] = example  # plain text: shown in the metadata table without a click
    if examples:
        meta["failure_examples"] = dg.MetadataValue.md(examples)
    if result["details"]:
        meta["details"] = dg.MetadataValue.json(result["details"])
    return meta


@dg.asset(
    deps=[token_samples],
    group_name="tokens",
    owners=["team:data"],
    automation_condition=after_any_audit,
    description=(
        "The audit view: for the latest token samples of every dataset, fit to merge yes/no and why (the merge's own "
        "verdict), and each gate's failing rows, action, verdict and excluded rows. Refreshed by the audit_view "
        "sensor after any dataset is audited."
    ),
)
def audit_overview(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    from eagle_pipeline.audit import overview as view

    cfg = pipeline.config()
    audits = view.audit_overview(
        pipeline.data_root(), cfg.dataset_names, pipeline.tokenizer(), pipeline.profile_ids(), pipeline.audit_settings()
    )
    line = view.fit_line(audits)
    context.log.info(line)
    first_failures = {f"first_failure {a.dataset}": a.first_failure for a in audits if a.first_failure}
    return dg.MaterializeResult(
        metadata={
            "fit_to_merge": line,
            "datasets": records_table(
                view.dataset_rows(audits),
                {
                    "dataset": "dataset (partition of token_samples)",
                    "fit": "fit to merge: the merge's own verdict on the dataset's latest token samples",
                    "rows": "token-sample rows the stored audit judged (empty: no audit of the current file)",
                    "excluded": "rows a failing filter/block gate keeps out of the merge",
                    "reason": "why: each blocking gate's counts, or the problem the merge found",
                },
            ),
            "gates_with_findings": records_table(
                view.gate_rows(audits),
                {
                    "dataset": "dataset",
                    "gate": "audit gate (an asset check on token_samples)",
                    "action": "what a failing row does: block, filter or warn",
                    "failing": "failing rows of rows checked",
                    "verdict": "the check's verdict",
                    "excluded": "rows this gate keeps out of the merge",
                },
            ),
            **first_failures,
            "datasets_x_gates": dg.MetadataValue.md(view.grid_markdown(audits)),
            "datasets fit to merge": sum(a.fit for a in audits),
            "datasets not fit to merge": sum(not a.fit for a in audits),
        }
    )


@dg.asset_check(
    asset=audit_overview,
    name="every_dataset_fit",
    blocking=False,  # nothing is downstream of the view; the merge refuses on its own verdict
    description=(
        "Every dataset's latest token samples are fit to merge. Fails (red on the asset, in the graph and the "
        "catalog) while any is not, so a view that says '0 of 8 fit' is never shown with a green tick alone."
    ),
)
def every_dataset_fit(pipeline: PipelineResource) -> dg.AssetCheckResult:
    from eagle_pipeline.audit import overview as view

    cfg = pipeline.config()
    audits = view.audit_overview(
        pipeline.data_root(), cfg.dataset_names, pipeline.tokenizer(), pipeline.profile_ids(), pipeline.audit_settings()
    )
    unfit = [a.dataset for a in audits if not a.fit]
    return dg.AssetCheckResult(
        passed=not unfit,
        severity=dg.AssetCheckSeverity.ERROR,
        description=view.fit_line(audits),
        metadata={"datasets not fit to merge": len(unfit), "unfit": dg.MetadataValue.json(unfit)},
    )
