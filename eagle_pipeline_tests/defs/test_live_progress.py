"""Live progress through real Dagster runs: observations of the running partition, and the run's progress tag."""

from __future__ import annotations

import dagster as dg
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME
from eagle_pipeline.defs.progress import PROGRESS_TAG

pytestmark = pytest.mark.slow

# Keys an observation and the final materialization share, with the same meaning: at the end they must agree.
SHARED_KEYS = (
    "current_prompts",
    "current_prompts_answered",
    "current_prompts_missing",
    "already_done",
    "completed_this_run",
    "response_rows",
    "failed_this_run",
    "spend_usd_this_run",
    "spend_usd_ledger",
)


def _slow_config(pipeline_config, *, limit: int, faults: dict | None = None) -> None:
    """One dataset on a simulated server answering in 0.25 s, one request at a time, progress every 0.2 s."""
    path = pipeline_config(datasets=("B1",), limit=limit, simulated={"latency_s": 0.25, "faults": faults or {}})
    cfg = yaml.safe_load(path.read_text())
    cfg["backends"]["simulated"].update(concurrency=1, max_retries=0)
    cfg["generation"]["progress_every_s"] = 0.2
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _observations(instance, partition: str) -> list[dict]:
    records = instance.fetch_observations(dg.AssetKey("responses"), limit=1000, ascending=True).records
    events = [r.asset_observation for r in records]
    assert all(e.partition == partition for e in events), [e.partition for e in events]
    return [{k: v.value for k, v in e.metadata.items()} for e in events]


def _latest_materialization(instance) -> dict:
    record = instance.fetch_materializations(dg.AssetKey("responses"), limit=1).records[0]
    return {k: v.value for k, v in record.asset_materialization.metadata.items()}


def test_generation_observes_its_partition_while_it_runs(pipeline_config, instance):
    _slow_config(pipeline_config, limit=6)
    defs = build_defs()
    result = defs.resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B1")
    assert result.success

    seen = _observations(instance, "B1")
    answered = [o["current_prompts_answered"] for o in seen]
    # ~1.5 s of requests reported every 0.2 s: several reports, each at least as far as the one before.
    assert len(seen) >= 4, answered
    assert answered == sorted(answered) and answered[-1] == 6 and len(set(answered)) >= 3, answered
    assert all(o["current_prompts"] == 6 and o["already_done"] == 0 for o in seen)
    spends = [o["spend_usd_this_run"] for o in seen]
    assert spends == sorted(spends) and spends[-1] > 0
    assert any("eta_s" in o and o["eta_s"] > 0 for o in seen[:-1])
    assert seen[-1]["percent_done"] == 100.0 and seen[-1]["rate_per_s"] > 0

    final = _latest_materialization(instance)
    assert {k: seen[-1][k] for k in SHARED_KEYS} == {k: final[k] for k in SHARED_KEYS}
    tag = instance.get_run_by_id(result.run_id).tags[PROGRESS_TAG]
    assert tag.startswith("B1 6/6 (100%) ") and tag.endswith(" 0 failed"), tag


def test_a_resumed_run_counts_earlier_rows_and_reports_failures_by_class(pipeline_config, instance):
    _slow_config(pipeline_config, limit=3)
    defs = build_defs()
    assert defs.resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B1").success
    first_ledger = _latest_materialization(instance)["spend_usd_ledger"]

    # Three more prompts; the step's new server answers the first request, then fails every one (HTTP 500, no retry).
    _slow_config(pipeline_config, limit=6, faults={"after_requests": {"http_500": 1}})
    defs = build_defs()
    result = defs.resolve_job_def("EAGLE_dataset").execute_in_process(
        instance=instance, partition_key="B1", raise_on_error=False
    )
    seen = _observations(instance, "B1")
    second = [o for o in seen if o["already_done"] == 3]
    assert len(second) >= 2 and len(second) < len(seen), [o["already_done"] for o in seen]
    last = second[-1]
    assert (last["current_prompts"], last["current_prompts_answered"], last["completed_this_run"]) == (6, 4, 1)
    assert (last["failed_this_run"], last["errors_by_class_this_run"]) == (2, {"server_error": 2}), last
    assert last["spend_usd_ledger"] == pytest.approx(first_ledger + last["spend_usd_this_run"], abs=1e-6)
    assert last["spend_usd_this_run"] > 0
    # The failed requests do not stop the dataset: the step materializes what it has, with the same figures.
    assert "responses" in {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    final = _latest_materialization(instance)
    assert {k: last[k] for k in (*SHARED_KEYS, "errors_by_class_this_run")} == {
        k: final[k] for k in (*SHARED_KEYS, "errors_by_class_this_run")
    }


def test_a_shard_run_observes_its_partition_with_rows_and_tokens(pipeline_config, instance):
    path = pipeline_config(datasets=("B1",), limit=6)
    cfg = yaml.safe_load(path.read_text())
    # One batch per row or two, and a report after each.
    cfg["hidden_states"].update(max_tokens_per_batch=64, progress_every_s=0)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    defs = build_defs()
    assert defs.resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B1").success
    assert defs.resolve_job_def("EAGLE_merge").execute_in_process(instance=instance).success
    shard = sorted(instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME))[0]
    result = defs.resolve_job_def("EAGLE_hidden_states").execute_in_process(instance=instance, partition_key=shard)
    assert result.success

    records = instance.fetch_observations(dg.AssetKey("hidden_states"), limit=100, ascending=True).records
    seen = [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in records]
    assert all(r.asset_observation.partition == shard for r in records)
    assert len(seen) >= 2, seen
    for key in ("rows_done", "tokens_done"):
        values = [o[key] for o in seen]
        assert values == sorted(values) and len(set(values)) == len(values), (key, values)
    final = instance.fetch_materializations(dg.AssetKey("hidden_states"), limit=1).records[0]
    meta = {k: v.value for k, v in final.asset_materialization.metadata.items()}
    last = seen[-1]
    assert (last["rows_done"], last["rows_total"]) == (meta["dagster/row_count"],) * 2
    assert (last["tokens_done"], last["tokens_total"]) == (meta["tokens"],) * 2
    assert last["percent_done"] == 100.0 and last["tokens_per_s"] > 0
    tag = instance.get_run_by_id(result.run_id).tags[PROGRESS_TAG]
    rows = meta["dagster/row_count"]
    assert tag.startswith(f"shard {int(shard):05d} {rows}/{rows} rows (100%) "), tag
