"""The llm_api and gpu pools exist with the configured limits before anything claims a slot, and a limit someone set
on the instance is never overwritten."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.pools import ensure_pool_limits, pool_limits
from eagle_pipeline.defs.resources import PipelineResource

from .conftest import REPO


def _limits(instance) -> dict[str, int]:
    storage = instance.event_log_storage
    return {pool: storage.get_concurrency_info(pool).slot_count for pool in storage.get_concurrency_keys()}


def test_configured_pools_are_created_once_and_never_overwritten(instance):
    assert _limits(instance) == {}
    assert ensure_pool_limits(instance, {"llm_api": 3, "gpu": 8}) == {"llm_api": 3, "gpu": 8}
    assert _limits(instance) == {"llm_api": 3, "gpu": 8}
    instance.event_log_storage.set_concurrency_slots("gpu", 2)  # an operator's change in the UI
    assert ensure_pool_limits(instance, {"llm_api": 5, "gpu": 8}) == {}
    assert _limits(instance) == {"llm_api": 3, "gpu": 2}


def test_the_sensor_creates_the_pools_of_the_configuration(pipeline_config, instance):
    path = pipeline_config()
    raw = yaml.safe_load(path.read_text())
    raw["pools"] = {"llm_api": 2, "gpu": 4}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    sensor = build_defs().resolve_sensor_def("pool_limits")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING  # a fresh deployment's daemon runs it
    # Contexts as context managers: an unclosed one leaves Dagster's current defs-state storage on a dead instance.
    with dg.build_sensor_context(instance=instance, resources={"pipeline": PipelineResource()}) as ctx:
        first = pool_limits(ctx)
    assert isinstance(first, dg.SkipReason) and "created pools" in first.skip_message
    assert _limits(instance) == {"llm_api": 2, "gpu": 4}
    with dg.build_sensor_context(instance=instance, resources={"pipeline": PipelineResource()}) as ctx:
        again = pool_limits(ctx)
    assert "every pool has a limit" in again.skip_message


def test_make_ui_entry_point_creates_the_pools_in_dagster_home(pipeline_config, tmp_path):
    pipeline_config()
    home = tmp_path / "ui_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    cmd = [sys.executable, "-m", "eagle_pipeline.defs.pools"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "llm_api" in out.stdout and "gpu" in out.stdout
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert _limits(instance) == {"llm_api": 4, "gpu": 1}  # pipeline.yaml's defaults
