"""The runner against the simulated OpenRouter server: rows, resume, retries, stops, budgets, errors, secrets."""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import random
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle_pipeline.generation.run.live import RetryPause, release_spread_s
from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.spec import REQUEST_SEED_SCHEME
from eagle_pipeline.generation.spend.budget import pipeline_budget
from eagle_pipeline.generation.store.rows import ERRORS_SCHEMA, RESPONSES_SCHEMA
from eagle_pipeline.generation.store.shards import DirLock, part_files, read_errors, read_responses
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import SAMPLING, FileOpens, make_prompts, out_dirs, run, sample_keys, sim_backend


def test_rows_match_contract_and_request_is_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TEST_OR_KEY", "sk-or-v1-testkey-0123456789")
    prompts = make_prompts(24, tools_every=2)
    with SimulatedOpenRouterServer(api_key="sk-or-v1-testkey-0123456789") as srv:
        be = sim_backend(
            srv.url,
            api_key_env="EAGLE_TEST_OR_KEY",
            provider={"only": ["moonshotai"], "allow_fallbacks": False, "quantizations": ["int4"]},
        )
        s = run(prompts, be, tmp_path, options=RunOptions(commit_every_rows=10))
        headers = srv.headers_seen()
        keys = sample_keys(prompts)
        bodies = {sid: srv.body_for(k) for sid, k in keys.items()}
    assert (s.completed, s.failed, s.requested, s.stopped_reason, s.simulated) == (24, 0, 24, None, True)
    out, _ = out_dirs(tmp_path)
    t = read_responses(out)
    assert t.schema.remove_metadata() == RESPONSES_SCHEMA
    assert sorted(t.column("sample_id").to_pylist()) == sorted(prompts.column("sample_id").to_pylist())
    assert len(list(out.glob("part-*.parquet"))) == 3  # 24 rows at 10 per commit
    rows = {r["sample_id"]: r for r in t.to_pylist()}
    n_tool_rows = 0
    for p in prompts.to_pylist():
        r = rows[p["sample_id"]]
        assert r["source"] == "simulated" and r["backend"] == "sim" and r["endpoint"] == srv.url
        assert r["model"] == "moonshotai/kimi-k2.5" and r["provider"] == "Simulated" and r["quantization"] == "int4"
        assert r["messages_json"] == p["messages_json"] and r["tools_json"] == p["tools_json"]
        assert r["attempts"] == 1 and r["thinking"] is True
        assert json.loads(r["sampling_json"]) == {**SAMPLING.to_dict(), "request_seed": REQUEST_SEED_SCHEME}
        assert r["started_at"] <= r["finished_at"] and r["latency_s"] >= 0
        raw = json.loads(r["raw_response_json"])
        msg = raw["choices"][0]["message"]
        assert r["reasoning"] == msg["reasoning"] and r["content"] == msg["content"]
        user_text = json.loads(p["messages_json"])[-1]["content"]
        assert " ".join(user_text.split()[:10]).replace('"', "'") in r["reasoning"]  # reasoning refers to the prompt
        assert r["generation_id"] == raw["id"] and r["generation_id"].startswith("gen-")
        assert r["usage_completion_tokens"] == raw["usage"]["completion_tokens"] > 0
        assert r["usage_reasoning_tokens"] == raw["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        assert r["cost_usd"] == pytest.approx(raw["usage"]["cost"]) and r["cost_usd"] > 0
        assert r["prompt_token_ids"] is None and r["output_token_ids"] is None
        if r["tool_calls_json"] is not None:
            n_tool_rows += 1
            assert p["tools_json"] is not None and r["finish_reason"] == "tool_calls"
            tcs = json.loads(r["tool_calls_json"])
            assert tcs == msg["tool_calls"] and all(
                tc["id"].startswith(f"functions.{tc['function']['name']}:") for tc in tcs
            )
        else:
            assert r["finish_reason"] == "stop" and r["native_finish_reason"] == "stop"
        body = bodies[p["sample_id"]]
        assert body["model"] == "moonshotai/kimi-k2.5" and body["reasoning"] == {"enabled": True}
        assert (
            body["seed"] == SAMPLING.request_seed(p["sample_id"])
            and body["temperature"] == 1.0
            and body["top_p"] == 0.95
            and body["max_tokens"] == 2048
        )
        assert body["provider"] == {"only": ["moonshotai"], "allow_fallbacks": False, "quantizations": ["int4"]}
        assert body["usage"] == {"include": True} and (("tools" in body) == (p["tools_json"] is not None))
    assert n_tool_rows >= 3
    assert s.spend_usd == pytest.approx(sum(r["cost_usd"] for r in rows.values()))
    assert s.completion_tokens == sum(r["usage_completion_tokens"] for r in rows.values())
    for h in headers:
        assert h["Authorization"] == "Bearer sk-or-v1-testkey-0123456789"
        assert h["Content-Type"] == "application/json" and h["X-Title"] == "eagle-pipeline" and "HTTP-Referer" in h


def test_rerun_after_success_makes_zero_requests_and_limit(tmp_path):
    prompts = make_prompts(30)
    with SimulatedOpenRouterServer() as srv:
        s1 = run(prompts, sim_backend(srv.url), tmp_path, options=RunOptions(limit=12))
        assert (s1.total_prompts, s1.completed) == (12, 12) and srv.total_requests == 12
        s2 = run(prompts, sim_backend(srv.url), tmp_path)
        assert (s2.already_done, s2.requested, s2.completed) == (12, 18, 18) and srv.total_requests == 30
        s3 = run(prompts, sim_backend(srv.url), tmp_path)
        assert (s3.already_done, s3.requested, s3.completed) == (30, 0, 0)
        assert srv.total_requests == 30
        assert all(n == 1 for n in srv.request_counts().values())
    assert read_responses(out_dirs(tmp_path)[0]).num_rows == 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts file opens with inotify")
def test_a_run_start_reads_each_committed_shard_once(tmp_path):
    """The done set, the spend ledger and the progress counts of a resumed run come from one read of the committed
    shards: the kernel sees each opened once in the whole run (the run then only writes new shards)."""
    prompts = make_prompts(30)
    out, _ = out_dirs(tmp_path)
    with SimulatedOpenRouterServer() as srv:
        first = run(prompts, sim_backend(srv.url), tmp_path, options=RunOptions(limit=12, commit_every_rows=4))
        committed = {p.name for p in part_files(out)}
        assert len(committed) == 3
        events: list = []
        with FileOpens(out) as opens:
            s = run(
                prompts,
                sim_backend(srv.url),
                tmp_path,
                progress=events.append,
                options=RunOptions(progress_every_s=0.0),
            )
            counts = opens.counts()
    assert {name: counts[name] for name in committed} == {name: 1 for name in committed}
    assert (s.already_done, s.requested, s.completed) == (12, 18, 18)
    last = events[-1]
    assert (last.response_rows, last.rows_this_run) == (30, 18)  # counted from the 12 committed rows
    assert first.spend_usd > 0 and last.spend_total_usd == pytest.approx(first.spend_usd + s.spend_usd)  # the ledger


def test_429_storm_waits_for_retry_after(tmp_path):
    prompts = make_prompts(6)
    faults = {"http_429": 1.0, "fail_first_n_attempts": 2, "retry_after_s": 1}
    with SimulatedOpenRouterServer(faults=faults) as srv:
        s = run(prompts, sim_backend(srv.url, concurrency=6, max_retries=3), tmp_path)
        log = srv.request_log()
    assert (s.completed, s.failed) == (6, 0)
    t = read_responses(out_dirs(tmp_path)[0])
    assert set(t.column("attempts").to_pylist()) == {3}
    by_key = defaultdict(list)
    for rec in log:
        by_key[rec.key].append(rec)
    assert len(by_key) == 6
    for recs in by_key.values():
        assert [r.status for r in recs] == [429, 429, 200]
        # Server-side arrival times: every retry came at least Retry-After (1 s) after the 429.
        assert all(b.at - a.at >= 0.99 for a, b in zip(recs, recs[1:]))


def test_restarts_after_retry_after_are_spread(tmp_path):
    # Every first attempt gets a 429 with Retry-After: 1 s, as from an account-wide limit. Released at one instant,
    # all the retries would hit the limit together again; they must come back spread over a window instead. (How
    # evenly they are scheduled is checked without a clock below: on a loaded machine the event loop's own delays
    # bunch arrivals that were scheduled apart.)
    n = 120
    prompts = make_prompts(n)
    faults = {"http_429": 1.0, "retry_after_s": 1}
    with SimulatedOpenRouterServer(faults=faults) as srv:
        s = run(prompts, sim_backend(srv.url, concurrency=n, max_retries=2), tmp_path)
        log = srv.request_log()
    assert (s.completed, s.failed) == (n, 0)
    by_key = defaultdict(list)
    for rec in log:
        by_key[rec.key].append(rec)
    assert len(by_key) == n and all([r.status for r in recs] == [429, 200] for recs in by_key.values())
    # Server-side arrival times: how long after Retry-After had passed each retry came.
    late = sorted(b.at - a.at - 1.0 for a, b in by_key.values())
    assert late[0] >= -0.01  # Retry-After honoured by every retry
    assert late[-1] - late[0] >= 0.5  # spread over half a second or more, not a burst
    assert sum(d > 0.3 for d in late) >= n // 4


@pytest.mark.parametrize("seed", range(5))
def test_a_retry_after_pause_schedules_its_wakes_over_the_release_window(seed):
    """The schedule itself, without a clock: 120 workers that find a 1 s pause wake at their own points of a window
    of release_spread_s(1 s) after it, no 100 ms of which holds more than a third of them; a shorter Retry-After
    that comes later does not shorten the pause."""
    pause = RetryPause(random.Random(seed))
    assert pause.wake_at(now=0.0) is None  # no pause yet
    pause.extend(1.0, now=10.0)
    pause.extend(0.2, now=10.1)  # ends before the first: the first holds
    assert (pause.until, pause.spread_s) == (11.0, release_spread_s(1.0))
    wakes = sorted(pause.wake_at(now=10.0 + i / 1000) for i in range(120))
    assert all(11.0 <= w <= 11.0 + pause.spread_s for w in wakes)
    busiest = max(bisect.bisect_right(wakes, t + 0.1) - i for i, t in enumerate(wakes))
    assert busiest <= 120 // 3
    assert wakes[-1] - wakes[0] >= 0.5 * pause.spread_s
    assert pause.wake_at(now=11.0) is None  # over once its end has passed
    pause.extend(2.0, now=10.5)  # a longer one replaces it, with its own window
    assert (pause.until, pause.spread_s) == (12.5, release_spread_s(2.0))


@pytest.mark.parametrize(
    "fault", ["http_500", "http_502", "http_503", "error_200", "no_choices", "cut_body", "bad_json", "timeout"]
)
def test_transient_fault_is_retried_then_succeeds(tmp_path, fault):
    prompts = make_prompts(5)
    with SimulatedOpenRouterServer(faults={fault: 1.0, "retry_after_s": 0.05}) as srv:
        s = run(prompts, sim_backend(srv.url, timeout_s=0.5 if fault == "timeout" else 10.0), tmp_path)
        counts = srv.request_counts()
        log = srv.request_log()
    assert (s.completed, s.failed, s.errors_by_class) == (5, 0, {})
    assert sorted(counts.values()) == [2] * 5
    assert all(r.fault == fault for r in log if r.attempt == 1)
    t = read_responses(out_dirs(tmp_path)[0])
    assert set(t.column("attempts").to_pylist()) == {2}
    assert all(json.loads(x)["choices"] for x in t.column("raw_response_json").to_pylist())


@pytest.mark.parametrize(
    "fault,error_class,status",
    [
        ("http_500", "server_error", 500),
        ("error_200", "provider_error", 200),
        ("cut_body", "connection", None),
        ("bad_json", "malformed_body", 200),
        ("no_choices", "no_choices", 200),
        ("http_429", "rate_limit", 429),
    ],
)
def test_exhausted_retries_are_recorded(tmp_path, fault, error_class, status):
    prompts = make_prompts(8)
    faults = {fault: 0.5, "fail_first_n_attempts": 100, "retry_after_s": 0.01}
    with SimulatedOpenRouterServer(faults=faults) as srv:
        s = run(prompts, sim_backend(srv.url, max_retries=2), tmp_path)
        failing = {r.key for r in srv.request_log() if r.fault == fault}
    out, err = out_dirs(tmp_path)
    e = read_errors(err)
    assert e.schema == ERRORS_SCHEMA
    assert s.failed == e.num_rows == len(failing) > 0 and s.completed == 8 - s.failed
    assert s.errors_by_class == {error_class: s.failed}
    keys = sample_keys(prompts)
    assert {keys[sid] for sid in e.column("sample_id").to_pylist()} == failing
    for r in e.to_pylist():
        assert r["error_class"] == error_class and r["http_status"] == status and r["attempts"] == 3
        assert r["dataset"] == "B1" and r["backend"] == "sim" and r["message"] and r["at"] is not None
    assert read_responses(out).num_rows == s.completed


def test_quality_outcomes_are_responses_not_errors(tmp_path):
    prompts = make_prompts(40, tools_every=1)
    faults = {
        "length": 0.25,
        "empty_content": 0.25,
        "billing_mismatch": 0.25,
        "bad_tool_args": 0.25,
        "empty_reasoning": 0.25,
    }
    with SimulatedOpenRouterServer(faults=faults) as srv:
        s = run(prompts, sim_backend(srv.url), tmp_path)
        plan = srv.plan
    assert (s.completed, s.failed) == (40, 0)
    keys = sample_keys(prompts)
    t = read_responses(out_dirs(tmp_path)[0])
    seen = defaultdict(int)
    for r in t.to_pylist():
        q = plan.quality_faults(keys[r["sample_id"]], 0)
        raw = json.loads(r["raw_response_json"])
        if "length" in q:
            seen["length"] += 1
            assert r["finish_reason"] == "length" and not r["tool_calls_json"]  # kept; the audit filters it downstream
        if "bad_tool_args" in q and "length" not in q:
            seen["bad_tool_args"] += 1
            args = json.loads(r["tool_calls_json"])[0]["function"]["arguments"]
            with pytest.raises(json.JSONDecodeError):
                json.loads(args)
        if "empty_reasoning" in q:
            seen["empty_reasoning"] += 1
            assert r["reasoning"] is None
        if "empty_content" in q and "length" not in q and not r["tool_calls_json"]:
            seen["empty_content"] += 1
            assert r["content"] == "" and r["finish_reason"] == "stop"
        if "billing_mismatch" in q:
            seen["billing"] += 1
            assert r["usage_completion_tokens"] == raw["usage"]["completion_tokens"]
    assert all(seen[k] > 0 for k in ("length", "bad_tool_args", "empty_reasoning", "billing")), dict(seen)


def test_small_max_tokens_gives_length_rows(tmp_path):
    from eagle_pipeline.generation.spec import SamplingSpec

    small = SamplingSpec(seed=7, max_tokens=20)
    prompts = make_prompts(4, sampling=small)
    with SimulatedOpenRouterServer() as srv:
        s = run(prompts, sim_backend(srv.url), tmp_path, sampling=small)
    assert s.completed == 4
    t = read_responses(out_dirs(tmp_path)[0])
    assert set(t.column("finish_reason").to_pylist()) == {"length"}
    assert max(t.column("usage_completion_tokens").to_pylist()) <= 20
    assert set(t.column("content").to_pylist()) == {""}  # reasoning used the whole budget


@pytest.mark.parametrize("fault,reason,error_class", [("http_401", "auth", "auth"), ("http_402", "credits", "credits")])
def test_auth_and_credit_failures_stop_cleanly(tmp_path, fault, reason, error_class):
    prompts = make_prompts(60)
    with SimulatedOpenRouterServer(latency_s=0.005, faults={"after_requests": {fault: 12}}) as srv:
        s = run(
            prompts,
            sim_backend(srv.url, concurrency=3),
            tmp_path,
            options=RunOptions(commit_every_rows=1000, commit_every_s=1000),
        )
        seen = srv.total_requests
    assert s.stopped_reason == reason
    assert s.stopped_detail.startswith(f"{srv.url}/chat/completions: ")  # the endpoint that refused, and why
    assert s.completed == 12  # every answered request before the key broke is kept
    assert 1 <= s.failed <= 3 and s.errors_by_class.get(error_class, 0) >= 1
    assert set(s.errors_by_class) <= {error_class, "cancelled"}
    assert s.requested == s.completed + s.failed and s.requested < 60
    assert seen <= 12 + 3  # no new requests after the stop, only those already in flight
    out, err = out_dirs(tmp_path)
    assert read_responses(out).num_rows == 12  # committed at the stop although no commit threshold was reached
    e = read_errors(err)
    assert e.num_rows == s.failed and error_class in e.column("error_class").to_pylist()
    # Fixed key: the rerun completes exactly the rest.
    with SimulatedOpenRouterServer() as srv2:
        s2 = run(prompts, sim_backend(srv2.url), tmp_path)
        assert srv2.total_requests == 48
    assert (s2.already_done, s2.completed, s2.stopped_reason) == (12, 48, None)
    t = read_responses(out)
    assert t.num_rows == 60 and len(set(t.column("sample_id").to_pylist())) == 60


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once the socket is closed


@pytest.mark.parametrize(
    "endpoint,cause",
    [
        ("http://eagle-unreachable.invalid/v1", "cannot resolve eagle-unreachable.invalid"),
        ("http://127.0.0.1:{port}/v1", "cannot connect to 127.0.0.1:{port}"),
    ],
    ids=["name_not_resolved", "nothing_listens"],
)
def test_an_unreachable_endpoint_stops_the_run_at_its_first_attempts(tmp_path, endpoint, cause):
    port = _closed_port()
    endpoint, cause = endpoint.format(port=port), cause.format(port=port)
    # The default retry policy (8 retries, backoff from 2 s): before, each prompt was tried 9 times for minutes.
    spec = sim_backend(endpoint, concurrency=4, max_retries=8, backoff_base_s=2.0, backoff_max_s=120.0)
    t0 = time.monotonic()
    s = run(make_prompts(30), spec, tmp_path)
    assert time.monotonic() - t0 < 30  # a guard; the attempts below are what the rule is about
    assert s.stopped_reason == "unreachable" and s.completed == 0
    assert s.stopped_detail.startswith(f"{endpoint}/chat/completions: {cause}")
    e = read_errors(out_dirs(tmp_path)[1])
    # One attempt per request in flight when the first one failed (4 workers), none after the stop.
    assert s.requested == s.failed == e.num_rows <= 4
    assert set(e.column("attempts").to_pylist()) == {1}
    assert set(e.column("error_class").to_pylist()) <= {"unreachable", "cancelled"}
    assert len(part_files(out_dirs(tmp_path)[1])) == 1  # the errors of the stop, committed once


def test_circuit_breaker_stops_after_consecutive_failures(tmp_path):
    prompts = make_prompts(30)
    with SimulatedOpenRouterServer(faults={"http_500": 1.0, "fail_first_n_attempts": 1000}) as srv:
        s = run(prompts, sim_backend(srv.url, concurrency=1, max_retries=1, circuit_breaker_failures=5), tmp_path)
        seen = srv.total_requests
    assert s.stopped_reason == "circuit_breaker"
    assert (s.requested, s.failed, s.completed) == (5, 5, 0) and seen == 10
    assert read_errors(out_dirs(tmp_path)[1]).num_rows == 5


def test_budget_stops_new_requests(tmp_path):
    prompts = make_prompts(80)
    with SimulatedOpenRouterServer(price_per_m_prompt=100.0, price_per_m_completion=100.0) as srv:
        first = prompts.slice(0, 1).to_pylist()[0]
        body = {"model": "m", "messages": json.loads(first["messages_json"])}
        one = srv.answer({**body, "seed": SAMPLING.request_seed(first["sample_id"])})["usage"]["cost"]
        budget = 10 * one
        s = run(prompts, sim_backend(srv.url, concurrency=2), tmp_path, options=RunOptions(budget_usd=budget))
        seen = srv.total_requests
    assert s.stopped_reason == "budget"
    assert 5 <= s.completed < 80 and seen == s.requested == s.completed
    assert s.spend_usd <= budget + 2 * 2 * one  # at most the in-flight requests overshoot
    # The dataset budget counts earlier runs' committed spend: a rerun does not start over.
    with SimulatedOpenRouterServer(price_per_m_prompt=100.0, price_per_m_completion=100.0) as srv2:
        s2 = run(prompts, sim_backend(srv2.url, concurrency=2), tmp_path, options=RunOptions(budget_usd=budget))
        assert s2.stopped_reason == "budget" and srv2.total_requests == 0


def test_run_budget_is_shared_across_datasets(tmp_path):
    dirs = [out_dirs(tmp_path, ds)[0] for ds in ("B1", "B2")]
    shared = pipeline_budget(1e9, dirs)
    with SimulatedOpenRouterServer() as srv:
        s1 = run(make_prompts(10), sim_backend(srv.url), tmp_path, run_budget=shared)
        assert shared.spent_usd == pytest.approx(s1.spend_usd) and s1.spend_usd > 0
        capped = pipeline_budget(s1.spend_usd * 0.5, dirs)  # another dataset already spent past the run-wide cap
        s2 = run(make_prompts(10, dataset="B2"), sim_backend(srv.url), tmp_path, dataset="B2", run_budget=capped)
        assert s2.stopped_reason == "budget" and s2.requested == 0 and srv.total_requests == 10


def test_rpm_limit_spaces_requests(tmp_path):
    prompts = make_prompts(6)
    with SimulatedOpenRouterServer() as srv:
        started = time.monotonic()
        run(prompts, sim_backend(srv.url, concurrency=6, rpm=600), tmp_path)  # one request every 0.1 s
        elapsed = time.monotonic() - started
        times = sorted(r.at for r in srv.request_log())
    assert len(times) == 6
    # Six requests need five 0.1 s slots: load can only make the run longer, so this lower bound does not flake.
    assert elapsed >= 0.5
    # The server's arrival stamps show the spacing too. A stamp can be late by however long the loaded server thread
    # waits, so the bound spans all five slots with one slot of slack rather than checking each gap.
    assert times[-1] - times[0] >= 0.4


def test_duplicate_sample_ids_are_requested_once(tmp_path):
    import pyarrow as pa

    prompts = make_prompts(5)
    doubled = pa.concat_tables([prompts, prompts])
    with SimulatedOpenRouterServer() as srv:
        s = run(doubled, sim_backend(srv.url), tmp_path)
        assert srv.total_requests == 5
    assert (s.total_prompts, s.completed, s.skipped_duplicates) == (5, 5, 5)


def test_progress_events_and_logging(tmp_path, caplog):
    events = []
    prompts = make_prompts(20)
    with caplog.at_level(logging.INFO, logger="eagle_pipeline.generation"):
        with SimulatedOpenRouterServer(latency_s=0.05) as srv:
            run(
                prompts,
                sim_backend(srv.url, concurrency=2),
                tmp_path,
                progress=events.append,
                options=RunOptions(progress_every_s=0.1),
            )
    assert len(events) >= 3
    last = events[-1]
    assert (last.done, last.total, last.errors) == (20, 20, 0) and last.rate_per_s > 0 and last.spend_usd > 0
    assert all(a.done <= b.done for a, b in zip(events, events[1:]))
    line = last.format()
    assert "20/20" in line and "B1" in line and "/s" in line
    assert "summary" in caplog.text


def test_progress_line_labels_this_run_and_dataset_totals(tmp_path):
    with SimulatedOpenRouterServer() as srv:
        s1 = run(make_prompts(12), sim_backend(srv.url), tmp_path)
        events = []
        s2 = run(
            make_prompts(30),
            sim_backend(srv.url),
            tmp_path,
            progress=events.append,
            options=RunOptions(progress_every_s=0.1),
        )
    assert s1.spend_usd > 0 and s2.spend_usd > 0
    last = events[-1]
    assert (last.done, last.total, last.done_this_run, last.errors) == (30, 30, 18, 0)
    assert last.spend_usd == pytest.approx(s2.spend_usd)
    assert last.spend_total_usd == pytest.approx(s1.spend_usd + s2.spend_usd)
    line = last.format()
    assert line.startswith("[B1] 30/30 done (100.0%), 18 this run at ")
    assert f"spend ${last.spend_usd:,.4f} this run, ${last.spend_total_usd:,.4f} dataset total;" in line
    assert "errors 0 this run" in line


def test_works_when_called_inside_a_running_loop(tmp_path):
    prompts = make_prompts(3)

    async def inner(url):
        return run(prompts, sim_backend(url), tmp_path)  # sync call from a coroutine: runs on its own thread

    with SimulatedOpenRouterServer() as srv:
        s = asyncio.run(inner(srv.url))
    assert s.completed == 3


def test_simulated_kind_starts_its_own_server(tmp_path):
    prompts = make_prompts(7, tools_every=2)
    s = run(prompts, sim_backend(None, simulated={"latency_s": 0.001, "faults": {"http_502": 0.3}}), tmp_path)
    assert (s.completed, s.simulated, s.failed) == (7, True, 0)
    t = read_responses(out_dirs(tmp_path)[0])
    assert set(t.column("source").to_pylist()) == {"simulated"}
    assert t.column("endpoint")[0].as_py().startswith("http://127.0.0.1:")


def test_a_server_the_runner_starts_bills_at_the_specs_prices(tmp_path):
    # The same loopback server the Dagster shell gets (runner.backend_endpoint): the spec's prices, else the server's.
    prompts = make_prompts(4)
    free = run(prompts, sim_backend(None, price_per_m_prompt=0.0, price_per_m_completion=0.0), tmp_path / "free")
    dear = run(prompts, sim_backend(None, price_per_m_prompt=100.0, price_per_m_completion=100.0), tmp_path / "dear")
    default = run(prompts, sim_backend(None), tmp_path / "default")
    assert (free.completed, dear.completed, default.completed) == (4, 4, 4)
    assert free.spend_usd == 0 and dear.spend_usd > default.spend_usd > 0


def test_missing_api_key_env_fails_before_any_request(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE_TEST_ABSENT_KEY", raising=False)
    with SimulatedOpenRouterServer() as srv:
        with pytest.raises(RuntimeError, match="EAGLE_TEST_ABSENT_KEY") as raised:
            run(make_prompts(2), sim_backend(srv.url, api_key_env="EAGLE_TEST_ABSENT_KEY"), tmp_path)
        assert srv.total_requests == 0
    assert raised.value.__context__ is None  # one message, not chained to the event-loop probe's RuntimeError


def test_stale_temporaries_are_removed_and_runs_are_exclusive(tmp_path):
    out, err = out_dirs(tmp_path)
    out.mkdir(parents=True)
    err.mkdir(parents=True)
    (out / ".part-00000.parquet.abc123.tmp").write_bytes(b"PAR1 torn")
    (err / ".part-00000.parquet.def456.tmp").write_bytes(b"torn")
    with SimulatedOpenRouterServer() as srv:
        run(make_prompts(3), sim_backend(srv.url), tmp_path)
        assert not list(out.glob(".*.tmp")) and not list(err.glob(".*.tmp"))
        with DirLock(out):
            with pytest.raises(RuntimeError, match="another generation run"):
                run(make_prompts(3), sim_backend(srv.url), tmp_path)


def test_api_key_never_reaches_outputs_or_logs(tmp_path, monkeypatch, caplog):
    secret = "sk-or-v1-LEAKCANARY-7f3a9c1e5b2d4f6a8c0e"
    monkeypatch.setenv("EAGLE_TEST_LEAK_KEY", secret)
    prompts = make_prompts(30)
    # The server echoes the Authorization header into error messages: the worst case for a leak.
    faults = {"echo_auth": True, "error_200": 0.3, "fail_first_n_attempts": 100, "retry_after_s": 0.01}
    with caplog.at_level(logging.DEBUG):
        with SimulatedOpenRouterServer(api_key=secret, faults=faults) as srv:
            s = run(
                prompts,
                sim_backend(srv.url, api_key_env="EAGLE_TEST_LEAK_KEY", max_retries=1),
                tmp_path,
                options=RunOptions(commit_every_rows=7),
            )
            assert all(h.get("Authorization") == f"Bearer {secret}" for h in srv.headers_seen())  # the key was used
        with SimulatedOpenRouterServer(faults={"after_requests": {"http_401": 0}, "echo_auth": True}) as srv:
            s401 = run(
                make_prompts(5, dataset="B9"),
                sim_backend(srv.url, api_key_env="EAGLE_TEST_LEAK_KEY"),
                tmp_path,
                dataset="B9",
            )
    assert s.failed > 0 and s.completed > 0 and s401.stopped_reason == "auth"
    e = read_errors(out_dirs(tmp_path)[1])
    assert any("Bearer ***" in m for m in e.column("message").to_pylist())  # the echo happened, redacted
    texts = [caplog.text, repr(s), repr(s401), json.dumps(s.to_dict())]
    for ds in ("B1", "B9"):
        out, err = out_dirs(tmp_path, ds)
        for tbl in (read_responses(out), read_errors(err)):
            texts.append(json.dumps(tbl.to_pylist(), default=str))
    for f in Path(tmp_path).rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
            if f.suffix == ".parquet":
                texts.append(json.dumps(pq.read_table(f).to_pylist(), default=str))
                texts.append(str(pq.read_metadata(f).metadata))
    for text in texts:
        assert secret not in text and "LEAKCANARY" not in text


def test_failed_shard_write_fails_the_run_and_rerun_recovers(tmp_path, monkeypatch):
    from eagle_pipeline.generation.store import shards

    real = shards.write_shard
    calls = {"n": 0}

    def flaky(table, directory, index):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(table, directory, index)

    monkeypatch.setattr(shards, "write_shard", flaky)
    prompts = make_prompts(30)
    with SimulatedOpenRouterServer() as srv:
        with pytest.raises(RuntimeError, match="No space left on device"):
            run(prompts, sim_backend(srv.url, concurrency=1), tmp_path, options=RunOptions(commit_every_rows=5))
        monkeypatch.setattr(shards, "write_shard", real)
        done = read_responses(out_dirs(tmp_path)[0]).num_rows
        assert 0 < done < 30  # the shards written before the failure are intact
        before = srv.total_requests
        s = run(prompts, sim_backend(srv.url), tmp_path)
        # The failed commit's 5 rows stayed in the answer log: the rerun commits them and does not buy them again.
        assert s.recovered_from_log == 5
        recovered = done + 5
        assert s.already_done == recovered and s.completed == 30 - recovered
        assert srv.total_requests - before == 30 - recovered
    assert read_responses(out_dirs(tmp_path)[0]).num_rows == 30


def test_stop_cancels_pending_retries(tmp_path):
    prompts = make_prompts(20)
    keys = list(sample_keys(prompts).values())
    # The first prompt fails with 500 and would wait ~30 s to retry; the key is revoked after 3 requests.
    faults = {"select": {"http_500": [keys[0]]}, "fail_first_n_attempts": 100, "after_requests": {"http_401": 3}}
    with SimulatedOpenRouterServer(latency_s=0.005, faults=faults) as srv:
        s = run(prompts, sim_backend(srv.url, concurrency=2, backoff_base_s=30.0, backoff_max_s=30.0), tmp_path)
    assert s.stopped_reason == "auth" and s.elapsed_s < 10  # the 30 s backoff was interrupted by the stop
    assert s.errors_by_class.get("cancelled") == 1 and s.errors_by_class.get("auth", 0) >= 1
    e = {r["sample_id"]: r for r in read_errors(out_dirs(tmp_path)[1]).to_pylist()}
    first = prompts.column("sample_id")[0].as_py()
    assert (
        e[first]["error_class"] == "cancelled"
        and "auth" in e[first]["message"]
        and "server_error" in e[first]["message"]
    )
    assert s.requested == s.completed + s.failed
