"""Exactly-once resume: kill -9 at random points, then finish; and defensive reads of committed shards."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.generation import RESPONSES_SCHEMA, SimulatedOpenRouterServer, read_responses, request_key
from eagle_pipeline.generation.store import part_files

from .generation_helpers import SAMPLING, make_prompts, out_dirs

REPO = Path(__file__).resolve().parents[2]


def _committed(out: Path) -> tuple[list[str], int]:
    """Sample ids of every committed shard (no dedupe), and the number of shards; every shard must be readable."""
    ids: list[str] = []
    files = part_files(out)
    for f in files:
        ids += pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()
    return ids, len(files)


def _child(prompts_path: Path, url: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "eagle_pipeline_tests.generation.resume_child", str(prompts_path), url, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_kill_9_resume_is_exactly_once(tmp_path):
    rng = random.Random(20240611)
    n = 300
    prompts = make_prompts(n)
    prompts_path = tmp_path / "prompts.parquet"
    pq.write_table(prompts, prompts_path)
    key_of = {
        sid: request_key(mj, SAMPLING.seed)
        for sid, mj in zip(prompts.column("sample_id").to_pylist(), prompts.column("messages_json").to_pylist())
    }
    out, _ = out_dirs(tmp_path)
    committed_after_kill = []
    with SimulatedOpenRouterServer(latency_s=0.03, faults={"http_500": 0.1, "cut_body": 0.05}) as srv:
        for _attempt in range(4):
            before_ids, _ = _committed(out)
            before_keys = {key_of[s] for s in before_ids}
            log_start = len(srv.request_log())
            seen_start = srv.total_requests
            kill_after = rng.randint(15, 60)
            proc = _child(prompts_path, srv.url, tmp_path)
            deadline = time.monotonic() + 45
            while srv.total_requests - seen_start < kill_after and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.05))
            assert proc.poll() is None, f"child finished before the kill: {proc.communicate()}"
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            assert proc.returncode == -signal.SIGKILL
            ids, _ = _committed(out)  # every committed shard is complete and readable
            assert len(ids) == len(set(ids)), "a sample was committed twice"
            assert set(before_ids) <= set(ids)
            # The server never saw a request for a sample that was committed before this attempt started.
            new_keys = {r.key for r in srv.request_log()[log_start:]}
            assert not (new_keys & before_keys)
            committed_after_kill.append(len(ids))
        assert committed_after_kill[-1] < n and committed_after_kill[-1] > 0
        # The last run finishes the job.
        before_ids, _ = _committed(out)
        before_keys = {key_of[s] for s in before_ids}
        log_start = len(srv.request_log())
        proc = _child(prompts_path, srv.url, tmp_path)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert not ({r.key for r in srv.request_log()[log_start:]} & before_keys)
        counts = srv.request_counts()
    assert summary["already_done"] == len(before_ids) and summary["completed"] == n - len(before_ids)
    ids, n_shards = _committed(out)
    assert sorted(ids) == sorted(prompts.column("sample_id").to_pylist())  # every prompt exactly once
    assert not list(out.glob(".*.tmp"))  # a killed writer's temporaries were cleaned
    t = read_responses(out)
    assert t.num_rows == n and t.schema.metadata[b"duplicates_dropped"] == b"0"
    assert n_shards >= 5
    # Re-requests happen only for work in flight at a kill (and retried faults): far fewer than the prompts.
    assert sum(counts.values()) < n * 1.6
    assert set(counts) == set(key_of.values())


def test_read_responses_dedupes_defensively(tmp_path):
    from eagle_pipeline.generation.store import write_shard

    prompts = make_prompts(3)
    base = {name: [None] * 3 for name in RESPONSES_SCHEMA.names}
    base.update(sample_id=prompts.column("sample_id").to_pylist(), dataset=["B1"] * 3, content=["a", "b", "c"])
    t1 = pa.table(base, schema=RESPONSES_SCHEMA)
    dup = dict(base, sample_id=[base["sample_id"][1]], dataset=["B1"], content=["second copy"])
    dup = {k: (v if k in ("sample_id", "dataset", "content") else [None]) for k, v in dup.items()}
    write_shard(t1, tmp_path, 0)
    write_shard(pa.table(dup, schema=RESPONSES_SCHEMA), tmp_path, 1)
    (tmp_path / "part-notanumber.parquet").write_bytes(b"ignored")
    (tmp_path / ".part-00002.parquet.x.tmp").write_bytes(b"ignored")
    t = read_responses(tmp_path)
    assert t.num_rows == 3 and t.column("content").to_pylist() == ["a", "b", "c"]  # the first copy is kept
    assert t.schema.metadata[b"duplicates_dropped"] == b"1"
    assert read_responses(tmp_path / "missing").num_rows == 0
