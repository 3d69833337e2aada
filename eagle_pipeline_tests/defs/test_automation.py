"""Scheduled resumes and the merge's automation gate, evaluated against a real temporary instance."""

import datetime

import dagster as dg
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.jobs import resume_incomplete_datasets
from eagle_pipeline.defs.partitions import dataset_partitions
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.storage import DataRoot

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
    assert defs.resolve_job_def("dataset_job").execute_in_process(instance=instance, partition_key="B1").success
    assert _schedule_requests(instance) == ["B6"]
    # A response shard lost (say, a crash before the rest was committed): B1 is incomplete again.
    root = DataRoot(tmp_path / "data")
    next(root.responses_dir("B1").glob("part-*.parquet")).unlink()
    assert _schedule_requests(instance) == ["B1", "B6"]
    assert defs.resolve_job_def("dataset_job").execute_in_process(instance=instance, partition_key="B1").success
    assert defs.resolve_job_def("dataset_job").execute_in_process(instance=instance, partition_key="B6").success
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
    job = defs.resolve_job_def("dataset_job")
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
    assert defs.resolve_job_def("merge_job").execute_in_process(instance=instance).success  # merge, vocab, plan
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    shards = instance.get_dynamic_partitions("hidden_state_shards")
    assert len(shards) >= 2
    assert tick.get_num_requested(dg.AssetKey("hidden_states")) == len(shards)  # every shard follows
    assert tick.get_num_requested(dg.AssetKey("trainer_exports")) == 0  # waits for the shards
