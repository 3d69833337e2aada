"""The production-style instance for real: Dagster on PostgreSQL (deploy/single-host/dagster.yaml), with several
dataset runs and shard runs at once from separate processes, the pools, the cross-run merge gate and the schedule
behaving as they do on the embedded SQLite instance.

Needs a PostgreSQL server: `.ci/run` starts one on loopback (scripts/postgres_for_tests.sh) and exports
EAGLE_TEST_POSTGRES_URL; without it these tests skip, visibly, with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME

from .test_automation import _schedule_requests
from .test_scale_out import SHARD_SIZE, _config, _merged, _slot_window

REPO = Path(__file__).resolve().parents[2]
SINGLE_HOST = REPO / "deploy" / "single-host" / "dagster.yaml"
URL_ENV = "EAGLE_TEST_POSTGRES_URL"

pytestmark = pytest.mark.slow


@pytest.fixture
def pg_home(tmp_path, monkeypatch):
    """A DAGSTER_HOME holding deploy/single-host/dagster.yaml as shipped, on a fresh database of its own."""
    psycopg2 = pytest.importorskip("psycopg2")
    url = os.environ.get(URL_ENV)
    if not url:
        pytest.skip(f"no PostgreSQL server: set {URL_ENV} (.ci/run starts one with scripts/postgres_for_tests.sh)")
    try:
        admin = psycopg2.connect(url, connect_timeout=5)
    except psycopg2.OperationalError as e:
        pytest.skip(f"PostgreSQL in {URL_ENV} is not reachable: {e}")
    admin.autocommit = True
    db = f"eagle_test_{uuid.uuid4().hex[:12]}"
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{db}"')
    base = url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://", 1)
    monkeypatch.setenv("EAGLE_DAGSTER_PG_URL", f"{base}/{db}")
    home = tmp_path / "pg_home"
    home.mkdir()
    shutil.copy(SINGLE_HOST, home / "dagster.yaml")
    try:
        yield home
    finally:
        with admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))
            cur.execute(f'DROP DATABASE IF EXISTS "{db}"')
        admin.close()


@pytest.fixture
def pg_instance(pg_home):
    """The instance the shipped file describes, entered (as `dagster` itself does) for the test's duration."""
    with dg.DagsterInstance.from_config(str(pg_home)) as instance:
        # Every storage is on PostgreSQL: nothing falls back to SQLite files in the home.
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        yield instance


def _launch(home: Path, job: str, partition: str, *extra: str) -> subprocess.Popen:
    """One run in its own process, as the run launcher starts it: `dagster job execute` against the instance."""
    env = {**os.environ, "DAGSTER_HOME": str(home), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "dagster"), "job", "execute", "-m", "eagle_pipeline.definitions"]
    cmd += ["-j", job, *extra, "--tags", json.dumps({"dagster/partition": partition})]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _step_window(instance, run_id, step_key):
    """From the step's start (its pool slot claimed) to its end (the slot freed), in the in-process executor."""
    records = [r for r in instance.all_logs(run_id) if r.step_key == step_key]
    start = next(r.timestamp for r in records if r.dagster_event_type == dg.DagsterEventType.STEP_START)
    end = next(
        r.timestamp
        for r in records
        if r.dagster_event_type in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE)
    )
    return start, end


def test_concurrent_dataset_runs_pools_merge_gate_and_schedule_on_postgres(pg_home, pg_instance, pipeline_config):
    # Each request takes 2 s, so the two runs, launched together, want the API at the same time.
    path = pipeline_config(datasets=("B1", "B6"), limit=3, simulated={"latency_s": 2.0})
    raw = yaml.safe_load(path.read_text())
    # B6 comes from a provider that over-bills: its audit fails and must keep the merge from running.
    raw["backends"]["faulty"] = {**raw["backends"]["simulated"], "simulated": {"faults": {"billing_mismatch": 1.0}}}
    for d in raw["datasets"]:
        d["backend"] = "faulty" if d["name"] == "B6" else "simulated"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))

    instance = pg_instance
    instance.event_log_storage.set_concurrency_slots("llm_api", 1)  # one dataset generates at a time
    # The reference: the same evaluation on an embedded (non-PostgreSQL) instance. Not `instance_for_test`: entering
    # a second instance would swap Dagster's current definitions-state storage under this test.
    embedded = dg.DagsterInstance.ephemeral()
    assert _schedule_requests(instance) == _schedule_requests(embedded) == ["B1", "B6"]

    procs = {ds: _launch(pg_home, "EAGLE_dataset", ds) for ds in ("B1", "B6")}
    outputs = {ds: p.communicate(timeout=300)[0] for ds, p in procs.items()}
    runs = {r.tags["dagster/partition"]: r for r in instance.get_runs() if r.job_name == "EAGLE_dataset"}
    assert set(runs) == {"B1", "B6"}, outputs
    assert runs["B1"].status == dg.DagsterRunStatus.SUCCESS, outputs["B1"][-3000:]
    assert runs["B6"].status == dg.DagsterRunStatus.FAILURE, outputs["B6"][-3000:]  # the blocking audit check

    # The llm_api pool of one held the two generation steps apart, across processes, through PostgreSQL.
    first, second = sorted(runs.values(), key=lambda r: _step_window(instance, r.run_id, "responses"))
    (a0, a1), (b0, b1) = (_step_window(instance, r.run_id, "responses") for r in (first, second))
    assert a1 <= b0, ((a0, a1), (b0, b1))
    # ... and it was the pool that did it: the second run's step waited for the slot while the first generated.
    waits = [
        rec.timestamp
        for rec in instance.all_logs(second.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
        if rec.step_key == "responses" and "blocked by limit for pool llm_api" in (rec.message or "")
    ]
    assert waits and a0 <= waits[0] < a1, (waits, (a0, a1))
    pool = instance.event_log_storage.get_concurrency_info("llm_api")
    assert pool.slot_count == 1 and not pool.claimed_slots

    # The audit verdicts are in PostgreSQL's event log: B6's billing check failed (on a run that materialized
    # nothing: the refusal fails the partition), B1's passed on B1's materialization.
    evaluations = [
        rec.dagster_event.event_specific_data
        for r in runs.values()
        for rec in instance.all_logs(r.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    ]
    checks = {(e.target_materialization_data is not None, e.check_name, e.passed) for e in evaluations}
    assert (False, "billing_agreement", False) in checks and (True, "billing_agreement", True) in checks

    # A merge launched later, in another run, refuses: the cross-run gate reads the verdicts B6's run left.
    merge = build_defs().resolve_job_def("EAGLE_merge").execute_in_process(instance=instance, raise_on_error=False)
    assert not merge.success
    message = next(e for e in merge.all_events if e.is_step_failure).event_specific_data.error.message
    assert "B6/billing_agreement" in message and "blocking audit failed" in message

    # The schedule decides from the same state as it would on SQLite.
    assert _schedule_requests(instance) == _schedule_requests(embedded)


def test_shard_runs_in_parallel_share_the_gpu_pool_on_postgres(pg_home, pg_instance, tmp_path, monkeypatch):
    _config(tmp_path, monkeypatch)
    instance = pg_instance
    _merged(tmp_path, instance, n_rows=2 * SHARD_SIZE)
    instance.event_log_storage.set_concurrency_slots("gpu", 2)
    keys = instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME)
    assert len(keys) == 2
    procs = {key: _launch(pg_home, "EAGLE_hidden_states", key, "-o", "hidden_states") for key in keys}
    outputs = {key: p.communicate(timeout=300)[0] for key, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), {k: o[-3000:] for k, o in outputs.items()}
    runs = {r.tags["dagster/partition"]: r for r in instance.get_runs() if r.job_name == "EAGLE_hidden_states"}
    assert {k: r.status for k, r in runs.items()} == dict.fromkeys(keys, dg.DagsterRunStatus.SUCCESS)
    (s0, e0), (s1, e1) = (_slot_window(instance, runs[k].run_id, "hidden_states") for k in keys)
    assert s0 < e1 and s1 < e0  # a pool of two: both shards extracted at once
    gpu = instance.event_log_storage.get_concurrency_info("gpu")
    assert gpu.slot_count == 2 and not gpu.claimed_slots
