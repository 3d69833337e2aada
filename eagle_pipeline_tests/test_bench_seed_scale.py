"""The seed-scale rehearsal (benchmarks/bench_seed_scale.py) at --scale 0.01: a smoke test that the benchmark runs
through the real jobs on a real Dagster instance (PostgreSQL when EAGLE_TEST_POSTGRES_URL is set) and that its table
holds sane figures. It asserts what the run produced and measured, never how fast: times are the benchmark's to
print (docs/scaling.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30

# ~80 s on an idle 2-core machine; the limit leaves room for a machine loaded by other work.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    work = tmp_path_factory.mktemp("seed_scale")
    out = work / "figures.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_seed_scale.py"), "--scale", "0.01", "--merge-runs", "2"]
    cmd += ["--work", str(work / "run"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_every_stage_ran_through_the_real_jobs(rehearsal):
    stdout, figures = rehearsal
    stages = {s["name"]: s for s in figures["stages"]}
    assert list(stages) == ["datasets", "audit_view", "merge", "shards"]
    assert [r["partition"] for r in stages["datasets"]["runs"]] == [f"B{i}" for i in range(1, 9)]
    assert all(r["ok"] for s in stages.values() for r in s["runs"])
    steps = {s["step"] for s in stages["datasets"]["steps"]}
    assert {"prompts", "responses", "token_samples"} <= steps  # token_samples runs its gate checks in its step
    assert {"merged_dataset", "draft_vocab", "hidden_state_plan"} <= {s["step"] for s in stages["merge"]["steps"]}
    assert len(figures["shard_walls"]) >= 4  # one EAGLE_hidden_states run per shard partition
    for label in ("datasets: generation", "datasets: reconstruction + audit", "EAGLE_merge (stage)"):
        assert label in stdout


def test_answers_are_kimi_like_and_all_merged(rehearsal):
    _, f = rehearsal
    assert f["answered"] == 8 * 50  # 5,000 x 0.01 prompts per dataset, every one answered
    assert 2000 < f["streamed_tokens"] / f["answered"] < 6000  # ~3,460 a mean answer, not the demo's few sentences
    assert 0 < f["finish_length"] / f["answered"] < 0.15  # ~5% cut at max_tokens
    rows = f["manifest"]["rows_total"]
    assert 0.8 * f["answered"] <= rows <= f["answered"]  # all but the eval split
    assert f["manifest"]["tokens_total"] > f["streamed_tokens"] * rows / f["answered"]  # prompts + answers


def test_the_table_holds_sane_figures(rehearsal):
    _, f = rehearsal
    for row in f["rows"]:
        assert row["wall_s"] >= 0 and row["cpu_s"] >= 0 and row["written"] >= 0, row
        assert row["peak_rss"] < 4 * GIB, row
    by_label = {r["label"]: r for r in f["rows"]}
    assert by_label["datasets: generation"]["cpu_s"] > 0 and by_label["datasets: generation"]["peak_rss"] > 0
    assert by_label["simulated server (apart)"]["cpu_s"] > 0  # measured in its own process
    events = [s["event_rows"] for s in f["stages"][:3]]  # the shard stage has an instance of its own
    assert events == sorted(events) and events[0] > 0  # the event log only grows, stage by stage
    assert f["stages"][3]["event_rows"] > 0
    assert all(s["db_bytes"] > 0 for s in f["stages"])
    assert f["gen_cpu_per_m"] > 0 and f["minimal_cpu_per_m"] > 0
    assert f["ra_tokens_per_s"] > 0 and f["raw_tokens_per_s"] > 0
    assert len(f["merge_runs"]) == len(f["plain_runs"]) == 2
    assert f["shard_ratio"] > 0


def test_a_postgresql_run_drops_the_databases_it_made(rehearsal):
    """On PostgreSQL (EAGLE_TEST_POSTGRES_URL, as CI sets it) each of the benchmark's instances is a database of its
    own; none is left behind on the server once the benchmark has ended."""
    _, f = rehearsal
    url = os.environ.get("EAGLE_TEST_POSTGRES_URL")
    if not url:
        assert f["instance"] == "sqlite" and f["databases"] == []
        pytest.skip("EAGLE_TEST_POSTGRES_URL is not set: the rehearsal ran on SQLite")
    import psycopg2

    assert f["instance"] == "postgresql" and len(f["databases"]) == 2
    with psycopg2.connect(url, connect_timeout=5) as conn, conn.cursor() as cur:
        cur.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", (f["databases"],))
        left = cur.fetchall()
    conn.close()
    assert left == []


def _bench_databases(url: str | None) -> set[str]:
    if not url:
        return set()
    import psycopg2

    conn = psycopg2.connect(url, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE datname LIKE 'eagle_bench_%'")
            return {r[0] for r in cur.fetchall()}
    finally:
        conn.close()


def _processes_under(folder: Path) -> list[str]:
    """Command lines of the live processes that name `folder` (the benchmark's stage, server and client children)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended meanwhile, or not a process
        if str(folder) in cmd:
            found.append(cmd)
    return found


def test_a_terminated_run_leaves_no_database_folder_or_process(tmp_path):
    """SIGTERM (CI cancelling the job, `timeout`) in the middle of the datasets stage: the benchmark ends, and its
    stage child, its temporary work folder and, on PostgreSQL, its databases are gone with it."""
    url = os.environ.get("EAGLE_TEST_POSTGRES_URL")
    before = _bench_databases(url)
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_seed_scale.py"), "--scale", "0.01"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        # The datasets stage has started once its spec is written; what it has done by then does not matter.
        while not list(tmp_path.glob("eagle-seed-bench-*/datasets.spec.json")):
            assert proc.poll() is None, "the benchmark ended before its datasets stage"
            time.sleep(0.2)
        if url:
            assert _bench_databases(url) - before  # the run's database exists while it runs
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _processes_under(tmp_path) == []
    assert _bench_databases(url) - before == set()
    assert list(tmp_path.iterdir()) == []
    assert rc == 128 + signal.SIGTERM  # ended by the signal, through its own unwinding


def test_sqlite_event_rows_count_each_event_once(tmp_path, monkeypatch):
    """The table's event-log rows on SQLite are the events of the instance's runs, each once: Dagster's index
    database repeats a run's asset events and its start and end, and counting it made SQLite's figure ~40% above
    PostgreSQL's for the same runs."""
    import importlib.util

    import dagster as dg

    spec = importlib.util.spec_from_file_location("bench_seed_scale", REPO / "benchmarks" / "bench_seed_scale.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.delenv("EAGLE_TEST_POSTGRES_URL", raising=False)
    home = bench.Instance(tmp_path / "home")

    @dg.asset
    def one():
        return 1

    @dg.asset_check(asset=one)
    def one_is_one():
        return dg.AssetCheckResult(passed=True)

    with dg.DagsterInstance.from_config(str(home.home)) as instance:
        for _ in range(2):
            assert dg.materialize([one, one_is_one], instance=instance).success
        events = sum(len(instance.all_logs(r.run_id)) for r in instance.get_runs())
    rows, size = home.size()
    assert rows == events and size > 0
