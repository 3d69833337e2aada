"""Exactly-once resume: kill -9 at random points, then finish; and defensive reads of committed shards."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest

from eagle_pipeline.generation.store.answer_log import RESPONSE_ROW, encode_frame, read_log, segment_files
from eagle_pipeline.generation.store.rows import RESPONSES_SCHEMA
from eagle_pipeline.generation.store.shards import read_responses
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import (
    GRACE_S,
    READ_SLACK_S,
    ServerProcess,
    committed_ids,
    drained,
    durable_ids,
    kill_once_read,
    make_prompts,
    out_dirs,
    prompts_on_disk,
    proven_reads,
    run,
    run_child,
    sim_backend,
)


@pytest.mark.slow
def test_kill_9_resume_is_exactly_once(tmp_path):
    rng = random.Random(20240611)
    n = 300
    prompts = make_prompts(n)
    prompts_path, key_of = prompts_on_disk(prompts, tmp_path)
    out, _ = out_dirs(tmp_path)
    committed_after_kill = []
    with SimulatedOpenRouterServer(latency_s=0.03, faults={"http_500": 0.1, "cut_body": 0.05}) as srv:
        for _attempt in range(4):
            before_ids = durable_ids(out)
            before_keys = {key_of[s] for s in before_ids}
            log_start = len(srv.request_log())
            seen_start = srv.total_requests
            kill_after = rng.randint(15, 60)
            proc = run_child(prompts_path, srv.url, tmp_path)
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
        proc = run_child(prompts_path, srv.url, tmp_path)
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
    from eagle_pipeline.generation.store.shards import write_shard

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
    # Named columns: only those and the row key are read, deduplicated the same way.
    narrow = read_responses(tmp_path, columns=["content", "dataset"])
    assert narrow.column_names == ["sample_id", "backend_identity", "content", "dataset"]
    assert narrow.equals(t.select(narrow.column_names))
    assert read_responses(tmp_path / "missing").num_rows == 0


def test_a_committed_shard_without_the_conversation_columns_is_refused_by_name(tmp_path):
    """Every committed shard has the responses schema; one that lacks its columns is refused with its path, not read
    as if the conversation columns were optional."""
    from eagle_pipeline.generation.store.shards import read_committed, write_shard

    names = [n for n in RESPONSES_SCHEMA.names if n not in ("conversation_id", "turn_index", "conversation_end")]
    table = pa.table({n: pa.array([None], RESPONSES_SCHEMA.field(n).type) for n in names})
    path = write_shard(table.set_column(0, "sample_id", pa.array(["s1"])), tmp_path, 0)
    with pytest.raises(RuntimeError, match=rf"{path}: committed shard lacks the columns \['conversation_id'"):
        read_committed(tmp_path)


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


COMMIT_ROWS = 1000  # the commit window of the 2,000-in-flight runs (commit_every_s is out of reach)
IN_FLIGHT = 2000


def test_the_server_proves_a_read_by_the_next_request_on_the_same_connection(tmp_path):
    """The kill test's clock of the client's reads: an answer counts as read when its connection carries the next
    request, never earlier than its last byte was written; the last answer on each connection is not proven."""
    n = 12
    with ServerProcess(latency_s=0.01) as srv:
        summary = run(make_prompts(n), sim_backend(srv.url, concurrency=2), tmp_path)
        answered = {(k, a): t for k, a, t in srv.answered()}
        read_by = srv.read_by()
    assert summary.completed == n and len(answered) == n
    assert n - 2 <= len(read_by) < n  # at most 2 connections, each with an unproven last answer
    for k, a, t in read_by:
        assert t >= answered[(k, a)]


@dataclass
class _Kill:
    """One kill -9 of a 2,000-in-flight run, seen from the server's records and the files left."""

    old: set[str]  # request keys of the answers the client had read more than GRACE_S + READ_SLACK_S before the kill
    in_no_shard: int  # how many of them no committed shard held after the kill (only the log could keep them)
    lost_age_s: float  # how long before the kill the client had read the oldest answer that is not durable (0: none)
    rebought: set[str] = field(default_factory=set)  # the old answers the next run requested again


@dataclass
class _Runs:
    kills: list[_Kill]
    summary: dict | None  # the last run's, if it finished
    out: Path
    key_of: dict[str, str]  # sample id -> request key
    torn_sid: str | None  # the sample id of the frame cut mid-write added to the log after the first kill


def _kill_runs_at_2000_in_flight(
    tmp_path: Path, *, answer_log_s: float | None, kills: int, finish: bool, seed: int
) -> _Runs:
    """Kill -9 `kills` successive runs of 5,000 prompts at 2,000 in flight (server latency 2-6 s, in a process of its
    own), each inside a commit window, then one more run: to the end with `finish`, else killed once it has sent its
    first wave (which holds every prompt the killed run was answered but did not keep). With the answer log on, a
    frame cut mid-write is added to the log after the first kill. Checks on every run that it requests nothing that
    was durable at its start, and nothing twice."""
    rng = random.Random(seed)
    n = 5000
    prompts = make_prompts(n)
    prompts_path, key_of = prompts_on_disk(prompts, tmp_path)
    sids = prompts.column("sample_id").to_pylist()
    out, _ = out_dirs(tmp_path)
    options = {
        "backend": {"concurrency": IN_FLIGHT, "stream": False, "timeout_s": 60.0},
        "commit_every_rows": COMMIT_ROWS,
        "commit_every_s": 600.0,
        "answer_log_s": answer_log_s,
    }
    runs = _Runs([], None, out, key_of, None)
    with ServerProcess(latency_s=2.0, latency_spread_s=4.0) as srv:
        for attempt in range(kills + 1):
            durable = {key_of[s] for s in durable_ids(out)}
            answered_start, read_start, arrivals_start = len(srv.answered()), len(srv.read_by()), len(srv.arrivals())
            proc = run_child(prompts_path, srv.url, tmp_path, options)
            if attempt < kills:
                # Fewer than COMMIT_ROWS - 50 written: the client holds too few rows for its first commit, so only
                # the answer log can keep the old answers.
                t_kill = kill_once_read(
                    proc,
                    srv,
                    reads=rng.randint(100, 400),
                    max_written=COMMIT_ROWS - 50,
                    answered_start=answered_start,
                    read_start=read_start,
                )
            elif finish:
                stdout, stderr = proc.communicate(timeout=240)
                assert proc.returncode == 0, stderr[-3000:]
                runs.summary = json.loads(stdout.strip().splitlines()[-1])
            else:
                first_wave = min(IN_FLIGHT, n - len(durable))
                deadline = time.monotonic() + 60
                while len(srv.arrivals()) - arrivals_start < first_wave and time.monotonic() < deadline:
                    assert proc.poll() is None, proc.communicate()
                    time.sleep(0.02)
                os.kill(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)
            drained(srv)
            requested = [key for key, _ in srv.arrivals()[arrivals_start:]]
            assert not (set(requested) & durable), f"run {attempt} re-bought answers committed or logged before it"
            assert len(requested) == len(set(requested)), f"run {attempt} requested a prompt twice"
            if runs.kills:
                runs.kills[-1].rebought = set(requested) & runs.kills[-1].old
            if attempt == kills:
                break
            ids, _ = committed_ids(out)
            assert len(ids) == len(set(ids)), "a sample was committed twice"
            now_durable = {key_of[s] for s in durable_ids(out)}
            assert durable <= now_durable and len(now_durable) < n
            reads = proven_reads(srv, read_start, {(k, a) for k, a, _ in srv.answered()[answered_start:]})
            old = {k for k, t in reads if t <= t_kill - GRACE_S - READ_SLACK_S}
            lost = [t_kill - t for k, t in reads if k not in now_durable]
            runs.kills.append(_Kill(old, len(old - {key_of[s] for s in ids}), max(lost, default=0.0)))
            if attempt == 0 and answer_log_s is not None:
                # As if the kill had cut the log in the middle of a frame, for a prompt not requested yet.
                requested_ever = srv.request_counts()
                runs.torn_sid = next(s for s in sids if key_of[s] not in requested_ever)
                _torn_copy(out, runs.torn_sid)
                assert {key_of[s] for s in durable_ids(out)} == now_durable  # the torn frame is no row
    return runs


@pytest.mark.slow
def test_kill_9_at_2000_in_flight_rebuys_no_answer_older_than_a_tenth_of_a_second(tmp_path):
    """Kill -9 three 2,000-in-flight runs at random points inside their 1,000-row commit window (a frame cut mid-write
    is added to the log after the first kill), then finish. From the server's own records (a process of its own): at
    every kill the client had read at least 100 answers more than 0.1 s (+ READ_SLACK_S) before it, at least 100 of
    them in no shard; every one of them is durable and none is requested again; no row is torn or duplicated; every
    prompt is answered exactly once."""
    runs = _kill_runs_at_2000_in_flight(tmp_path, answer_log_s=0.05, kills=3, finish=True, seed=15_0005)
    for i, k in enumerate(runs.kills):
        assert len(k.old) >= 100 and k.in_no_shard >= 100, (
            f"kill {i}: {len(k.old)} old answers, {k.in_no_shard} in no shard"
        )
        assert k.lost_age_s <= GRACE_S + READ_SLACK_S, (
            f"kill {i}: an answer the client read {k.lost_age_s:.3f} s before the kill is not durable"
        )
        assert not k.rebought, f"kill {i}: {len(k.rebought)} answers read before the bound were bought again"
    summary, out = runs.summary, runs.out
    assert summary is not None and summary["failed"] == 0
    assert summary["already_done"] + summary["completed"] == len(runs.key_of)
    assert summary["recovered_from_log"] > 0
    ids, _ = committed_ids(out)
    assert sorted(ids) == sorted(runs.key_of)  # every prompt exactly once
    assert segment_files(out) == [] and not list(out.glob(".*.tmp"))
    rows = read_responses(out).to_pylist()
    for r in rows:  # no torn row: each is the whole answer, its text equal to the body it came with
        message = json.loads(r["raw_response_json"])["choices"][0]["message"]
        assert (r["content"], r["reasoning"]) == (message["content"], message["reasoning"]), r["sample_id"]
    assert runs.torn_sid in ids


@pytest.mark.slow
def test_without_the_answer_log_the_same_kill_rebuys_old_answers(tmp_path):
    """The negative control of the test above: the same kill with the answer log off loses every answer of the commit
    window, so the next run requests again at least 100 answers the client had read more than 0.1 s (+ READ_SLACK_S)
    before the kill: the bound that test checks can fail."""
    runs = _kill_runs_at_2000_in_flight(tmp_path, answer_log_s=None, kills=1, finish=False, seed=15_0006)
    (k,) = runs.kills
    assert k.in_no_shard >= 100 and len(k.rebought) >= 100, (len(k.old), k.in_no_shard, len(k.rebought))
    assert k.lost_age_s > GRACE_S + READ_SLACK_S
