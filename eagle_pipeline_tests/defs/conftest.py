"""A small pipeline configuration in a temporary data root, and a temporary Dagster instance."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_pipeline.config import DEFAULT_CONFIG

REPO = DEFAULT_CONFIG.parent


def write_config(tmp_path: Path, *, datasets=("B1", "B6"), limit=6, simulated=None, audit_actions=None) -> Path:
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    chosen = [d for d in base["datasets"] if d["name"] in datasets]
    for d in chosen:
        d["prompts"] = str(REPO / d["prompts"])
        d["limit"] = limit
        d["max_tokens"] = 512
    base["datasets"] = chosen
    base["data_root"] = str(tmp_path / "data")
    base["backends"]["simulated"]["simulated"] = {"latency_s": 0.0, **(simulated or {})}
    base["audit"]["actions"] = audit_actions or {}
    base["merge"]["rows_per_shard"] = 5
    base["hidden_states"]["shard_size"] = 4
    base["hidden_states"]["disk_budget_gb"] = 1
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


@pytest.fixture
def pipeline_config(tmp_path, monkeypatch):
    """Returns a function that writes a small config and makes it the one in force."""

    def make(**kwargs) -> Path:
        path = write_config(tmp_path, **kwargs)
        monkeypatch.setenv("EAGLE_PIPELINE_CONFIG", str(path))
        return path

    return make


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as inst:
        yield inst
