"""The whole code location loads, and its shape is what the docs say: assets, checks, blocking flags, partitions."""

import subprocess
import sys
from pathlib import Path

import dagster as dg

from eagle_pipeline.audit import GATES
from eagle_pipeline.definitions import defs

REPO = Path(__file__).resolve().parents[2]

EXPECTED_ASSETS = {
    "prompts",
    "responses",
    "token_samples",
    "audit_overview",
    "merged_dataset",
    "draft_vocab",
    "hidden_state_plan",
    "hidden_states",
    "trainer_exports",
}


def _graph():
    return defs.resolve_asset_graph()


def test_every_asset_is_present_with_its_upstreams():
    graph = _graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == EXPECTED_ASSETS
    parents = {
        k.to_user_string(): {p.to_user_string() for p in graph.get(k).parent_keys} for k in graph.get_all_asset_keys()
    }
    assert parents["responses"] == {"prompts"}
    assert parents["token_samples"] == {"responses"}
    assert parents["merged_dataset"] == {"token_samples"}
    assert parents["audit_overview"] == {"token_samples"}
    assert parents["draft_vocab"] == {"merged_dataset"}
    assert parents["hidden_state_plan"] == {"merged_dataset"}
    assert parents["hidden_states"] == {"merged_dataset", "hidden_state_plan"}
    assert parents["trainer_exports"] == {"merged_dataset", "draft_vocab", "hidden_states"}


def test_partitions():
    graph = _graph()
    by_name = {k.to_user_string(): graph.get(k).partitions_def for k in graph.get_all_asset_keys()}
    for name in ("prompts", "responses", "token_samples"):
        assert isinstance(by_name[name], dg.StaticPartitionsDefinition)
        assert by_name[name].get_partition_keys() == [f"B{i}" for i in range(1, 9)]
    assert isinstance(by_name["hidden_states"], dg.DynamicPartitionsDefinition)
    assert by_name["hidden_states"].name == "hidden_state_shards"
    for name in ("audit_overview", "merged_dataset", "draft_vocab", "hidden_state_plan", "trainer_exports"):
        assert by_name[name] is None


def test_every_audit_gate_is_its_own_blocking_check():
    specs = {}
    for checks_def in defs.asset_checks:
        for spec in checks_def.check_specs:
            specs[(spec.asset_key.to_user_string(), spec.name)] = spec
    gate_names = {g.name for g in GATES}
    assert len(gate_names) >= 12
    token_checks = {name for (asset, name) in specs if asset == "token_samples"}
    assert token_checks == gate_names
    merged_checks = {name for (asset, name) in specs if asset == "merged_dataset"}
    assert merged_checks == {
        "merged_row_count_matches_admitted",
        "merged_sample_ids_unique",
        "merged_loss_mask_aligned",
        "merged_spans_end_with_eot",
    }
    state_checks = {name for (asset, name) in specs if asset == "hidden_states"}
    assert state_checks == {
        "shapes_match_token_counts",
        "no_nan_or_inf",
        "ids_match_merged",
        "states_not_degenerate",
        "layers_as_configured",
        "norm_convention_matches_states",
        "teacher_agreement",
    }
    assert all(spec.blocking for spec in specs.values())
    # One check per step: a failing gate never blocks through a passing neighbour.
    assert all(len(list(c.check_specs)) == 1 for c in defs.asset_checks)
    for (asset, _), spec in specs.items():
        if asset == "token_samples":
            assert spec.partitions_def is not None and spec.partitions_def.get_partition_keys()[0] == "B1"


def test_pools_jobs_and_schedules():
    graph = _graph()
    assert graph.get(dg.AssetKey("responses")).pools == {"llm_api"}
    assert graph.get(dg.AssetKey("hidden_states")).pools == {"gpu"}
    for job in (
        "dataset_job",
        "audit_view_job",
        "merge_job",
        "hidden_states_job",
        "exports_job",
        "hidden_states_k8s_job",
    ):
        assert defs.resolve_job_def(job) is not None
    assert defs.resolve_schedule_def("resume_incomplete_datasets").cron_schedule == "0 */6 * * *"


def test_gpu_step_carries_a_gpu_request_for_the_k8s_executor():
    import json

    k8s = defs.resolve_assets_def("hidden_states").op.tags["dagster-k8s/config"]
    k8s = json.loads(k8s) if isinstance(k8s, str) else k8s
    limits = k8s["container_config"]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"


def test_dagster_definitions_validate_passes():
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Validation successful" in proc.stdout + proc.stderr
