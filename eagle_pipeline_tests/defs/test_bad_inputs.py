"""One bad dataset does not take down the others, and a failure says what happened: a missing or malformed prompts
file fails that dataset's run alone with its file and line (the code location loads, the other datasets run, `plan`
needs no prompt file), and an endpoint that cannot be reached fails the dataset's run within seconds, naming it.
Real Dagster runs on a temporary instance."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle_pipeline.cli import main as cli_main
from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.jobs import incomplete_datasets
from eagle_pipeline.defs.resources import PipelineResource
from eagle_pipeline.generation.store.shards import read_errors
from eagle_pipeline.shared.storage import DataRoot

from .conftest import REPO

pytestmark = pytest.mark.slow


def _run(defs, instance, partition_key):
    return defs.resolve_job_def("EAGLE_dataset").execute_in_process(
        instance=instance, partition_key=partition_key, raise_on_error=False
    )


def _failure(result):
    failure = next(e for e in result.all_events if e.is_step_failure)
    error = failure.event_specific_data.error
    assert error.cls_name == "Failure"  # the project's own message, not an exception from somewhere inside
    return failure.step_key, error.message.strip().removeprefix("dagster._core.definitions.events.Failure: ")


def _edit_dataset(path: Path, name: str, **keys) -> int:
    """Change dataset `name` in the configuration file; returns the line of its entry."""
    raw = yaml.safe_load(path.read_text())
    for d in raw["datasets"]:
        if d["name"] == name:
            d.update(keys)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == f"- name: {name}")


def test_a_missing_prompts_file_fails_its_dataset_alone(pipeline_config, instance, tmp_path):
    path = pipeline_config(datasets=("B1", "B6"), limit=4)
    gone = tmp_path / "deleted" / "B1_coding.jsonl"
    entry = _edit_dataset(path, "B1", prompts=str(gone))
    prompts_line = entry + 1  # `prompts:` follows `- name:` in the file yaml.safe_dump writes

    # The code location loads, as the UI and `dg check defs` load it, with both partitions.
    defs = build_defs()
    check = subprocess.run(
        [str(Path(sys.executable).parent / "dg"), "check", "defs"],
        cwd=REPO,
        env={**os.environ, "EAGLE_PIPELINE_CONFIG": str(path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    # The schedule still judges every dataset: B1 is launched with the problem as its reason.
    todo = incomplete_datasets(PipelineResource())
    assert todo["B1"] == f"datasets[0].prompts: file not found: {gone} (line {prompts_line})"

    b1 = _run(defs, instance, "B1")
    assert not b1.success
    step, message = _failure(b1)
    assert step == "prompts"
    assert message == f"B1: {path}: datasets[0].prompts: file not found: {gone} (line {prompts_line})"
    assert _run(defs, instance, "B6").success  # the other dataset runs

    # Sizing a run reads no prompt file.
    assert cli_main(["plan", "--config", str(path), "--tokens", "2000", "--samples", "10"]) == 0


def test_a_malformed_prompts_line_fails_its_dataset_with_file_line_and_column(pipeline_config, instance, tmp_path):
    path = pipeline_config(datasets=("B1", "B6"), limit=4)
    lines = (REPO / "data" / "prompts" / "B1_coding.jsonl").read_text().splitlines()
    lines[2] = lines[2].rstrip()[:-1]  # the closing `}` of line 3 is missing
    bad = tmp_path / "B1_coding.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    _edit_dataset(path, "B1", prompts=str(bad))

    defs = build_defs()
    b1 = _run(defs, instance, "B1")
    step, message = _failure(b1)
    assert step == "prompts"
    # The column is where the `}` is missing, the end of the line (not column 1 of the line after it).
    assert (
        message
        == f"B1: {bad}:3: invalid JSON (Expecting ',' delimiter at column {len(lines[2]) + 1}, the end of the line)"
    )
    assert _run(defs, instance, "B6").success


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_fails_the_dataset_run_within_seconds_naming_it(pipeline_config, instance):
    path = pipeline_config(datasets=("B1",), limit=8)
    raw = yaml.safe_load(path.read_text())
    endpoint = f"http://127.0.0.1:{_closed_port()}/v1"
    # A real server's backend with the file's retry policy (8 retries from 2 s): before, every prompt was tried 9 times.
    raw["backends"]["offline"] = {"kind": "vllm", "endpoint": endpoint, "model": "kimi", "concurrency": 2}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    _edit_dataset(path, "B1", backend="offline")

    t0 = time.monotonic()
    result = _run(build_defs(), instance, "B1")
    assert time.monotonic() - t0 < 30  # a guard; the attempts below are the rule
    step, message = _failure(result)
    assert step == "responses"
    assert message.startswith(
        f"B1: generation stopped early (unreachable) after 0 new rows ({endpoint}/chat/completions: cannot connect to"
    )
    errors = read_errors(DataRoot(raw["data_root"]).errors_dir("B1"))
    assert 1 <= errors.num_rows <= 2 and set(errors.column("attempts").to_pylist()) == {1}
