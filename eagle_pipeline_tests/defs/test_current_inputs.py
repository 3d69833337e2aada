"""Assets are functions of the current settings: a lower limit or another seed never brings old responses into the
token samples, the schedule judges completeness by current sample ids, and a bad provider's rows can be retired
(archived, spend still counted) through the CLI and a Dagster job. Real Dagster runs on a temporary instance."""

from __future__ import annotations

import datetime

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_pipeline.audit.overview import dataset_overview
from eagle_pipeline.cli import main as cli_main
from eagle_pipeline.config import load_config
from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.jobs import resume_incomplete_datasets
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.generation.spend.budget import pipeline_budget
from eagle_pipeline.generation.store.coverage import response_overview
from eagle_pipeline.generation.store.shards import committed_sample_ids, read_responses
from eagle_pipeline.shared.storage import DataRoot

pytestmark = pytest.mark.slow


def _edit(path, **dataset_keys):
    raw = yaml.safe_load(path.read_text())
    raw["backends"]["broke"] = {**raw["backends"]["simulated"], "simulated": {"faults": {"http_402": 1.0}}}
    raw["backends"]["overbiller"] = {
        **raw["backends"]["simulated"],
        "simulated": {"provider_name": "Overbiller", "faults": {"billing_mismatch": 1.0}},
    }
    for d in raw["datasets"]:
        d.update(dataset_keys)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def _run(defs, instance, job="EAGLE_dataset", partition_key="B1", **kw):
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, partition_key=partition_key, raise_on_error=False, **kw
    )


def _token_meta(instance):
    rec = instance.fetch_materializations(dg.AssetKey("token_samples"), limit=1).records[0]
    return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def _checks(result):
    return {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}


def _tick(instance):
    with dg.build_schedule_context(
        instance=instance,
        scheduled_execution_time=datetime.datetime(2026, 12, 1, 6, 0),
        resources={"pipeline": PipelineResource()},
    ) as ctx:
        return resume_incomplete_datasets(ctx)


def _schedule(instance):
    result = _tick(instance)
    return result.skip_message if isinstance(result, dg.SkipReason) else sorted(r.partition_key for r in result)


def test_a_lower_limit_and_another_seed_never_bring_old_responses_into_token_samples(
    pipeline_config, instance, tmp_path
):
    path = pipeline_config(datasets=("B1",), limit=4)
    defs = build_defs()
    root = DataRoot(tmp_path / "data")
    assert _run(defs, instance).success
    assert pq.read_table(root.tokens("B1")).num_rows == 4

    _edit(path, limit=2)
    assert _schedule(instance) == ["B1"]  # the token samples on disk are not those of the current prompts
    assert _run(defs, instance).success
    prompt_ids = set(pq.read_table(root.prompts("B1")).column("sample_id").to_pylist())
    tokens = pq.read_table(root.tokens("B1"))
    assert tokens.num_rows == 2 and set(tokens.column("sample_id").to_pylist()) == prompt_ids
    meta = _token_meta(instance)
    assert (meta["current_prompts"], meta["current_prompts_answered"], meta["rows_answering_other_prompts"]) == (
        2,
        2,
        2,
    )
    assert read_responses(root.responses_dir("B1")).num_rows == 4  # kept on disk, never merged
    [overview] = dataset_overview(root, ["B1"], responses={"B1": response_overview(root, "B1")})  # as the merge's
    assert (overview["responses"], overview["other_prompt_rows"], overview["token_samples"]) == (2, 2, 2)
    assert "every dataset is complete" in _schedule(instance)

    _edit(path, limit=4, sampling={"seed": 1})
    assert _run(defs, instance).success
    prompt_ids = set(pq.read_table(root.prompts("B1")).column("sample_id").to_pylist())
    tokens = pq.read_table(root.tokens("B1"))
    assert tokens.num_rows == 4 and set(tokens.column("sample_id").to_pylist()) == prompt_ids
    assert _token_meta(instance)["rows_answering_other_prompts"] == 4
    assert read_responses(root.responses_dir("B1")).num_rows == 8


def _responses_meta(instance):
    rec = instance.fetch_materializations(dg.AssetKey("responses"), limit=1).records[0]
    return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def _data_version(instance, key: str) -> str:
    rec = instance.get_latest_data_version_record(dg.AssetKey(key), partition_key="B1")
    return rec.asset_materialization.tags["dagster/data_version"]


def test_the_configured_answer_log_interval_reaches_the_runner_and_invalidates_nothing(pipeline_config, instance):
    """generation.answer_log_s is the interval of the run's answer log, and a backend's stream_processes the number
    of worker processes its streams are read in; changing them changes what a kill can lose and where the CPU is
    spent, not the rows: the next run requests nothing, the prompts stay the same version and the token samples the
    same rows (each token_samples file carries its run id, so its own version is new on every run)."""
    path = pipeline_config(datasets=("B1",), limit=4)
    raw = yaml.safe_load(path.read_text())
    raw["generation"]["answer_log_s"] = 0.02
    raw["backends"]["simulated"].update(stream=True, stream_processes=1)  # streamed, through a worker process
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    defs = build_defs()
    assert _run(defs, instance).success
    meta = _responses_meta(instance)
    assert meta["answer_log_s"] == 0.02 and meta["completed_this_run"] == 4
    prompts_version = _data_version(instance, "prompts")
    tokens = pq.read_table(DataRoot(load_config(path).data_root).tokens("B1"))
    responses = read_responses(DataRoot(load_config(path).data_root).responses_dir("B1"))
    assert all(n and n > 1 for n in responses.column("stream_chunks").to_pylist())

    raw["generation"]["answer_log_s"] = 0.5
    raw["backends"]["simulated"]["stream_processes"] = 0
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert _run(defs, instance).success
    meta = _responses_meta(instance)
    assert meta["answer_log_s"] == 0.5
    assert (meta["requested_this_run"], meta["already_done"], meta["current_prompts_answered"]) == (0, 4, 4)
    assert pq.read_table(DataRoot(load_config(path).data_root).tokens("B1")).equals(tokens)  # schema metadata aside
    assert _data_version(instance, "prompts") == prompts_version


def test_an_overbilling_providers_rows_under_an_old_seed_never_reach_the_audit(pipeline_config, instance, tmp_path):
    path = pipeline_config(datasets=("B1",), limit=4)
    _edit(path, backend="overbiller")
    defs = build_defs()
    assert _checks(_run(defs, instance))["billing_agreement"] is False
    _edit(path, backend="simulated", sampling={"seed": 1})  # new prompts, answered by a good backend
    result = _run(defs, instance)
    assert result.success and _checks(result)["billing_agreement"] is True
    tokens = pq.read_table(DataRoot(tmp_path / "data").tokens("B1"))
    assert tokens.num_rows == 4 and set(tokens.column("provider").to_pylist()) == {"Simulated"}
    assert _token_meta(instance)["rows_answering_other_prompts"] == 4


def test_schedule_and_stop_message_count_current_sample_ids_not_rows(pipeline_config, instance):
    path = pipeline_config(datasets=("B1",), limit=4)
    defs = build_defs()
    assert _run(defs, instance).success
    assert "every dataset is complete" in _schedule(instance)

    _edit(path, sampling={"seed": 1}, backend="broke")
    assert _schedule(instance) == ["B1"]  # the configuration asks for other prompts: incomplete before any run
    result = _run(defs, instance)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.event_specific_data.error.message
    assert failure.step_key == "responses" and "stopped early (credits)" in message
    assert "0/4 current prompts answered (4 committed rows answer other prompts" in message
    assert "4/4" not in message
    [request] = _tick(instance)
    assert request.partition_key == "B1" and request.tags["eagle/resume_reason"] == (
        "0/4 current prompts answered (4 committed rows answer other prompts: kept on disk, not used)"
    )
    meta = failure.event_specific_data.user_failure_data.metadata
    assert (meta["current_prompts"].value, meta["current_prompts_answered"].value) == (4, 0)
    assert meta["rows_answering_other_prompts"].value == 4


def test_an_overbilling_providers_rows_keep_failing_until_retired_and_their_spend_stays_counted(
    pipeline_config, instance, tmp_path, capsys
):
    path = pipeline_config(datasets=("B1",), limit=3)
    _edit(path, backend="overbiller")
    defs = build_defs()
    root = DataRoot(tmp_path / "data")
    assert _checks(_run(defs, instance))["billing_agreement"] is False

    _edit(path, backend="simulated")  # a good backend: every prompt is answered already, nothing is requested
    assert _checks(_run(defs, instance))["billing_agreement"] is False
    _, spend_before = committed_sample_ids(root.responses_dir("B1"))
    assert spend_before > 0

    # A provider name that matches nothing is refused, naming what is on disk.
    assert cli_main(["retire-responses", "--dataset", "B1", "--provider", "Nobody", "--config", str(path)]) == 2
    assert "backend=overbiller provider=Overbiller" in capsys.readouterr().err
    assert cli_main(["retire-responses", "--dataset", "B1", "--provider", "Overbiller", "--config", str(path)]) == 0
    assert "retired 3 rows" in capsys.readouterr().out
    assert read_responses(root.responses_dir("B1")).num_rows == 0
    [archive] = list((root.responses_dir("B1") / "retired").iterdir())
    assert sum(pq.read_metadata(p).num_rows for p in archive.glob("part-*.parquet")) == 3
    assert committed_sample_ids(root.responses_dir("B1"))[1] == pytest.approx(spend_before, rel=1e-12)

    result = _run(defs, instance)
    assert result.success and all(_checks(result).values())
    assert set(read_responses(root.responses_dir("B1")).column("provider").to_pylist()) == {"Simulated"}
    ledger = committed_sample_ids(root.responses_dir("B1"))[1]
    assert ledger > spend_before
    raw = yaml.safe_load(path.read_text())
    raw["generation"]["budget_usd"] = 100.0
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(path)
    budget = pipeline_budget(cfg.generation.budget_usd, [root.responses_dir(ds) for ds in cfg.dataset_names])
    assert budget.spent_usd == pytest.approx(ledger, rel=1e-12)

    # The same through the Dagster job: retire the good backend's rows, and the dataset is incomplete again.
    job_result = defs.resolve_job_def("EAGLE_retire_responses").execute_in_process(
        instance=instance,
        run_config={"ops": {"retire_responses_op": {"config": {"dataset": "B1", "backend": "simulated"}}}},
        raise_on_error=False,
    )
    assert job_result.success
    summary = job_result.output_for_node("retire_responses_op")
    assert summary["rows_retired"] == 3 and summary["by_backend_provider"] == {"simulated/Simulated": 3}
    assert len(list((root.responses_dir("B1") / "retired").iterdir())) == 2
    assert committed_sample_ids(root.responses_dir("B1"))[1] == pytest.approx(ledger, rel=1e-12)
    assert _schedule(instance) == ["B1"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_simulated_dataset_switched_to_a_real_backend_keeps_none_of_its_simulated_rows(
    pipeline_config, instance, tmp_path, monkeypatch
):
    """quickstart.md §3: copy pipeline.yaml, set `backend: openrouter`, keep limit and max_tokens. The simulated
    answers on disk must not count as the real backend's: the dataset is not reported answered, and the merge
    (which passed on them before) refuses to use them."""
    path = pipeline_config(datasets=("B1",), limit=4)
    defs = build_defs()
    root = DataRoot(tmp_path / "data")
    assert _run(defs, instance).success
    assert _run(defs, instance, job="EAGLE_merge", partition_key=None).success

    raw = yaml.safe_load(path.read_text())
    # A real backend that cannot be reached (nothing listens on the port): every request fails at once.
    endpoint = f"http://127.0.0.1:{_free_port()}/api/v1"
    raw["backends"]["openrouter"].update(endpoint=endpoint, max_retries=0, timeout_s=5)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    _edit(path, backend="openrouter")
    monkeypatch.setenv("OPENROUTER_API_KEY", "test-key-not-a-secret")
    assert _schedule(instance) == ["B1"]  # incomplete before any run: the stored rows are another backend's
    result = _run(defs, instance)
    assert not result.success
    # The simulated answers were not taken as the real backend's: the run asked the real one, found it unreachable
    # at once, and its failure says that none of the current prompts is answered and why the stored rows do not count.
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.event_specific_data.error.message
    assert failure.step_key == "responses" and "generation stopped early (unreachable)" in message
    assert "0/4 current prompts answered" in message
    assert "4 row(s) from simulated moonshotai/kimi-k2.5 at loopback" in message and "kind: simulated" in message

    merge = _run(defs, instance, job="EAGLE_merge", partition_key=None)
    assert not merge.success
    refusal = next(e for e in merge.all_events if e.is_step_failure).event_specific_data.error.message
    assert "B1/responses: 4 of 4 token samples were built from rows that no longer count" in refusal
    assert read_responses(root.responses_dir("B1")).num_rows == 4  # kept on disk, never merged


def test_switching_to_the_real_tokenizer_regenerates_the_simulated_rows_and_every_audit_passes(
    pipeline_config, instance, tmp_path, kimi_dir
):
    """`make demo`, then EAGLE_KIMI_TOKENIZER_DIR, then `make demo`: the simulated answers' usage was counted with
    the demo tokenizer, so the real one's billing audit would refuse them; they are free, and are asked again."""
    path = pipeline_config(datasets=("B1", "B6"), limit=4)
    raw = yaml.safe_load(path.read_text())
    raw["target"]["tokenizer"] = "demo"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    defs = build_defs()
    root = DataRoot(tmp_path / "data")
    for ds in ("B1", "B6"):
        assert _run(defs, instance, partition_key=ds).success

    raw["target"]["tokenizer"] = str(kimi_dir)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert _schedule(instance) == ["B1", "B6"]
    for ds in ("B1", "B6"):
        result = _run(defs, instance, partition_key=ds)
        checks = _checks(result)
        assert result.success and checks and all(checks.values()), (ds, checks)
        assert _responses_meta(instance)["requested_this_run"] == 4
        assert read_responses(root.responses_dir(ds)).num_rows == 8  # the demo tokenizer's rows stay on disk
    assert _run(defs, instance, job="EAGLE_merge", partition_key=None).success
    assert "every dataset is complete" in _schedule(instance)
