"""The Dagster webserver end to end: dataset runs launched and read back through its GraphQL API.

B1 runs on the clean simulated backend, B6 on one that over-bills every response (see conftest.py). What the UI
shows comes from these same queries, so this is what an operator would see in the asset and check pages.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from eagle_pipeline.audit import GATES
from eagle_pipeline.audit.records import gate_record_path
from eagle_pipeline.shared.storage import DataRoot
from eagle_pipeline_tests.ui.conftest import FAILING, FAULTY_BACKEND, PASSING, ROWS, RUN_QUERY

pytestmark = pytest.mark.slow

MATERIALIZATIONS = """
query Materializations($path: [String!]!, $partitions: [String!]) {
  assetOrError(assetKey: {path: $path}) {
    __typename
    ... on Asset {
      assetMaterializations(partitions: $partitions, limit: 50) {
        partition
        runId
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on TextMetadataEntry { text }
          ... on BoolMetadataEntry { boolValue }
        }
      }
    }
  }
}
"""

CHECK_EXECUTIONS = """
query CheckExecutions($path: [String!]!, $check: String!, $partition: String) {
  assetCheckExecutions(assetKey: {path: $path}, checkName: $check, partition: $partition, limit: 20) {
    runId
    status
    partition
    evaluation {
      success
      severity
      description
      partition
      metadataEntries {
        label
        ... on IntMetadataEntry { intValue }
        ... on FloatMetadataEntry { floatValue }
        ... on TextMetadataEntry { text }
      }
    }
  }
}
"""

ASSET_CHECKS = """
query AssetChecks {
  assetNodeOrError(assetKey: {path: ["token_samples"]}) {
    __typename
    ... on AssetNode {
      partitionKeys
      assetChecksOrError { __typename ... on AssetChecks { checks { name blocking } } }
    }
  }
}
"""


def _metadata(entries: list[dict]) -> dict:
    out = {}
    for e in entries:
        for key in ("intValue", "floatValue", "text", "boolValue"):
            if key in e:
                out[e["label"]] = e[key]
    return out


def _materializations(dagster_ui, asset: str) -> dict[str, dict]:
    """partition -> metadata of the materialization made by this session's run of that partition."""
    data = dagster_ui.gql(MATERIALIZATIONS, {"path": [asset], "partitions": [PASSING, FAILING]})["assetOrError"]
    assert data["__typename"] == "Asset", data
    ours = {p: r["runId"] for p, r in dagster_ui.runs.items()}
    return {
        m["partition"]: _metadata(m["metadataEntries"])
        for m in data["assetMaterializations"]
        if ours.get(m["partition"]) == m["runId"]
    }


def _executions(dagster_ui, check: str, partition: str) -> list[dict]:
    return dagster_ui.gql(CHECK_EXECUTIONS, {"path": ["token_samples"], "check": check, "partition": partition})[
        "assetCheckExecutions"
    ]


def _execution_in_run(dagster_ui, check: str, partition: str) -> dict:
    run_id = dagster_ui.runs[partition]["runId"]
    matching = [e for e in _executions(dagster_ui, check, partition) if e["runId"] == run_id]
    assert len(matching) == 1, f"{check}[{partition}]: {matching}"
    return matching[0]


def test_the_code_location_exposes_every_audit_gate_as_a_blocking_partitioned_check(dagster_ui):
    node = dagster_ui.gql(ASSET_CHECKS)["assetNodeOrError"]
    assert node["__typename"] == "AssetNode", node
    assert set(node["partitionKeys"]) == {PASSING, FAILING}  # the datasets of the configuration in force
    checks = node["assetChecksOrError"]
    assert checks["__typename"] == "AssetChecks", checks
    assert {c["name"]: c["blocking"] for c in checks["checks"]} == {g.name: True for g in GATES}


def test_the_clean_dataset_run_succeeds_and_the_over_billed_one_fails_on_its_billing_audit(dagster_ui):
    passing, failing = dagster_ui.runs[PASSING], dagster_ui.runs[FAILING]
    assert passing["status"] == "SUCCESS", dagster_ui.log_tail()
    assert {s["status"] for s in passing["stepStats"]} == {"SUCCESS"}
    assert failing["status"] == "FAILURE", dagster_ui.log_tail()
    steps = {s["stepKey"]: s["status"] for s in failing["stepStats"]}
    # token_samples and its gate checks are one step: the refused audit fails it (the checks say which gate).
    assert steps == {"prompts": "SUCCESS", "responses": "SUCCESS", "token_samples": "FAILURE"}, steps
    for run, partition in ((passing, PASSING), (failing, FAILING)):
        tags = {t["key"]: t["value"] for t in run["tags"]}
        assert tags["dagster/partition"] == partition


def test_the_failed_audit_run_is_not_retried(dagster_ui):
    """dagster.yaml retries runs, but not ones that failed in a step: re-running cannot fix over-billed data."""
    run_id = dagster_ui.runs[FAILING]["runId"]
    deadline = time.monotonic() + 30  # the run worker tags the run right after it fails
    while True:
        tags = {t["key"]: t["value"] for t in dagster_ui.gql(RUN_QUERY, {"runId": run_id})["runOrError"]["tags"]}
        if "dagster/will_retry" in tags or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert tags.get("dagster/will_retry") == "false", tags
    assert tags.get("dagster/failure_reason") == "STEP_FAILURE", tags


@pytest.mark.parametrize("asset", ["prompts", "responses", "token_samples"])
def test_the_refused_dataset_has_no_token_samples_materialization(dagster_ui, asset):
    mats = _materializations(dagster_ui, asset)
    # A blocking audit failure materializes nothing: B6's partition of token_samples is failed, not green.
    assert set(mats) == ({PASSING} if asset == "token_samples" else {PASSING, FAILING}), mats
    for partition, meta in mats.items():
        assert meta["dagster/row_count"] == ROWS, (partition, meta)


def test_responses_record_which_backend_generated_each_dataset(dagster_ui):
    mats = _materializations(dagster_ui, "responses")
    assert mats[PASSING]["backend"] == "simulated"
    assert mats[FAILING]["backend"] == FAULTY_BACKEND
    assert mats[PASSING]["simulated"] is True and mats[FAILING]["simulated"] is True


def test_billing_agreement_passes_for_the_clean_dataset_and_fails_for_the_over_billed_one(dagster_ui):
    ok = _execution_in_run(dagster_ui, "billing_agreement", PASSING)
    assert ok["status"] == "SUCCEEDED" and ok["partition"] == PASSING
    assert ok["evaluation"]["success"] is True
    meta = _metadata(ok["evaluation"]["metadataEntries"])
    assert meta[f"{PASSING}: rows checked"] == ROWS and meta[f"{PASSING}: rows failing"] == 0
    assert ok["evaluation"]["description"].startswith(f"{PASSING}: pass: 0 of {ROWS} rows over the per-row tolerance")

    bad = _execution_in_run(dagster_ui, "billing_agreement", FAILING)
    assert bad["status"] == "FAILED" and bad["partition"] == FAILING
    evaluation = bad["evaluation"]
    assert evaluation["success"] is False
    assert evaluation["severity"] == "ERROR"  # blocking severity, not a warning
    # The description names the dataset and the counts: every row over its tolerance, the aggregate over its bound.
    assert re.fullmatch(
        rf"{FAILING}: FAIL \(blocks\): {ROWS} of {ROWS} rows over the per-row tolerance; aggregate "
        rf"1\d\.\d\d% > 0\.50%; {ROWS} excluded downstream",
        evaluation["description"],
    ), evaluation["description"]
    meta = _metadata(evaluation["metadataEntries"])
    # +15% billed on every response; the numbers are keyed by dataset, so each dataset has its own plot.
    assert meta[f"{FAILING}: rows checked"] == ROWS and meta[f"{FAILING}: rows failing"] == ROWS
    assert meta[f"{FAILING}: failure rate"] == pytest.approx(1.0)
    assert not any(k.startswith(f"{PASSING}:") for k in meta)
    assert meta["dataset"] == FAILING
    # The first failing row, as plain text (no click): its sample id and the two counts that disagree.
    assert re.match(rf"{FAILING}-\S+: len\(output_ids\)=\d+ usage_completion_tokens=\d+", meta["first_failure_example"])

    # Per-partition history: the partition filter returns only that dataset's evaluations.
    assert {e["partition"] for e in _executions(dagster_ui, "billing_agreement", FAILING)} == {FAILING}


@pytest.mark.parametrize("partition", [PASSING, FAILING])
def test_a_passing_gate_passes_for_both_datasets(dagster_ui, partition):
    execution = _execution_in_run(dagster_ui, "ends_with_eot", partition)
    assert execution["status"] == "SUCCEEDED"
    assert execution["evaluation"]["success"] is True
    assert _metadata(execution["evaluation"]["metadataEntries"])[f"{partition}: rows checked"] == ROWS
    assert execution["evaluation"]["description"] == f"{partition}: pass: 0 of {ROWS} rows failing"


def test_every_other_gate_passed_on_the_over_billed_dataset(dagster_ui):
    statuses = {g.name: _execution_in_run(dagster_ui, g.name, FAILING)["status"] for g in GATES}
    assert statuses.pop("billing_agreement") == "FAILED"
    assert set(statuses.values()) == {"SUCCEEDED"}, statuses


def test_the_verdicts_on_disk_match_what_the_ui_shows(dagster_ui):
    """The cross-run merge gate reads these records; they must agree with the check results in the instance."""
    root = DataRoot(dagster_ui.data_root)
    bad = json.loads(gate_record_path(root, FAILING, "billing_agreement").read_text())
    good = json.loads(gate_record_path(root, PASSING, "billing_agreement").read_text())
    assert bad["blocking_failed"] is True and bad["failing"] == ROWS
    assert good["blocking_failed"] is False and good["failing"] == 0


POOLS = """
query Pools {
  instance { concurrencyLimits { concurrencyKey slotCount } }
}
"""


def test_the_gpu_pool_is_listed_with_its_limit_before_any_shard_ran(dagster_ui):
    """The Concurrency page's data: the daemon's `pool_limits` sensor created the pools of pipeline.yaml on its first
    tick, although no step has claimed a `gpu` slot (the dataset runs above claim only `llm_api`)."""
    deadline = time.monotonic() + 120
    while True:
        pools = {p["concurrencyKey"]: p["slotCount"] for p in dagster_ui.gql(POOLS)["instance"]["concurrencyLimits"]}
        if "gpu" in pools or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert pools.get("gpu") == 1, (pools, dagster_ui.log_tail())
    assert pools.get("llm_api", 0) >= 1


# --- The audit view, failure summaries (issue 16, items 1 and 3) ---


def _table(entry: dict) -> list[dict]:
    return [json.loads(r) for r in entry["table"]["records"]]


def test_the_audit_view_marks_the_failing_dataset_unfit_and_the_clean_one_fit(dagster_ui, audit_view):
    meta = audit_view["metadata"]
    assert (
        meta["fit_to_merge"]["text"] == f"1 of 2 datasets fit to merge: {PASSING} yes; {FAILING} NO (billing_agreement)"
    )
    rows = {r["dataset"]: r for r in _table(meta["datasets"])}
    assert rows[PASSING]["fit"] == "yes" and rows[PASSING]["rows"] == ROWS
    assert rows[FAILING]["fit"] == "NO" and rows[FAILING]["excluded"] == ROWS
    assert re.match(rf"billing_agreement: {ROWS} of {ROWS} rows over the per-row tolerance", rows[FAILING]["reason"])
    findings = {(r["dataset"], r["gate"]): r for r in _table(meta["gates_with_findings"])}
    assert set(findings) == {(FAILING, "billing_agreement")}, findings
    assert findings[(FAILING, "billing_agreement")] == {
        "dataset": FAILING,
        "gate": "billing_agreement",
        "action": "block",
        "failing": f"{ROWS} of {ROWS}",
        "verdict": "FAIL (blocks)",
        "excluded": ROWS,
    }
    assert meta[f"first_failure {FAILING}"]["text"].startswith(f"billing_agreement: {FAILING}-")
    assert f"first_failure {PASSING}" not in meta
    # Every column says what it counts.
    for table in ("datasets", "gates_with_findings"):
        assert all(c["description"] for c in meta[table]["table"]["schema"]["columns"]), table
    # Launched by the audit_view sensor, not by a click.
    run = dagster_ui.gql(RUN_QUERY, {"runId": audit_view["runId"]})["runOrError"]
    tags = {t["key"]: t["value"] for t in run["tags"]}
    assert tags.get("eagle/launched_by") == "audit_view_sensor", tags


RUN_EVENTS = """
query RunEvents($runId: ID!) {
  logsForRun(runId: $runId, limit: 2000) {
    __typename
    ... on EventConnection {
      events {
        __typename
        ... on MessageEvent { message level stepKey }
        ... on ExecutionStepFailureEvent { error { message stack } }
      }
    }
  }
}
"""


def _events(dagster_ui, run_id: str) -> list[dict]:
    logs = dagster_ui.gql(RUN_EVENTS, {"runId": run_id})["logsForRun"]
    assert logs["__typename"] == "EventConnection", logs
    return logs["events"]


def test_the_failed_audit_run_says_what_failed_with_the_figures_before_the_traceback(dagster_ui):
    """The failed step's error (which the run page shows, and the run's failure repeats) is the audit's summary."""
    failures = [
        e
        for e in _events(dagster_ui, dagster_ui.runs[FAILING]["runId"])
        if e["__typename"] == "ExecutionStepFailureEvent"
    ]
    assert len(failures) == 1, failures
    message = failures[0]["error"]["message"]
    assert re.search(
        rf"Audit failed: billing_agreement blocks {FAILING}: {ROWS} of {ROWS} rows over the per-row tolerance; aggregate [\d.]+% > 0\.50%",
        message,
    ), message
    assert f"First failing row: {FAILING}-" in message and f"rerun EAGLE_dataset for {FAILING}" in message
    assert "Traceback" not in message and failures[0]["error"]["stack"]  # the stack comes separately, after it


def test_a_refused_merge_starts_with_a_summary_of_what_to_fix(dagster_ui, refused_merge):
    assert refused_merge["status"] == "FAILURE"
    failure = next(
        e for e in _events(dagster_ui, refused_merge["runId"]) if e["__typename"] == "ExecutionStepFailureEvent"
    )
    first_paragraph = failure["error"]["message"].split("\n\n")[0]
    assert re.search(
        rf"Merge refused: 1 of 2 datasets are not fit to merge\. {FAILING}: billing_agreement: {ROWS} of {ROWS} rows "
        r"over the per-row tolerance; aggregate [\d.]+% > 0\.50%",
        first_paragraph,
    ), first_paragraph
    assert "What to do:" in first_paragraph and "rerun EAGLE_dataset" in first_paragraph
