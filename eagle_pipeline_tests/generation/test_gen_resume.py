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
from eagle_pipeline.generation.answer_log import RESPONSE_ROW, encode_frame, read_log, segment_files

from .generation_helpers import SAMPLING, committed_ids, drained, durable_ids, make_prompts, out_dirs, processed_by

REPO = Path(__file__).resolve().parents[2]


def _child(prompts_path: Path, url: str, root: Path, options: dict | None = None) -> subprocess.Popen:
    extra = [json.dumps(options)] if options else []
    return subprocess.Popen(
        [sys.executable, "-m", "eagle_pipeline_tests.generation.resume_child", str(prompts_path), url, str(root)]
        + extra,
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
            before_ids = durable_ids(out)
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
            ids, _ = committed_ids(out)  # every committed shard is complete and readable
            assert len(ids) == len(set(ids)), "a sample was committed twice"
            assert before_ids <= durable_ids(out)
            # The server never saw a request for a sample committed or logged before this attempt started.
            new_keys = {r.key for r in srv.request_log()[log_start:]}
            assert not (new_keys & before_keys)
            committed_after_kill.append(len(durable_ids(out)))
        assert committed_after_kill[-1] < n and committed_after_kill[-1] > 0
        # The last run finishes the job.
        before_ids = durable_ids(out)
        before_keys = {key_of[s] for s in before_ids}
        log_start = len(srv.request_log())
        proc = _child(prompts_path, srv.url, tmp_path)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert not ({r.key for r in srv.request_log()[log_start:]} & before_keys)
        counts = srv.request_counts()
    assert summary["already_done"] == len(before_ids) and summary["completed"] == n - len(before_ids)
    ids, n_shards = committed_ids(out)
    assert sorted(ids) == sorted(prompts.column("sample_id").to_pylist())  # every prompt exactly once
    assert not list(out.glob(".*.tmp"))  # a killed writer's temporaries were cleaned
    assert segment_files(out) == []  # the answer log was folded, then deleted
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


def _torn_copy(out: Path, sample_id: str) -> int:
    """Append to the newest log segment the first part of a frame for `sample_id`: what a kill -9 in the middle of
    writing that frame leaves. Returns the number of bytes appended."""
    segment = segment_files(out)[-1]
    row = dict(read_log(out).responses[-1], sample_id=sample_id, content="a torn row must never be kept")
    frame = encode_frame(RESPONSE_ROW, row)
    cut = random.Random(sample_id).randint(1, len(frame) - 1)
    with open(segment, "ab") as fh:
        fh.write(frame[:cut])
    return cut


@pytest.mark.slow
def test_kill_9_at_2000_in_flight_rebuys_no_answer_older_than_a_tenth_of_a_second(tmp_path):
    """Kill -9 at random points of a 2,000-in-flight run whose commit window (500 rows) most kills fall inside, with a
    frame cut mid-write in the log after one kill, then finish. From the server's own request log: every answer the
    client had read more than 0.1 s before a kill is durable, and no run requests anything durable when it starts
    (so none of those answers is bought again); no row is torn or duplicated; every prompt is answered once."""
    rng = random.Random(15_0005)
    n, in_flight, latency, grace_s = 5000, 2000, 3.0, 0.1
    prompts = make_prompts(n)
    prompts_path = tmp_path / "prompts.parquet"
    pq.write_table(prompts, prompts_path)
    sids = prompts.column("sample_id").to_pylist()
    key_of = {s: request_key(mj, SAMPLING.seed) for s, mj in zip(sids, prompts.column("messages_json").to_pylist())}
    out, _ = out_dirs(tmp_path)
    options = {
        "backend": {"concurrency": in_flight, "stream": False, "timeout_s": 60.0},
        "commit_every_rows": 500,
        "commit_every_s": 10.0,
    }
    durable: set[str] = set()  # request keys of the rows in shards or in the log after the latest kill
    log_start = 0
    in_log_only = 0
    with SimulatedOpenRouterServer(latency_s=latency) as srv:
        for attempt in range(4):
            workers = min(in_flight, n - len(durable))
            proc = _child(prompts_path, srv.url, tmp_path, options)
            if attempt == 3:  # the last run finishes the job
                stdout, stderr = proc.communicate(timeout=180)
                assert proc.returncode == 0, stderr[-3000:]
                summary = json.loads(stdout.strip().splitlines()[-1])
            else:
                answered_start = len(srv.answered_at())
                # Late enough that the client has sent second requests (they prove answers read), inside a commit
                # window most of the time.
                wait_for = rng.randint(600, 1400)
                deadline = time.monotonic() + 90
                while len(srv.answered_at()) - answered_start < wait_for and time.monotonic() < deadline:
                    assert proc.poll() is None, proc.communicate()
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.4))
                t_kill = time.time()
                os.kill(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)
                drained(srv)
            arrivals = srv.arrivals()[log_start:]
            log_start += len(arrivals)
            # This run requested nothing that was durable when it started, and nothing twice.
            requested = [key for key, _ in arrivals]
            assert not (set(requested) & durable), f"run {attempt} re-bought answers committed or logged before it"
            assert len(requested) == len(set(requested))
            if attempt == 3:
                break
            ids, _ = committed_ids(out)
            assert len(ids) == len(set(ids)), "a sample was committed twice"
            before, durable = durable, {key_of[s] for s in durable_ids(out)}
            assert before <= durable and len(durable) < n
            # Every answer read more than 0.1 s before the kill is durable (in a shard or the log).
            read_early = processed_by(arrivals, t_kill - grace_s, workers)
            sent_early = {k for (k, _), t in srv.answered_at().items() if t < t_kill - grace_s}
            assert len(durable - before) >= read_early, (
                f"kill {attempt}: {read_early} answers read by the client {grace_s} s before the kill, only "
                f"{len(durable - before)} durable ({len(sent_early - durable)} sent by the server more than "
                f"{grace_s} s before the kill are not)"
            )
            in_log_only += len(durable - {key_of[s] for s in ids})
            if attempt == 1:  # as if the kill had cut the log in the middle of a frame, for a prompt not answered yet
                torn_sid = next(s for s in sids if key_of[s] not in srv.request_counts())
                _torn_copy(out, torn_sid)
                assert {key_of[s] for s in durable_ids(out)} == durable  # the torn frame is no row
    counts = srv.request_counts()
    assert in_log_only > 0  # the kills fell inside commit windows: without the log these answers were lost
    assert summary["failed"] == 0 and summary["already_done"] + summary["completed"] == n
    assert summary["recovered_from_log"] > 0
    ids, _ = committed_ids(out)
    assert sorted(ids) == sorted(sids)  # every prompt exactly once
    assert segment_files(out) == [] and not list(out.glob(".*.tmp"))
    rows = read_responses(out).to_pylist()
    for r in rows:  # no torn row: each is the whole answer, its text equal to the body it came with
        message = json.loads(r["raw_response_json"])["choices"][0]["message"]
        assert (r["content"], r["reasoning"]) == (message["content"], message["reasoning"]), r["sample_id"]
    assert counts[key_of[torn_sid]] >= 1 and torn_sid in ids
    assert set(counts) == set(key_of.values())
