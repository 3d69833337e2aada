"""An API key never reaches the data root, the Dagster storage or the logs; the spend cap stops generation cleanly."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.generation import provider_token_counters
from eagle_pipeline.generation.store.shards import read_responses
from eagle_pipeline.shared.storage import DataRoot
from eagle_pipeline.simulation import SimulatedOpenRouterServer
from eagle_pipeline.tokens import get_profile, resolve_tokenizer

pytestmark = pytest.mark.slow

KEY = "sk-or-v1-CANARY-7f3a9c21e4b8d6055aa1"


def _point_at_openrouter(path: Path, url: str, **extra) -> None:
    raw = yaml.safe_load(path.read_text())
    raw["backends"]["or"] = {
        "kind": "openrouter",
        "endpoint": url,
        "model": "moonshotai/kimi-k2.5",
        "api_key_env": "EAGLE_TEST_OR_KEY",
        "concurrency": 8,
        "max_retries": 4,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        **extra,
    }
    for d in raw["datasets"]:
        d["backend"] = "or"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def _files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_api_key_never_reaches_data_logs_or_dagster_storage(pipeline_config, instance, tmp_path, monkeypatch, capfd):
    path = pipeline_config(datasets=("B1",), limit=5)
    cfg = yaml.safe_load(path.read_text())
    tok = resolve_tokenizer(cfg["target"]["tokenizer"])
    completion, prompt = provider_token_counters(tok, get_profile("kimi-k2.5"))
    monkeypatch.setenv("EAGLE_TEST_OR_KEY", KEY)
    # A hostile server: it demands the key and echoes the Authorization header back in its transient errors.
    faults = {"http_500": 0.5, "echo_auth": True}
    with SimulatedOpenRouterServer(
        api_key=KEY, faults=faults, count_completion_tokens=completion, count_prompt_tokens=prompt
    ) as srv:
        _point_at_openrouter(path, srv.url)
        result = build_defs().resolve_job_def("EAGLE_dataset").execute_in_process(instance=instance, partition_key="B1")
        assert result.success
        assert any(f == "http_500" for f in (r.fault for r in srv.request_log()))  # the echo path was exercised
    root = DataRoot(tmp_path / "data")
    assert pq.read_table(root.tokens("B1")).num_rows == 5
    out = capfd.readouterr()
    assert KEY not in out.out and KEY not in out.err
    # Everything under tmp_path: data root, Dagster's SQLite event log, run storage and compute logs.
    assert (tmp_path / "dagster_home").exists()
    assert _files_containing(tmp_path, KEY.encode()) == []
    assert _files_containing(tmp_path, KEY[-12:].encode()) == []


def test_pipeline_budget_stops_new_requests_and_keeps_committed_rows(pipeline_config, instance, tmp_path):
    path = pipeline_config(datasets=("B1",), limit=24)
    raw = yaml.safe_load(path.read_text())
    raw["generation"]["budget_usd"] = 0.002  # a handful of simulated responses
    raw["generation"]["commit_every_rows"] = 1
    raw["backends"]["simulated"]["concurrency"] = 1
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    defs = build_defs()
    result = defs.resolve_job_def("EAGLE_dataset").execute_in_process(
        instance=instance, partition_key="B1", raise_on_error=False
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert failure.step_key == "responses" and "stopped early (budget)" in failure.event_specific_data.error.message
    root = DataRoot(tmp_path / "data")
    table = read_responses(root.responses_dir("B1"))
    assert 0 < table.num_rows < 24
    assert sum(table.column("cost_usd").to_pylist()) <= 0.002 + max(table.column("cost_usd").to_pylist())
    # Rerun under the same cap: nothing more is requested, nothing committed is lost.
    again = defs.resolve_job_def("EAGLE_dataset").execute_in_process(
        instance=instance, partition_key="B1", raise_on_error=False
    )
    assert not again.success
    assert read_responses(root.responses_dir("B1")).num_rows == table.num_rows
