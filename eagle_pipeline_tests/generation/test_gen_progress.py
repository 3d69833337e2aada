"""The figures of a progress report: done/total with earlier runs' rows, rate, ETA, spend, failures by class."""

from __future__ import annotations

import pytest

from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.store.shards import committed_sample_ids, read_errors, read_responses
from eagle_pipeline.generation.summary import ProgressEvent, committed_totals
from eagle_pipeline.simulation import SimulatedOpenRouterServer
from eagle_pipeline_tests.generation.generation_helpers import make_prompts, out_dirs, run, sim_backend


def test_figures_of_one_event():
    event = ProgressEvent(
        dataset="B3",
        done=30,
        total=40,
        done_this_run=10,
        rate_per_s=2.5,
        eta_s=4.0,
        spend_usd=0.1234567,
        spend_total_usd=1.5,
        errors=3,
        elapsed_s=4.0,
        already_done=20,
        errors_by_class={"timeout": 1, "rate_limit": 2},
        rows_this_run=10,
        response_rows=30,
    )
    assert event.figures() == {
        "current_prompts": 40,
        "current_prompts_answered": 30,
        "current_prompts_missing": 10,
        "percent_done": 75.0,
        "already_done": 20,
        "completed_this_run": 10,
        "response_rows": 30,
        "failed_this_run": 3,
        "errors_by_class_this_run": {"rate_limit": 2, "timeout": 1},
        "rate_per_s": 2.5,
        "spend_usd_this_run": 0.123457,
        "spend_usd_ledger": 1.5,
        "elapsed_s": 4.0,
        "eta_s": 4.0,
    }
    assert event.headline() == "B3 30/40 (75%) 2.5/s eta 4s $0.1235 run $1.5000 total 3 failed"
    assert "errors 3 this run (rate_limit 2, timeout 1);" in event.format()
    no_rate = ProgressEvent("B3", 0, 5, 0, 0.0, None, 0.0, 0.0, 0, 0.1)
    assert "eta_s" not in no_rate.figures() and " eta - " in no_rate.headline()
    # regenerate: all_turns: prompts are conversations, rows are turns; each key counts one of them.
    turns = ProgressEvent("B5", 3, 4, 2, 0.5, 2.0, 0.0, 0.0, 0, 4.0, already_done=1, rows_this_run=7, response_rows=10)
    figures = turns.figures()
    assert (figures["current_prompts_answered"], figures["already_done"]) == (3, 1)
    assert (figures["completed_this_run"], figures["response_rows"]) == (7, 10)
    assert "3/4 done (75.0%), 2 this run at 0.5/s, eta 2s; 10 response rows (7 this run);" in turns.format()


def test_reports_count_earlier_rows_and_agree_with_the_files_at_the_end(tmp_path):
    """A resumed run: done starts at the committed rows, failures are counted by class, and the last report's spend
    and failures are what the committed files hold (the final metadata's sources)."""
    with SimulatedOpenRouterServer() as srv:
        first = run(make_prompts(4), sim_backend(srv.url), tmp_path)
    events: list[ProgressEvent] = []
    with SimulatedOpenRouterServer(latency_s=0.05, faults={"after_requests": {"http_500": 3}}) as srv:
        second = run(
            make_prompts(10),
            sim_backend(srv.url, concurrency=1, max_retries=0),
            tmp_path,
            progress=events.append,
            options=RunOptions(progress_every_s=0.05),
        )
    assert len(events) >= 3
    assert all(e.already_done == 4 and e.total == 10 for e in events)
    assert [e.done for e in events] == sorted(e.done for e in events)
    last = events[-1].figures()
    # 6 new prompts: the server answers 3, then fails every request with a 500 (no retries).
    assert (last["current_prompts_answered"], last["completed_this_run"], last["failed_this_run"]) == (7, 3, 3)
    assert last["errors_by_class_this_run"] == {"server_error": 3} == second.errors_by_class
    assert last["spend_usd_this_run"] == round(second.spend_usd, 6) > 0
    responses_dir, errors_dir = out_dirs(tmp_path)
    assert last["spend_usd_ledger"] == pytest.approx(committed_sample_ids(responses_dir)[1], abs=1e-6)
    assert last["spend_usd_ledger"] == pytest.approx(first.spend_usd + second.spend_usd, abs=1e-6)
    assert committed_totals(read_responses(responses_dir), read_errors(errors_dir))["errors_by_class"] == {
        "server_error": 3
    }
