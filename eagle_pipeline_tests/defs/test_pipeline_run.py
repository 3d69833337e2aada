"""The whole graph on a small config through real Dagster runs, and audit failures blocking downstream work."""

from __future__ import annotations

import json
import re

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.generation import prompts, responses
from eagle_pipeline.defs.hidden_states import hidden_state_plan
from eagle_pipeline.defs.merge import draft_vocab, merged_dataset
from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME
from eagle_pipeline.defs.tokens import token_samples
from eagle_pipeline.generation.store.shards import read_responses
from eagle_pipeline.shared.storage import DataRoot, file_sha256

pytestmark = pytest.mark.slow


def _run(defs, job, instance, partition_key=None):
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, partition_key=partition_key, raise_on_error=False
    )


def _check_evaluations(result):
    return {(e.asset_check_key.name): e for e in result.get_asset_check_evaluations()}


def test_whole_graph_materializes_and_writes_every_output(pipeline_config, instance, tmp_path):
    pipeline_config(datasets=("B1", "B6"))
    defs = build_defs()
    root = DataRoot(tmp_path / "data")
    for ds in ("B1", "B6"):
        result = _run(defs, "EAGLE_dataset", instance, ds)
        assert result.success, ds
        evaluations = _check_evaluations(result)
        assert len(evaluations) >= 12
        failed = [name for name, e in evaluations.items() if not e.passed]
        assert failed == [], f"{ds}: {failed}"
        assert pq.read_table(root.tokens(ds)).num_rows == 6
    assert _run(defs, "EAGLE_merge", instance).success
    shards = instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME)
    assert len(shards) == 3  # 12 rows (6 + 6, no duplicates) / shard size 4
    for key in shards:
        result = _run(defs, "EAGLE_hidden_states", instance, key)
        assert result.success, key
        assert all(e.passed for e in result.get_asset_check_evaluations())
    assert _run(defs, "EAGLE_exports", instance).success

    manifest = json.loads((root.merged_dir / "manifest.json").read_text())
    assert manifest["rows_total"] == 12
    assert len(list(root.hidden_states_dir.glob("shard-*.safetensors"))) == 3
    assert (root.draft_vocab_dir / "d2t.npy").exists() and (root.draft_vocab_dir / "t2d.npy").exists()
    assert (root.exports_dir / "manifest.json").exists()
    rows = read_responses(root.responses_dir("B1")).to_pylist()
    assert {r["source"] for r in rows} == {"simulated"}
    mats = instance.fetch_materializations(dg.AssetKey("responses"), limit=10).records
    assert any(m.asset_materialization.metadata["simulated"].value is True for m in mats)

    # Dashboards: histograms as inline images, and the per-dataset overview table on the merge.
    tokens_meta = (
        instance.fetch_materializations(dg.AssetKey("token_samples"), limit=1).records[0].asset_materialization.metadata
    )
    assert (
        tokens_meta["token_lengths"].value.startswith("![")
        and "data:image/png;base64," in tokens_meta["token_lengths"].value
    )
    merged_meta = (
        instance.fetch_materializations(dg.AssetKey("merged_dataset"), limit=1)
        .records[0]
        .asset_materialization.metadata
    )
    # Three narrow tables (where the rows went; what the requests cost; who served them), joined on the dataset.
    overview = {r.data["dataset"]: dict(r.data) for r in merged_meta["per_dataset_rows"].value.records}
    for table in ("per_dataset_requests", "per_dataset_providers"):
        for r in merged_meta[table].value.records:
            overview[r.data["dataset"]].update(r.data)
    assert set(overview) == {"B1", "B6"}
    assert all(r["responses"] == 6 and r["token_samples"] == 6 and r["audit"] == "pass" for r in overview.values())
    # The provider split counts every current response once: "provider:rows, ..." adds up to the responses.
    for r in overview.values():
        assert sum(int(part.rsplit(":", 1)[1]) for part in r["providers"].split(", ")) == r["responses"], r
    assert sum(r["merged_rows"] for r in overview.values()) == manifest["rows_total"]
    assert overview["B1"]["spend_usd"] > 0


def _probe_defs():
    """One job holding a dataset's whole path to the merge, so blocking is observed inside a single run."""
    probe = dg.define_asset_job(
        "probe_job",
        selection=dg.AssetSelection.assets(
            prompts, responses, token_samples, merged_dataset, draft_vocab, hidden_state_plan
        ),
    )
    base = build_defs()
    return dg.Definitions.merge(base, dg.Definitions(jobs=[probe]))


def test_failing_audit_blocks_everything_downstream_in_the_same_run(pipeline_config, instance):
    pipeline_config(datasets=("B1",), simulated={"faults": {"billing_mismatch": 1.0}})
    defs = _probe_defs()
    result = _run(defs, "probe_job", instance, "B1")
    assert not result.success
    evaluations = _check_evaluations(result)
    assert evaluations["billing_agreement"].passed is False
    assert evaluations["ends_with_eot"].passed is True  # its neighbour still passes
    # A refused dataset is not materialized: nothing downstream runs, and its partition is failed, not green.
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert materialized == {"prompts", "responses"}
    # The failed step's error is a summary with the figures and what to do, not Dagster's generic check error.
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert failure.step_key == "token_samples"
    message = failure.event_specific_data.error.message
    assert re.search(r"Audit failed: billing_agreement blocks B1: (\d+) of \1 rows over the per-row tolerance", message)
    assert "First failing row: B1-" in message and "rerun EAGLE_dataset for B1" in message


def _partition_status(instance, asset, partitions_def):
    """What the UI's partition list shows for each partition of `asset`: Dagster's own status cache."""
    from dagster._core.storage.partition_status_cache import get_and_update_asset_status_cache_value

    value = get_and_update_asset_status_cache_value(instance, dg.AssetKey(asset), partitions_def)
    failed = set(value.deserialize_failed_partition_subsets(partitions_def).get_partition_keys())
    materialized = set(value.deserialize_materialized_partition_subsets(partitions_def).get_partition_keys())
    return {"failed": failed, "materialized": materialized - failed}


def test_a_blocking_audit_failure_fails_the_partition_where_the_datasets_are_listed(pipeline_config, instance):
    """B1 passes, B6 is over-billed: B6's partition of token_samples is failed (red in the partition list), B1's
    materialized; B6's checks still say which gate failed. A clean rerun of B6 turns its partition green."""
    from eagle_pipeline.defs.partitions import dataset_partitions

    path = pipeline_config(datasets=("B1", "B6"))
    defs = build_defs()
    assert _run(defs, "EAGLE_dataset", instance, "B1").success
    pipeline_config(datasets=("B1", "B6"), simulated={"faults": {"billing_mismatch": 1.0}})
    result = _run(defs, "EAGLE_dataset", instance, "B6")
    assert not result.success
    assert _check_evaluations(result)["billing_agreement"].passed is False
    assert _partition_status(instance, "token_samples", dataset_partitions) == {
        "failed": {"B6"},
        "materialized": {"B1"},
    }

    # Without faults (new prompts, so the stored over-billed answers are not reused) B6 passes and turns green.
    import yaml

    raw = yaml.safe_load(path.read_text())
    raw["backends"]["simulated"]["simulated"].pop("faults", None)
    next(d for d in raw["datasets"] if d["name"] == "B6")["sampling"] = {"seed": 1}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert _run(build_defs(), "EAGLE_dataset", instance, "B6").success
    assert _partition_status(instance, "token_samples", dataset_partitions) == {
        "failed": set(),
        "materialized": {"B1", "B6"},
    }


def test_prompt_mismatch_warns_and_lets_the_data_flow(pipeline_config, instance):
    """A provider that bills an injected system prompt: prompt_agreement fails with WARN severity and names the
    difference, and the merge still runs in the same run (the default action is warn)."""
    pipeline_config(datasets=("B1",), simulated={"faults": {"prompt_mismatch": 1.0}})
    defs = _probe_defs()
    result = _run(defs, "probe_job", instance, "B1")
    assert result.success
    evaluation = _check_evaluations(result)["prompt_agreement"]
    assert evaluation.passed is False and evaluation.severity == dg.AssetCheckSeverity.WARN
    meta = evaluation.metadata
    assert meta["B1: rows failing"].value == meta["B1: rows checked"].value > 0
    assert evaluation.description.startswith("B1: ") and meta["dataset"].value == "B1"
    assert meta["first_failure_example"].value.startswith(f"{meta['failing_sample_ids'].value[0]}: ")
    assert json.loads(json.dumps(meta["details"].value))["difference_median"] == 37.0
    assert "usage_prompt_tokens" in meta["failure_examples"].value
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert {"merged_dataset", "draft_vocab"} <= materialized


def test_merge_refuses_in_a_later_run_while_an_audit_failed_or_is_stale(pipeline_config, instance, tmp_path):
    pipeline_config(datasets=("B1",), simulated={"faults": {"billing_mismatch": 1.0}})
    defs = build_defs()
    assert not _run(defs, "EAGLE_dataset", instance, "B1").success
    result = _run(defs, "EAGLE_merge", instance)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.event_specific_data.error.message
    assert "B1/billing_agreement" in message and "blocking audit failed" in message
    # It starts with one paragraph: what failed, the figures, what to do; the list of problems follows.
    summary = failure.event_specific_data.error.message.split("\n\n")[0]
    assert "Merge refused: 1 of 1 datasets are not fit to merge. B1: billing_agreement: " in summary
    assert re.search(r"(\d+) of \1 rows over the per-row tolerance; aggregate [\d.]+% > 0\.50%", summary), summary
    assert "rerun EAGLE_dataset" in summary
    # The audit view says so on the asset itself: its check fails (the run does not: it only reports).
    view = _run(defs, "EAGLE_audit_view", instance)
    assert view.success
    fit = _check_evaluations(view)["every_dataset_fit"]
    assert not fit.passed and fit.description == "0 of 1 datasets fit to merge: B1 NO (billing_agreement)"

    # Clean data: regenerate into a fresh data root with no faults; the audit passes and merge runs.
    import shutil

    shutil.rmtree(tmp_path / "data")
    pipeline_config(datasets=("B1",))
    assert _run(defs, "EAGLE_dataset", instance, "B1").success
    assert _run(defs, "EAGLE_merge", instance).success
    assert _check_evaluations(_run(defs, "EAGLE_audit_view", instance))["every_dataset_fit"].passed

    # Token samples rematerialised without their checks: the audit did not run on the latest data, merge refuses.
    no_checks = dg.define_asset_job(
        "tokens_without_checks",
        selection=dg.AssetSelection.assets(token_samples).without_checks(),
    )
    defs2 = dg.Definitions.merge(build_defs(), dg.Definitions(jobs=[no_checks]))
    root = DataRoot(tmp_path / "data")
    before = root.tokens("B1").stat().st_mtime_ns
    assert _run(defs2, "tokens_without_checks", instance, "B1").success
    assert root.tokens("B1").stat().st_mtime_ns != before
    result = _run(defs, "EAGLE_merge", instance)
    assert not result.success
    message = next(e for e in result.all_events if e.is_step_failure).event_specific_data.error.message
    assert "did not run on the latest token samples" in message


def test_checks_and_merge_read_the_one_stored_audit_of_the_current_file(pipeline_config, instance, tmp_path):
    """token_samples audits its file once and stores the result; the 14 checks and the merge read that result
    (an edit that keeps its binding shows), and a result bound to another file is recomputed, never trusted."""
    pipeline_config(datasets=("B1",))
    root = DataRoot(tmp_path / "data")
    materialize = dg.define_asset_job(
        "tokens_only", selection=dg.AssetSelection.assets(prompts, responses, token_samples).without_checks()
    )
    # Dagster cannot run partitioned checks without a partitioned asset in the job: prompts is the cheapest one.
    checks = dg.define_asset_job(
        "checks_only",
        selection=dg.AssetSelection.checks_for_assets(token_samples) | dg.AssetSelection.assets(prompts),
    )
    defs = dg.Definitions.merge(build_defs(), dg.Definitions(jobs=[materialize, checks]))
    assert _run(defs, "tokens_only", instance, "B1").success
    report = json.loads(root.audit_report("B1").read_text())
    assert report["tokens_sha256"] == file_sha256(root.tokens("B1")) and report["passed"]

    # Bound to the current file and settings: the checks take the stored verdicts as they are.
    report["gates"]["single_eot"].update(blocking=True, failing=2)
    root.audit_report("B1").write_text(json.dumps(report))
    result = _run(defs, "checks_only", instance, "B1")
    evaluations = _check_evaluations(result)
    assert len(evaluations) == 14
    assert (
        evaluations["single_eot"].passed is False and evaluations["single_eot"].metadata["B1: rows failing"].value == 2
    )
    assert all(e.passed for name, e in evaluations.items() if name != "single_eot")
    assert not _run(defs, "EAGLE_merge", instance).success  # the recorded blocking verdict stops the merge

    # Bound to another file: recomputed from the data, so the verdict is the data's own again.
    report["tokens_sha256"] = "0" * 64
    root.audit_report("B1").write_text(json.dumps(report))
    result = _run(defs, "checks_only", instance, "B1")
    assert all(e.passed for e in _check_evaluations(result).values())
    assert json.loads(root.audit_report("B1").read_text())["gates"]["single_eot"]["failing"] == 0
    assert _run(defs, "EAGLE_merge", instance).success


def test_after_a_refused_audit_the_summary_the_check_and_check_drafter_call_the_old_outputs_stale(
    pipeline_config, tmp_path, monkeypatch, capsys
):
    """`make demo` (its own code path, a real SQLite instance under the data root), then a change whose audit is
    refused: the earlier run's merged table, hidden states and exports are reported stale in the summary (with the
    run that built them), the exports' check fails on the asset, and check-drafter refuses the export."""
    import yaml

    from eagle_pipeline.cli import main as cli_main
    from eagle_pipeline.demo import run_demo

    path = pipeline_config(datasets=("B1",), limit=4)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "unused"))  # run_demo sets its own; restored afterwards
    root = DataRoot(tmp_path / "data")
    assert run_demo() == 0
    first = capsys.readouterr().out
    assert "stale" not in first
    flags = tmp_path / "speculators.flags"
    command = json.loads((root.exports_dir / "speculators" / "export.json").read_text())["extra"]["drafters"][0]
    flags.write_text(command["command"])
    assert (
        cli_main(["check-drafter", "--export", str(root.exports_dir / "speculators"), "--draft-config", str(flags)])
        == 0
    )
    capsys.readouterr()

    # New prompts (another seed) answered by a provider that overbills: B1's audit is refused.
    raw = yaml.safe_load(path.read_text())
    raw["backends"]["simulated"]["simulated"]["faults"] = {"billing_mismatch": 1.0}
    raw["datasets"][0]["sampling"] = {"seed": 1}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert run_demo() == 1
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if ":" in line}
    for output in ("merged", "hidden states", "trainer exports -> "):
        line = next(v for k, v in lines.items() if k.startswith(output.split(" ->")[0]))
        assert re.search(r"\[stale: built by run [0-9a-f]{8}; datasets B1\]", line), line
    assert "B1: its token samples were rebuilt and audited again since (that audit FAILED)" in out

    instance = dg.DagsterInstance.from_config(str(root.dagster_home))
    key = dg.AssetCheckKey(dg.AssetKey("trainer_exports"), "audits_still_current")
    record = instance.event_log_storage.get_latest_asset_check_execution_by_key([key])[key]
    evaluation = record.event.dagster_event.event_specific_data
    assert evaluation.passed is False and "stale export" in evaluation.description

    assert (
        cli_main(["check-drafter", "--export", str(root.exports_dir / "speculators"), "--draft-config", str(flags)])
        == 1
    )
    assert (
        "stale export: built from dataset audits that are no longer the current ones (B1: " in capsys.readouterr().err
    )
