"""The pipeline-wide budget across parallel runs: four `EAGLE_dataset` runs of one data root, each its own process
(as the daemon launches them), against one priced simulated server, under a cap of about 1.5 datasets' spend. The
data root's committed spend stays within the cap plus what was in flight when it was reached, every run stops with a
"budget" reason, and a kill -9 of one run mid-way changes neither."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_pipeline.defs.generation import prompts
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.run.runner import generate_dataset
from eagle_pipeline.generation.store.shards import read_committed, read_shard_columns
from eagle_pipeline.shared.storage import DataRoot
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from ..generation.generation_helpers import durable_ids
from .conftest import write_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DATASETS = ("B1", "B2", "B3", "B4")
PROMPTS = 30  # per dataset (every bundled prompt of B1..B4)
LATENCY_S = 0.2  # per answer: well above the ledger's 0.05 s, so each run's view is current when it decides


class GatedServer(SimulatedOpenRouterServer):
    """The priced OpenRouter double, holding every request until `gate` is set: the four runs start at different
    moments (a Dagster process takes seconds to start), and the test wants them all running before any answer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.waiting = 0

    async def handle(self, request, body, at):
        with self._lock:
            self.waiting += 1
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        return await super().handle(request, body, at)


def _config(tmp_path: Path, url: str) -> Path:
    path = write_config(tmp_path, datasets=DATASETS, limit=PROMPTS)
    raw = yaml.safe_load(path.read_text())
    raw["backends"]["simulated"].update(endpoint=url, concurrency=1)
    raw["generation"].update(commit_every_rows=4, commit_every_s=0.2)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _one_dataset_spend(root: DataRoot, tmp_path: Path) -> float:
    """What one dataset's prompts cost when answered whole (in a scratch directory, outside the data root)."""
    from eagle_pipeline.config import load_config

    cfg = load_config()
    ds = cfg.datasets["B1"]
    s = generate_dataset(
        dataset="B1",
        prompts=pq.read_table(root.prompts("B1")),
        backend=cfg.backends[ds.backend],  # the gated server's endpoint (the gate is open)
        sampling=ds.sampling,
        out_dir=tmp_path / "scratch" / "B1",
        errors_dir=tmp_path / "scratch" / "B1" / "errors",
        options=RunOptions(progress_every_s=3600),
    )
    assert s.completed == PROMPTS and s.stopped_reason is None
    return s.spend_usd


def _launch(instance: dg.DagsterInstance, dataset: str) -> subprocess.Popen:
    """`EAGLE_dataset`'s responses step for `dataset` as a run in its own process group."""
    env = {**os.environ, "DAGSTER_HOME": instance.root_directory}
    cmd = [str(Path(sys.executable).parent / "dagster"), "job", "execute", "-m", "eagle_pipeline.definitions"]
    cmd += ["-j", "EAGLE_dataset", "-o", "responses", "--tags", json.dumps({"dagster/partition": dataset})]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _step_failures(instance: dg.DagsterInstance) -> dict[str, str]:
    """Partition -> the responses step's failure message, for every EAGLE_dataset run of the instance."""
    out = {}
    for r in instance.get_runs():
        for rec in instance.all_logs(r.run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
            out[r.tags["dagster/partition"]] = rec.dagster_event.event_specific_data.error.message
    return out


@pytest.mark.parametrize("kill", [False, True], ids=["all_run", "one_killed"])
def test_the_pipeline_budget_holds_across_parallel_runs(tmp_path, monkeypatch, kill):
    (tmp_path / "dagster_home").mkdir()
    with GatedServer(latency_s=LATENCY_S) as srv, dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as inst:
        monkeypatch.setenv("EAGLE_PIPELINE_CONFIG", str(_config(tmp_path, srv.url)))
        root = DataRoot(tmp_path / "data")
        for ds in DATASETS:
            assert dg.materialize(
                [prompts], partition_key=ds, instance=inst, resources={"pipeline": PipelineResource()}
            )
        srv.gate.set()
        cap = 1.5 * _one_dataset_spend(root, tmp_path)
        srv.gate.clear()
        srv.waiting = 0
        raw = yaml.safe_load(Path(os.environ["EAGLE_PIPELINE_CONFIG"]).read_text())
        raw["generation"]["budget_usd"] = cap
        Path(os.environ["EAGLE_PIPELINE_CONFIG"]).write_text(yaml.safe_dump(raw, sort_keys=False))

        procs = {ds: _launch(inst, ds) for ds in DATASETS}
        try:
            deadline = time.monotonic() + 300
            while srv.waiting < len(DATASETS):  # concurrency 1: each run's first request
                assert all(p.poll() is None for p in procs.values()), {d: p.poll() for d, p in procs.items()}
                assert time.monotonic() < deadline, f"only {srv.waiting} runs reached the server"
                time.sleep(0.05)
            srv.gate.set()
            if kill:  # mid-way: the victim holds 9 of the cap's 45 answers (forgotten, they would break the bound)
                victim = procs["B4"]
                while len(durable_ids(root.responses_dir("B4"))) < int(PROMPTS * 1.5 / 4 * 0.85):
                    assert victim.poll() is None and time.monotonic() < deadline, "the victim ended before its kill"
                    time.sleep(0.01)
                os.killpg(victim.pid, signal.SIGKILL)
            outputs = {ds: p.communicate(timeout=300)[0] for ds, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)

    # The bound: every committed answer (the victim's answer log included) within the cap plus what was in flight
    # when it was reached: at most one request per run (concurrency 1), each at most the dearest answer, and one more
    # per run sent in the moment before it saw the others' newest figures (the ledger's 0.05 s, longer on a loaded
    # machine; the 0.2 s latency leaves room for one).
    costs = []
    for ds in DATASETS:
        for p in sorted(root.responses_dir(ds).glob("part-*.parquet")):
            costs += read_shard_columns(p, ["cost_usd"]).column("cost_usd").to_pylist()
    total = sum(read_committed(root.responses_dir(ds)).spend_usd for ds in DATASETS)
    dearest = max(costs)
    in_flight = 2 * len(DATASETS) * dearest
    assert total <= cap + in_flight, (total, cap, in_flight)
    # ...and the cap, not something else, stopped them: the spend got to it (less what the runs had in flight).
    assert total >= cap - in_flight, (total, cap, in_flight)
    failures = _step_failures(inst)
    survivors = [ds for ds in DATASETS if not (kill and ds == "B4")]
    for ds in survivors:
        message = failures.get(ds, outputs[ds][-2000:])
        assert "stopped early (budget)" in message and "generation.budget_usd" in message, (ds, message)
        assert len(durable_ids(root.responses_dir(ds))) < PROMPTS  # no run answered its whole dataset
