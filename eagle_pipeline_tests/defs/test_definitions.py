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
    # The gate checks are token_samples' own (one computation, so a refusal fails the partition); the other checks
    # are definitions of their own.
    tokens_def = next(a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and a.key.path == ["token_samples"])
    specs = {}
    for checks_def in [*defs.asset_checks, tokens_def]:
        for spec in checks_def.check_specs:
            specs[(spec.asset_key.to_user_string(), spec.name)] = spec
    gate_names = {g.name for g in GATES}
    assert len(gate_names) >= 12
    token_checks = {name for (asset, name) in specs if asset == "token_samples"}
    assert token_checks == gate_names
    merged_checks = {name for (asset, name) in specs if asset == "merged_dataset"}
    assert merged_checks == {
        "rows_match_admitted",
        "sample_ids_unique",
        "loss_mask_aligned",
        "spans_end_with_eot",
    }
    state_checks = {name for (asset, name) in specs if asset == "hidden_states"}
    assert state_checks == {
        "shapes_match_tokens",
        "no_nan_or_inf",
        "ids_match_merged",
        "states_not_degenerate",
        "layers_as_configured",
        "norm_convention_holds",
        "teacher_agreement",
    }
    # The audit view's own check blocks nothing (nothing is downstream of it); every other check blocks.
    assert {key for key, spec in specs.items() if not spec.blocking} == {("audit_overview", "every_dataset_fit")}
    # Every other check is its own step: a failing one never blocks through a passing neighbour.
    assert all(len(list(c.check_specs)) == 1 for c in defs.asset_checks)
    assert tokens_def.can_subset  # the asset without its checks, or the checks alone on the file on disk
    for (asset, _), spec in specs.items():
        if asset == "token_samples":
            assert spec.partitions_def is not None and spec.partitions_def.get_partition_keys()[0] == "B1"


def test_pools_jobs_and_schedules():
    graph = _graph()
    assert graph.get(dg.AssetKey("responses")).pools == {"llm_api"}
    assert graph.get(dg.AssetKey("hidden_states")).pools == {"gpu"}
    for job in (
        "EAGLE_dataset",
        "EAGLE_audit_view",
        "EAGLE_merge",
        "EAGLE_hidden_states",
        "EAGLE_exports",
        "EAGLE_hidden_states_k8s",
    ):
        assert defs.resolve_job_def(job) is not None
    assert defs.resolve_schedule_def("resume_incomplete_datasets").cron_schedule == "0 */6 * * *"


# The job the UI launches for a selection made in the asset graph: the first of the assets' common job names, in the
# order the repository snapshot (GraphQL's `jobNames`) gives them (LaunchAssetExecutionButton's getCommonJob).
LAUNCHED_FROM_GRAPH = {
    "prompts": "EAGLE_dataset",
    "responses": "EAGLE_dataset",
    "token_samples": "EAGLE_dataset",
    "audit_overview": "EAGLE_audit_view",
    "merged_dataset": "EAGLE_merge",
    "draft_vocab": "EAGLE_merge",
    "hidden_state_plan": "EAGLE_merge",
    "hidden_states": "EAGLE_hidden_states",  # in EAGLE_hidden_states_k8s too; the one-host job is the one launched
    "trainer_exports": "EAGLE_exports",
}


def _common_job(snaps: dict, assets) -> str | None:
    common = [j for j in snaps[assets[0]].job_names if all(j in snaps[a].job_names for a in assets)]
    return common[0] if common else None


def test_a_selection_made_in_the_asset_graph_launches_the_project_job():
    from dagster._core.remote_representation.external_data import RepositorySnap

    snap = RepositorySnap.from_def(defs.get_repository_def())
    snaps = {n.asset_key.to_user_string(): n for n in snap.asset_nodes}
    for node in snaps.values():
        assert node.job_names == sorted(node.job_names), node.job_names  # the order the UI picks from
        assert "__ASSET_JOB" in node.job_names  # still there; sorted after every EAGLE_ job
    assert {a: _common_job(snaps, [a]) for a in snaps} == LAUNCHED_FROM_GRAPH
    assert _common_job(snaps, ["prompts", "responses", "token_samples"]) == "EAGLE_dataset"
    # A selection across jobs has only the implicit job in common.
    assert _common_job(snaps, ["token_samples", "merged_dataset"]) == "__ASSET_JOB"
    # The launched run holds the audit checks: the UI adds the checks whose jobNames include the job.
    checks = [c for c in snap.asset_check_nodes or [] if c.asset_key.to_user_string() == "token_samples"]
    assert len(checks) == len(GATES) and all("EAGLE_dataset" in c.job_names for c in checks)


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


def test_figures_are_rounded_as_people_read_them_and_each_shard_is_its_own_series():
    from types import SimpleNamespace

    from eagle_pipeline.defs.hidden_states import _check_counts
    from eagle_pipeline.defs.metadata import readable

    assert readable(0.19072974054353514) == 0.191 and readable(5037.759754778832) == 5038.0
    assert readable(0.000123456) == 0.000123 and readable(0.0) == 0.0 and readable(float("inf")) == float("inf")
    # Dagster plots a check's numeric metadata over all partitions: the shard in the key draws one line per shard.
    result = SimpleNamespace(checked=4, failing=1, failing_sample_ids=["s1"])
    keys = set(_check_counts("00002", result))
    assert {"shard 00002: samples checked", "shard 00002: samples failing"} <= keys
    assert not {"samples_checked", "samples_failing"} & keys
