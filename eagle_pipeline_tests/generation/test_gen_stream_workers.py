"""Streamed answers read and assembled in worker processes (`stream_processes`): the same rows as one event loop,
a killed worker or a killed run loses nothing and leaves nothing running, a cancelled request closes its stream, a
worker that cannot start fails the run's start with a clear error. Real processes, real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle_pipeline.generation.backends.stream_workers import ANSWER, REQUEST, FrameReader, frame, stream_workers
from eagle_pipeline.generation.spec import BackendSpec
from eagle_pipeline.generation.store.shards import read_errors, read_responses
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import (
    committed_ids,
    drained,
    durable_ids,
    make_prompts,
    out_dirs,
    prompts_on_disk,
    run,
    run_child,
    sample_keys,
    sim_backend,
)

VOLATILE = {"latency_s", "started_at", "finished_at", "raw_response_json", "generation_id", "endpoint"}


def worker_pids(parent: int) -> set[int]:
    """Pids of the stream worker processes whose parent is `parent` (Linux /proc)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{parent}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                if b"eagle_pipeline.generation.backends.stream_workers" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.add(pid)
            except OSError:
                pass
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _rows(root: Path) -> dict[str, dict]:
    return {r["sample_id"]: r for r in read_responses(out_dirs(root)[0]).to_pylist()}


def test_rows_through_worker_processes_equal_one_loop_rows_and_the_key_stays_off_the_command_line(
    tmp_path, monkeypatch, caplog
):
    caplog.set_level("INFO", logger="eagle_pipeline.generation")
    monkeypatch.setenv("SIM_KEY", "sk-or-v1-test-secret-0123456789")
    prompts = make_prompts(40, tools_every=2)
    with SimulatedOpenRouterServer(stream={"chunk_chars": 9}) as srv:
        seen: set[int] = set()
        stop = threading.Event()

        def watch() -> None:  # the workers' command lines, while they run
            while not stop.is_set():
                for pid in worker_pids(os.getpid()) - seen:
                    seen.add(pid)
                    cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
                time.sleep(0.01)

        cmdlines: list[bytes] = []
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            spec = dict(stream=True, api_key_env="SIM_KEY", concurrency=8)
            s2 = run(prompts, sim_backend(srv.url, stream_processes=2, **spec), tmp_path / "workers")
        finally:
            stop.set()
            watcher.join()
        s0 = run(prompts, sim_backend(srv.url, stream_processes=0, **spec), tmp_path / "loop")
        auth = {h.get("Authorization") for h in srv.headers_seen()}
    assert (s2.completed, s2.failed) == (s0.completed, s0.failed) == (40, 0)
    assert len(seen) == 2 and all(b"sk-or-v1" not in c for c in cmdlines)
    assert auth == {"Bearer sk-or-v1-test-secret-0123456789"}  # the workers sent the key, from INIT
    got, want = _rows(tmp_path / "workers"), _rows(tmp_path / "loop")
    assert got.keys() == want.keys()
    for sid, row in got.items():
        assert {k: v for k, v in row.items() if k not in VOLATILE} == {
            k: v for k, v in want[sid].items() if k not in VOLATILE
        }, sid
        body, ref = json.loads(row["raw_response_json"]), json.loads(want[sid]["raw_response_json"])
        assert (body["choices"], body["usage"]) == (ref["choices"], ref["usage"]), sid
    assert sum(bool(r["tool_calls_json"]) for r in got.values()) >= 10
    assert all(r["stream_chunks"] > 10 for r in got.values())
    assert worker_pids(os.getpid()) == set()  # the run's end stopped them
    # What they cost, from each worker's own figures at its exit.
    costs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stream worker processes:")]
    assert len(costs) == 1 and re.fullmatch(
        r"stream worker processes: 2, 0 restarted; [\d.]+ s of CPU .* \d+ MiB .*", costs[0]
    )


@pytest.mark.parametrize("procs", [1, 2])
def test_a_killed_worker_fails_only_its_streams_which_are_retried(tmp_path, procs):
    """Killed with -9 mid-run: its streams fail as retryable and are requested again, and its slot gets a new
    process; with one worker, requests wait for the new process rather than fail."""
    n = 60
    prompts = make_prompts(n)
    keys = set(sample_keys(prompts).values())
    # ~0.6 s per stream: a kill always finds streams in flight on the killed worker.
    with SimulatedOpenRouterServer(stream={"chunk_chars": 24, "chunk_delay_s": 0.02}) as srv:
        spec = sim_backend(srv.url, stream=True, stream_processes=procs, concurrency=12, max_retries=3)
        seen: set[int] = set()
        killed: list[int] = []

        def killer() -> None:
            pids = wait_for(lambda: len(p := worker_pids(os.getpid())) == procs and p, 30, "the workers")
            wait_for(lambda: srv.total_requests >= 20, 30, "20 requests")
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
            seen.update(pids)
            # Its slot gets a fresh process while the run goes on.
            seen.update(wait_for(lambda: worker_pids(os.getpid()) - pids, 30, "a restarted worker"))

        thread = threading.Thread(target=killer)
        thread.start()
        s = run(prompts, spec, tmp_path)
        thread.join()
        counts = srv.request_counts()
    assert killed and len(seen) == procs + 1
    assert (s.completed, s.failed) == (n, 0)
    assert read_errors(out_dirs(tmp_path)[1]).num_rows == 0  # retried, so no final failure
    rows = _rows(tmp_path)
    assert len(rows) == n and sorted(committed_ids(out_dirs(tmp_path)[0])[0]) == sorted(rows)
    retried = [r for r in rows.values() if r["attempts"] == 2]
    # Only the killed worker's streams in flight (about 12 / procs) were requested again.
    assert 1 <= len(retried) <= 12
    # A retried stream reached the server once or twice (the worker may die before it sent the request on).
    assert set(counts) == keys and max(counts.values()) <= 2
    assert n <= sum(counts.values()) <= n + len(retried)


def test_run_killed_9_leaves_no_worker_and_no_open_stream_and_resumes_exactly_once(tmp_path):
    n = 40
    prompts = make_prompts(n)
    prompts_path, key_of = prompts_on_disk(prompts, tmp_path)
    out, _ = out_dirs(tmp_path)
    options = {"backend": {"stream": True, "stream_processes": 2}, "commit_every_rows": 1000, "commit_every_s": 60.0}

    def child() -> subprocess.Popen:
        return run_child(prompts_path, srv.url, tmp_path, options)

    with SimulatedOpenRouterServer(stream={"chunk_chars": 24, "chunk_delay_s": 0.02}) as srv:
        proc = child()
        wait_for(lambda: len(durable_ids(out)) >= 10 or proc.poll() is not None, 60, "10 durable answers")
        assert proc.poll() is None, proc.communicate()
        pids = worker_pids(proc.pid)
        assert len(pids) == 2 and srv.open_connections() > 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        # The workers saw their stdin close: they cancelled their streams and exited.
        wait_for(lambda: not any(alive(p) for p in pids), 10, f"workers {pids} gone")
        wait_for(lambda: srv.open_connections() == 0, 10, "every stream closed")
        drained(srv)
        at_kill = durable_ids(out)
        first_run = {key for key, _ in srv.arrivals()}
        log_start = len(srv.arrivals())
        proc = child()
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        second = [key for key, _ in srv.arrivals()[log_start:]]
    done_keys = {key_of[s] for s in at_kill}
    assert 10 <= len(at_kill) < n
    # Nothing durable was requested again; everything else exactly once.
    assert sorted(second) == sorted(set(key_of.values()) - done_keys)
    assert not set(second) & done_keys and set(second) & first_run  # streams in flight at the kill, requested again
    assert json.loads(stdout.strip().splitlines()[-1])["recovered_from_log"] == len(at_kill)
    assert sorted(committed_ids(out)[0]) == sorted(key_of)


def test_a_cancelled_request_closes_its_stream_in_the_worker():
    """The run stopped waiting for a stream (cancelled): the worker cancels the exchange, which closes the
    connection (a provider stops generating when the stream closes), and serves on; a SIGINT does not stop it."""
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def scenario(slow: SimulatedOpenRouterServer, fast: SimulatedOpenRouterServer) -> tuple[int, int, int]:
        async with stream_workers(1, concurrency=4, timeout_s=5.0, max_request_s=None, headers={}) as workers:
            assert workers is not None
            # Ctrl-C goes to the whole process group; a worker leaves the stopping to the run (its stdin closing).
            os.kill(workers._children[0].pid, signal.SIGINT)
            task = asyncio.create_task(workers.post_streamed(slow.url + "/chat/completions", body, None))
            t0 = time.monotonic()
            while slow.open_connections() == 0:
                assert time.monotonic() - t0 < 20, "the stream never reached the server"
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t0 = time.monotonic()
            while slow.open_connections() > 0 and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.02)
            pending = len(workers._children[0].pending)
            answer = await asyncio.wait_for(workers.post_streamed(fast.url + "/chat/completions", body, None), 30)
            assert workers._restarts == [0]  # the same process served both
            return slow.open_connections(), pending, answer.status

    # The slow stream sends a delta every 0.5 s: minutes for the whole answer.
    with (
        SimulatedOpenRouterServer(stream={"chunk_chars": 8, "chunk_delay_s": 0.5}) as slow,
        SimulatedOpenRouterServer() as fast,
    ):
        open_after, pending, status = asyncio.run(scenario(slow, fast))
    assert (open_after, pending, status) == (0, 0, 200)


def test_a_worker_that_cannot_start_fails_the_start_clearly(tmp_path, monkeypatch):
    prompts = make_prompts(3)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the interpreter the workers are started with
    with SimulatedOpenRouterServer() as srv:
        with pytest.raises(RuntimeError, match=r"stream worker process \d+ exited with code 1 before it was ready"):
            run(prompts, sim_backend(srv.url, stream=True, stream_processes=2), tmp_path)
        assert srv.total_requests == 0
    assert committed_ids(out_dirs(tmp_path)[0]) == ([], 0)


def test_frames_cut_anywhere_read_whole():
    rng = random.Random(3)
    frames = [(REQUEST, i, rng.randbytes(rng.randrange(0, 3000))) for i in range(200)]
    frames += [(ANSWER, 2**32 - 1, b""), (ANSWER, 7, b"\n" * 70_000)]
    raw = b"".join(frame(*f) for f in frames)
    for trial in range(20):
        got: list[tuple[int, int, bytes]] = []
        reader = FrameReader(lambda *f, got=got: got.append(f))
        i = 0
        while i < len(raw):
            step = rng.choice([1, 2, 9, 100, 4096, 65536]) if trial else 1 + (i % 13)
            reader.feed(raw[i : i + step])
            i += step
        assert got == frames and reader.pending_bytes == 0
    reader = FrameReader(lambda *f: None)
    reader.feed(raw[:20])
    assert reader.pending_bytes == 20  # an incomplete frame stays until the rest arrives


def test_stream_processes_setting():
    base = dict(name="o", kind="openrouter", endpoint="http://x")
    cpus = len(os.sched_getaffinity(0))
    assert BackendSpec(**base).stream_processes_for(2000) == min(cpus, 4)
    assert BackendSpec(**base).stream_processes_for(1000) == min(cpus, 2)
    assert BackendSpec(**base).stream_processes_for(499) == 0
    assert BackendSpec(**base, stream_processes=3).stream_processes_for(2000) == 3
    assert BackendSpec(**base, stream_processes=3).stream_processes_for(2) == 2  # never more than in flight
    assert BackendSpec(**base, stream=False).stream_processes_for(2000) == 0
    assert BackendSpec(name="v", kind="vllm", endpoint="http://x").stream_processes_for(2000) == 0
    with pytest.raises(ValueError, match="stream_processes: carries streamed answers only"):
        BackendSpec(name="v", kind="vllm", endpoint="http://x", stream_processes=2)
    with pytest.raises(ValueError, match="stream_processes"):
        BackendSpec(**base, stream_processes=-1)
