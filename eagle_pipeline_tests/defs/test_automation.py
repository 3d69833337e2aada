"""Scheduled resumes and the merge's automation gate, evaluated against a real temporary instance."""

import datetime

import dagster as dg
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.jobs import resume_incomplete_datasets
from eagle_pipeline.defs.partitions import dataset_partitions
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.shared.storage import DataRoot

pytestmark = pytest.mark.slow


def _schedule_requests(instance):
    # As a context manager: the context opens an instance for the resources, and only its exit closes it (an
    # unclosed one leaves Dagster's current defs-state storage pointing at a dead instance for later tests).
    with dg.build_schedule_context(
        instance=instance,
        scheduled_execution_time=datetime.datetime(2026, 11, 29, 6, 0),
        resources={"pipeline": PipelineResource()},
    ) as ctx:
        result = resume_incomplete_datasets(ctx)
    if isinstance(result, dg.SkipReason):
        return []
    return sorted(r.partition_key for r in result)


def test_schedule_resumes_only_incomplete_datasets(pipeline_config, instance, tmp_path):
    pipeline_config(datasets=("B1", "B6"), limit=3)
    defs = build_defs()
    assert _schedule_requests(instance) == ["B1", "B6"]
    assert defs.resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B1").success
    assert _schedule_requests(instance) == ["B6"]
    # A response shard lost (say, a crash before the rest was committed): B1 is incomplete again.
    root = DataRoot(tmp_path / "data")
    next(root.responses_dir("B1").glob("part-*.parquet")).unlink()
    assert _schedule_requests(instance) == ["B1", "B6"]
    assert defs.resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B1").success
    assert defs.resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B6").success
    with dg.build_schedule_context(instance=instance, resources={"pipeline": PipelineResource()}) as ctx:
        assert isinstance(resume_incomplete_datasets(ctx), dg.SkipReason)


def _config_with_faulty_backend(path, faulty: set[str]):
    raw = yaml.safe_load(path.read_text())
    raw["backends"]["faulty"] = {**raw["backends"]["simulated"], "simulated": {"faults": {"billing_mismatch": 1.0}}}
    for d in raw["datasets"]:
        d["backend"] = "faulty" if d["name"] in faulty else "simulated"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_merge_automation_waits_for_every_dataset_audit(pipeline_config, instance):
    names = dataset_partitions.get_partition_keys()
    path = pipeline_config(datasets=tuple(names), limit=2)
    _config_with_faulty_backend(path, {"B6"})
    defs = build_defs()
    merged = dg.AssetKey("merged_dataset")
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    job = defs.resolve_job_def("EAGLE_dataset")
    outcomes = {
        ds: job.execute_in_process(instance=instance, partition_key=ds, raise_on_error=False).success for ds in names
    }
    assert outcomes == {ds: ds != "B6" for ds in names}
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(merged) == 0  # seven datasets passed, one failed: the merge waits

    _config_with_faulty_backend(path, set())
    import shutil

    shutil.rmtree(DataRoot(yaml.safe_load(path.read_text())["data_root"]).responses_dir("B6"))
    assert job.execute_in_process(instance=instance, partition_key="B6").success
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(merged) == 1
    # Stages below the merge wait for it, then follow once its own blocking checks passed.
    for key in ("draft_vocab", "hidden_state_plan"):
        assert tick.get_num_requested(dg.AssetKey(key)) == 0
    assert defs.resolve_job_def("EAGLE_merge").execute_in_process(instance=instance).success  # merge, vocab, plan
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    shards = instance.get_dynamic_partitions("hidden_state_shards")
    assert len(shards) >= 2
    assert tick.get_num_requested(dg.AssetKey("hidden_states")) == len(shards)  # every shard follows
    assert tick.get_num_requested(dg.AssetKey("trainer_exports")) == 0  # waits for the shards


def _view_metadata(instance) -> dict:
    record = instance.fetch_materializations(dg.AssetKey("audit_overview"), limit=1).records[0]
    return record.asset_materialization.metadata


def test_the_audit_view_follows_every_dataset_audit_without_a_click(pipeline_config, instance):
    """audit_overview's condition (run by the audit_view sensor, on from the start) asks for a refresh after a
    dataset's run, once, and again after a later audit of another dataset or a rerun of the checks alone."""
    from eagle_pipeline.defs.automation import audit_view_sensor
    from eagle_pipeline.defs.generation import prompts
    from eagle_pipeline.defs.tokens import token_samples

    assert audit_view_sensor.default_status == dg.DefaultSensorStatus.RUNNING
    path = pipeline_config(datasets=("B1", "B6"), limit=2)
    _config_with_faulty_backend(path, {"B6"})
    checks_only = dg.define_asset_job(
        "checks_only", selection=dg.AssetSelection.checks_for_assets(token_samples) | dg.AssetSelection.assets(prompts)
    )
    defs = dg.Definitions.merge(build_defs(), dg.Definitions(jobs=[checks_only]))
    view = dg.AssetKey("audit_overview")
    refresh = defs.resolve_job_def("EAGLE_audit_view")  # what `make demo` runs; the sensor's runs do the same
    job = defs.resolve_job_def("EAGLE_dataset")

    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    assert tick.get_num_requested(view) == 0  # nothing audited yet
    assert job.execute_in_process(instance=instance, partition_key="B1").success
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(view) == 1
    assert refresh.execute_in_process(instance=instance).success
    assert _view_metadata(instance)["fit_to_merge"].value == (
        "1 of 2 datasets fit to merge: B1 yes; B6 NO (token samples not materialized)"
    )
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(view) == 0  # refreshed: nothing new

    assert not job.execute_in_process(instance=instance, partition_key="B6", raise_on_error=False).success
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(view) == 1  # the failed run's audit counts too
    assert refresh.execute_in_process(instance=instance).success
    meta = _view_metadata(instance)
    assert meta["fit_to_merge"].value == "1 of 2 datasets fit to merge: B1 yes; B6 NO (billing_agreement)"
    assert meta["datasets not fit to merge"].value == 1
    assert meta["first_failure B6"].value.startswith("billing_agreement: B6-")
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(view) == 0

    # The checks alone, run again (say, after a settings change): the view follows them as well.
    assert defs.resolve_job_def("checks_only").execute_in_process(instance=instance, partition_key="B1").success
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(view) == 1
