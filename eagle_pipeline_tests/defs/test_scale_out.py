"""Scale-out of hidden-state extraction: the pod dagster-k8s would create for a shard step, shards extracting in
parallel runs under the 'gpu' pool, one GPU per shard on a multi-GPU host, the disk-budget refusal, and a broken
shard repaired alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import dagster as dg
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME, shard_key
from eagle_pipeline.shared.storage import DataRoot, write_json_atomic

from .conftest import write_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "k8s"
SHARD_SIZE = 4
N_ROWS = 10  # three shards: 4 + 4 + 2 rows


# ---------------------------------------------------------------------------------------------------------
# A small merged dataset, its shard partitions and its plan (the merge itself is covered by test_pipeline_run)


def _config(tmp_path: Path, monkeypatch, *, budget_gb: float = 1.0, **hidden_states) -> Path:
    path = write_config(tmp_path, datasets=("B1",))
    raw = yaml.safe_load(path.read_text())
    raw["target"]["tokenizer"] = "demo"  # a 2,560-token vocabulary keeps the tiny model's embedding small
    raw["hidden_states"]["shard_size"] = SHARD_SIZE
    raw["hidden_states"]["disk_budget_gb"] = budget_gb
    raw["hidden_states"].update(hidden_states)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.setenv("EAGLE_PIPELINE_CONFIG", str(path))
    return path


def _merged(tmp_path: Path, instance: dg.DagsterInstance, n_rows: int = N_ROWS) -> DataRoot:
    """Write a merged table of `n_rows` rows with its manifest, register its shards, materialize the plan."""
    from eagle_pipeline.defs.hidden_states import hidden_state_plan
    from eagle_pipeline.defs.resources import PipelineResource
    from eagle_pipeline.hidden_states.store.merged import num_shards

    root = DataRoot(tmp_path / "data")
    write_merged_with_manifest(root, n_rows, PipelineResource().tokenizer().vocab_size)
    instance.add_dynamic_partitions(
        SHARD_PARTITIONS_NAME, [shard_key(i) for i in range(num_shards(n_rows, SHARD_SIZE))]
    )
    assert dg.materialize([hidden_state_plan], instance=instance, resources={"pipeline": PipelineResource()}).success
    return root


def write_merged_with_manifest(root: DataRoot, n_rows: int, vocab: int) -> None:
    """A synthetic merged table of `n_rows` rows under `root`, with the manifest the merge would write."""
    import pyarrow.parquet as pq

    from eagle_pipeline.merge.manifest import MANIFEST_NAME, SHARD_GLOB, MergeManifest
    from eagle_pipeline.shared.storage import file_sha256
    from eagle_pipeline_tests.doubles.synthetic import write_synthetic_merged

    _, tokens = write_synthetic_merged(
        root.merged_dir, n_rows, vocab_size=vocab, mean_tokens=40, max_tokens=96, rows_per_part=3
    )
    fields = MergeManifest.__dataclass_fields__
    manifest = MergeManifest(
        **{k: ({} if "dict" in str(f.type) else [] if "list" in str(f.type) else 0) for k, f in fields.items()}
    )
    manifest.rows_total, manifest.tokens_total, manifest.datasets = n_rows, tokens, ["B1"]
    # The manifest lists the table's files, as the merge writes it (they are the table: merged_shard_paths).
    manifest.shards = [
        {"path": p.name, "rows": pq.ParquetFile(p).metadata.num_rows, "sha256": file_sha256(p)}
        for p in sorted(root.merged_dir.glob(SHARD_GLOB))
    ]
    write_json_atomic(manifest.to_dict(), root.merged_dir / MANIFEST_NAME)


def _run_shard(instance, key, defs=None):
    defs = defs or build_defs()
    return defs.resolve_job_def("EAGLE_hidden_states").execute_in_process(
        instance=instance, partition_key=key, raise_on_error=False
    )


def _engine_shard_run(
    tmp_path: Path, monkeypatch, instance: dg.DagsterInstance, engine: str, settings: dict, **hidden_states
):
    """Shard 00001 of the small merged table through `engine` (its `hidden_states.<engine>` section: `settings`;
    other `hidden_states` keys: `hidden_states`) in a real Dagster run, which must succeed with its 3 structural +
    4 semantic checks passed. Returns the data root, the run's result and each semantic check's verdict."""
    _config(tmp_path, monkeypatch, engine=engine, **{engine: settings}, **hidden_states)
    root = _merged(tmp_path, instance)
    result = _run_shard(instance, "00001")
    assert result.success
    checks = result.get_asset_check_evaluations()
    assert len(checks) == 7 and all(e.passed for e in checks)
    return root, result, {e.check_name: e.metadata["verdict"].value for e in checks if "verdict" in e.metadata}


# ---------------------------------------------------------------------------------------------------------
# 1. Kubernetes: the Job dagster-k8s's step handler would create for each step of EAGLE_hidden_states_k8s


def _k8s_job():
    from eagle_pipeline.defs.jobs import scale_out_jobs

    return dg.Definitions.merge(build_defs(), dg.Definitions(jobs=scale_out_jobs)).resolve_job_def(
        "EAGLE_hidden_states_k8s"
    )


def hidden_states_k8s_job_for_reconstruction():
    """Module-level so that dagster can rebuild the job from a python origin (as a step pod would)."""
    return _k8s_job()


KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: test, user: {token: test}}]
contexts: [{name: test, context: {cluster: test, user: test, namespace: eagle}}]
current-context: test
"""


def _launched_k8s_jobs(tmp_path: Path, step_keys: list[str]) -> dict:
    """Run the k8s executor's own launch path (K8sStepHandler.launch_step) for each step with the deploy/k8s
    instance and run config; returns step key -> the kubernetes V1Job body it would have created."""
    pytest.importorskip("dagster_k8s")
    from dagster._core.execution.api import create_execution_plan
    from dagster._core.execution.context.system import PlanData, PlanOrchestrationContext
    from dagster._core.execution.context_creation_job import create_context_free_log_manager
    from dagster._core.execution.retries import RetryMode
    from dagster._core.executor.init import InitExecutorContext
    from dagster._core.executor.step_delegating import StepHandlerContext
    from dagster._core.test_utils import create_run_for_test
    from dagster._grpc.types import ExecuteStepArgs
    from dagster_k8s import k8s_job_executor
    from dagster_k8s.client import DagsterKubernetesClient

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    launcher = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())["run_launcher"]
    # Out of a cluster: the same launcher, with a kubeconfig pointing at a closed loopback port and a job image.
    launcher["config"].update(load_incluster_config=False, kubeconfig_file=str(kubeconfig), job_image="eagle:test")
    run_config = yaml.safe_load((DEPLOY / "EAGLE_hidden_states_k8s.run_config.yaml").read_text())

    recon = dg.build_reconstructable_job(__name__, "hidden_states_k8s_job_for_reconstruction")
    job_def = recon.get_definition()
    resolved = dg.validate_run_config(job_def, run_config)  # the deploy example is valid run config for the job
    batch_api = mock.MagicMock()
    production_client = DagsterKubernetesClient.production_client
    patched = lambda **kw: production_client(batch_api_override=batch_api, core_api_override=mock.MagicMock())  # noqa: E731
    (tmp_path / "k8s_home").mkdir()
    with (
        dg.instance_for_test(overrides={"run_launcher": launcher}, temp_dir=str(tmp_path / "k8s_home")) as instance,
        mock.patch.object(DagsterKubernetesClient, "production_client", staticmethod(patched)),
    ):
        executor = k8s_job_executor.executor_creation_fn(
            InitExecutorContext(
                job=recon,
                executor_def=k8s_job_executor,
                executor_config=resolved["execution"]["k8s"],
                instance=instance,
            )
        )
        run = create_run_for_test(
            instance,
            job_name="EAGLE_hidden_states_k8s",
            job_code_origin=recon.get_python_origin(),
            tags={"dagster/partition": "00001"},
        )
        plan = create_execution_plan(recon, tags=run.tags)
        plan_context = PlanOrchestrationContext(
            plan_data=PlanData(
                job=recon,
                dagster_run=run,
                instance=instance,
                execution_plan=plan,
                raise_on_error=True,
                retry_mode=RetryMode.DISABLED,
            ),
            log_manager=create_context_free_log_manager(instance, run),
            executor=executor,
            output_capture=None,
        )
        bodies = {}
        for step_key in step_keys:
            batch_api.reset_mock()
            args = ExecuteStepArgs(recon.get_python_origin(), run.run_id, [step_key])
            context = StepHandlerContext(
                instance=instance, plan_context=plan_context, steps=plan.steps, execute_step_args=args, dagster_run=run
            )
            list(executor._step_handler.launch_step(context))
            (call,) = [c for c in batch_api.method_calls if c[0] == "create_namespaced_job"]
            assert call.kwargs["namespace"] == "eagle"
            bodies[step_key] = call.kwargs["body"]
    return bodies


def test_k8s_step_pod_for_a_shard_requests_a_gpu_and_its_checks_do_not(tmp_path):
    bodies = _launched_k8s_jobs(tmp_path, ["hidden_states", "hidden_states_ids_match_merged"])

    gpu_pod = bodies["hidden_states"].spec.template.spec
    (container,) = gpu_pod.containers
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    assert container.resources.requests["nvidia.com/gpu"] == "1"
    # The deploy example's per-step override is merged over the op tags, not instead of them.
    assert container.resources.limits["memory"] == "128Gi" and container.resources.requests["cpu"] == "8"
    assert gpu_pod.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    tolerations = [t.to_dict() for t in gpu_pod.tolerations]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}.items() <= tolerations[0].items()
    # From the K8sRunLauncher: every step sees the shared data root and the configuration on it.
    assert {(m.name, m.mount_path) for m in container.volume_mounts} >= {("eagle-data", "/data/eagle")}
    assert any(v.name == "eagle-data" and v.persistent_volume_claim.claim_name == "eagle-data" for v in gpu_pod.volumes)
    env = {e.name: e.value for e in container.env}
    assert env["EAGLE_PIPELINE_CONFIG"] == "/data/eagle/pipeline.yaml"
    assert env["DAGSTER_RUN_STEP_KEY"] == "hidden_states"
    assert container.image == "eagle:test"
    assert bodies["hidden_states"].spec.backoff_limit == 0
    assert bodies["hidden_states"].metadata.labels["dagster/op"] == "hidden_states"

    check_pod = bodies["hidden_states_ids_match_merged"].spec.template.spec
    limits = (check_pod.containers[0].resources.limits or {}) if check_pod.containers[0].resources else {}
    assert "nvidia.com/gpu" not in limits  # verification is CPU work: no GPU node held for it
    assert not check_pod.tolerations and not check_pod.node_selector


def test_deploy_instance_example_is_valid_dagster_config():
    from dagster._config import validate_config
    from dagster._core.instance.config import dagster_instance_config_schema

    instance_yaml = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    result = validate_config(dagster_instance_config_schema(), instance_yaml)
    assert result.success, result.errors
    assert instance_yaml["concurrency"]["pools"]["granularity"] == "op"  # only the extraction step holds a slot
    values = yaml.safe_load((DEPLOY / "values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "eagle_pipeline.definitions"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher" and values["concurrency"]["pools"]["granularity"] == "op"


def test_code_location_with_the_k8s_job_loads_and_validates_without_a_cluster(tmp_path):
    pytest.importorskip("dagster_k8s")
    job = _k8s_job()
    assert job.executor_def.name == "k8s"
    assert job.partitions_def.name == SHARD_PARTITIONS_NAME
    step = job.graph.node_named("hidden_states")
    assert "nvidia.com/gpu" in str(step.tags["dagster-k8s/config"])
    assert {n.name for n in job.nodes} == {
        "hidden_states",
        "hidden_states_ids_match_merged",
        "hidden_states_no_nan_or_inf",
        "hidden_states_shapes_match_tokens",
        "hidden_states_states_not_degenerate",
        "hidden_states_layers_as_configured",
        "hidden_states_norm_convention_holds",
        "hidden_states_teacher_agreement",
    }
    location = tmp_path / "location_with_k8s.py"
    location.write_text(
        "import dagster as dg\n"
        "from eagle_pipeline.definitions import build_defs\n"
        "from eagle_pipeline.defs.jobs import scale_out_jobs\n"
        "defs = dg.Definitions.merge(build_defs(), dg.Definitions(jobs=scale_out_jobs))\n"
    )
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")}  # no cluster anywhere
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-f", str(location)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------
# 2. Local parallelism: one run per shard, steps in separate processes, bounded by the 'gpu' pool


def _slot_window(instance, run_id, step_key):
    """From the step's launch (after its pool slot was claimed) to its success (before the slot is freed)."""
    records = instance.all_logs(run_id)

    def at(kind):
        return next(r.timestamp for r in records if r.step_key == step_key and r.dagster_event_type == kind)

    return at(dg.DagsterEventType.STEP_WORKER_STARTING), at(dg.DagsterEventType.STEP_SUCCESS)


@pytest.mark.slow
def test_shards_extract_in_parallel_runs_within_the_gpu_pool(tmp_path, monkeypatch):
    from eagle_pipeline.hidden_states.checks.verify import verify_shard
    from eagle_pipeline.hidden_states.store.format import shard_status

    _config(tmp_path, monkeypatch)
    (tmp_path / "pool_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "pool_home")) as instance:
        # Two shards: enough to show them side by side; a third would only wait for a slot (a pool of two) and
        # double the time on a 2-core test machine.
        root = _merged(tmp_path, instance, n_rows=2 * SHARD_SIZE)
        instance.event_log_storage.set_concurrency_slots("gpu", 2)  # `dagster instance concurrency set gpu 2`
        keys = instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME)
        assert len(keys) == 2
        # What a backfill with BackfillPolicy.multi_run(1) launches: one run per shard, all at once, each in its own
        # process (as the DefaultRunLauncher does), each with the multiprocess executor (one process per step).
        # Dagster runs are not thread-safe within one process, hence processes rather than threads. The checks are
        # left out (-o) to keep this fast: their code, verify_shard, is called directly below.
        # One torch thread per process: the runs share this machine's cores, as n runs share a GPU host's CPUs.
        env = {**os.environ, "DAGSTER_HOME": instance.root_directory, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        dagster = str(Path(sys.executable).parent / "dagster")
        procs = {
            key: subprocess.Popen(
                [
                    dagster,
                    "job",
                    "execute",
                    "-m",
                    "eagle_pipeline.definitions",
                    "-j",
                    "EAGLE_hidden_states",
                    "-o",
                    "hidden_states",
                    "--tags",
                    json.dumps({"dagster/partition": key}),
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for key in keys
        }
        outputs = {key: p.communicate(timeout=240)[0] for key, p in procs.items()}
        assert all(p.returncode == 0 for p in procs.values()), {k: o[-3000:] for k, o in outputs.items()}
        runs = {r.tags["dagster/partition"]: r for r in instance.get_runs() if r.job_name == "EAGLE_hidden_states"}
        results = [(key, runs[key].status == dg.DagsterRunStatus.SUCCESS, runs[key].run_id) for key in keys]
        assert [ok for _, ok, _ in results] == [True] * 2, results
        windows, pids = [], set()
        for key, _, run_id in results:
            assert shard_status(root.hidden_states_dir, int(key)) == "done"
            assert all(c.passed for c in verify_shard(root.hidden_states_dir, int(key), root.merged_dir).values())
            mat = instance.fetch_materializations(dg.AssetKey("hidden_states"), limit=10).records
            by_run = [m for m in mat if m.run_id == run_id]
            assert by_run and by_run[0].asset_materialization.partition == key
            pids.add(by_run[0].asset_materialization.metadata["pid"].value)
            windows.append(_slot_window(instance, run_id, "hidden_states"))
        assert len(pids) == 2 and os.getpid() not in pids  # each shard in its own step process

        (first_start, first_end), (second_start, second_end) = windows
        assert first_start < second_end and second_start < first_end, windows  # the two extractions overlapped
        gpu = instance.event_log_storage.get_concurrency_info("gpu")
        assert gpu.slot_count == 2 and not gpu.claimed_slots  # both slots were held and given back


# ---------------------------------------------------------------------------------------------------------
# One GPU per shard on a multi-GPU host, and a model cache that never crosses a process boundary


def test_shards_lease_distinct_gpus_and_prefer_shard_modulo(tmp_path):
    from eagle_pipeline.hidden_states.engines.runtime import shard_device

    lease = dict(n_gpus=4, lease_dir=tmp_path, wait_s=0.0, poll_s=0.01)
    with shard_device("auto", 5, **lease) as d5:
        assert d5 == "cuda:1"  # 5 % 4
        with shard_device("auto", 1, **lease) as d1, shard_device("cuda", 9, **lease) as d9:
            assert d1 == "cuda:2" and d9 == "cuda:3"  # cuda:1 is held: the next free ones
            with shard_device("auto", 0, **lease) as d0:
                assert d0 == "cuda:0"
                with pytest.raises(RuntimeError, match=r"no free GPU for shard 7 .*'gpu' pool limit"):
                    with shard_device("auto", 7, **lease):
                        pass
    with shard_device("auto", 5, **lease) as again:
        assert again == "cuda:1"  # released on exit
    with shard_device("auto", 2, prefer=["cuda:3", "cpu"], **lease) as preferred:
        assert preferred == "cuda:3"  # where this process already holds a model
    with shard_device("auto", 3, n_gpus=0, lease_dir=tmp_path) as none:
        assert none == "cpu"
    with shard_device("cpu", 3, n_gpus=4, lease_dir=tmp_path) as explicit:
        assert explicit == "cpu"


def test_a_lease_is_held_across_processes(tmp_path):
    from eagle_pipeline.hidden_states.engines.runtime import shard_device

    code = (
        "import sys, time\n"
        "from eagle_pipeline.hidden_states.engines.runtime import shard_device\n"
        f"with shard_device('auto', 0, n_gpus=2, lease_dir={str(tmp_path)!r}) as d:\n"
        "    print(d, flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "cuda:0"
        with shard_device("auto", 0, n_gpus=2, lease_dir=tmp_path, wait_s=0.0) as mine:
            assert mine == "cuda:1"  # another process (another run) holds cuda:0
    finally:
        child.communicate("\n", timeout=60)
    with shard_device("auto", 0, n_gpus=2, lease_dir=tmp_path, wait_s=0.0) as freed:
        assert freed == "cuda:0"


def test_model_cache_is_per_process(monkeypatch):
    from eagle_pipeline.hidden_states.engines import runtime

    cache = runtime.MODEL_CACHE  # the process-wide cache the asset uses, emptied for the test
    monkeypatch.setattr(cache, "_models", {})
    monkeypatch.setattr(runtime, "load_extraction_model", lambda *a, **k: object())
    first = cache.get("tiny-random", "llama", 0, 64, "cpu")
    assert cache.get("tiny-random", "llama", 0, 64, "cpu") is first  # consecutive shards reuse it
    other = cache.get("tiny-random", "llama", 0, 64, "cuda:1")
    assert cache.devices() == ["cuda:1", "cpu"]
    cache.get("tiny-random", "llama", 0, 64, "cpu")
    assert cache.devices() == ["cpu", "cuda:1"]  # most recently used first
    cache.get("tiny-random", "llama", 1, 64, "cpu")  # a third model evicts the least recently used
    assert other not in cache.models() and first in cache.models()

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child must not reuse its parent's (CUDA) model, and must load its own
        try:
            fresh = cache.get("tiny-random", "llama", 0, 64, "cpu")
            os.write(write, b"ok" if fresh is not first and cache.devices() == ["cpu"] else b"reused")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"ok"
    os.waitpid(pid, 0)
    assert cache.get("tiny-random", "llama", 0, 64, "cpu") is first  # the parent's cache is intact


# ---------------------------------------------------------------------------------------------------------
# 3. The disk budget: extraction refuses to start, naming the planned bytes and the budget


def test_disk_budget_refuses_extraction_and_the_plan_shows_both_plans(tmp_path, monkeypatch, instance):
    from eagle_pipeline.shared.storage import read_json

    _config(tmp_path, monkeypatch, budget_gb=1e-6)  # 1,000 bytes
    root = _merged(tmp_path, instance)

    plan_mat = (
        instance.fetch_materializations(dg.AssetKey("hidden_state_plan"), limit=1).records[0].asset_materialization
    )
    md = {k: v.value for k, v in plan_mat.metadata.items()}
    assert "| hidden size / layers | 7168 / 61 |" in md["target_plan"]  # Kimi-K2.5, what production costs
    assert md["target_bytes_on_disk"] > 10**6 and md["target_gpu_hours"] >= 0
    assert "hidden size / layers | 7168" not in md["this_run_plan"]  # the tiny model this run extracts with
    assert "EXCEEDS the disk budget" in md["this_run_plan"] and md["exceeds_disk_budget"] is True
    planned = read_json(root.hidden_states_dir / "plan.json")["this_run"]["bytes_on_disk"]
    assert planned == md["this_run_bytes_on_disk"] > 1000

    result = _run_shard(instance, "00000")
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.event_specific_data.error.message
    assert f"{planned:,} bytes" in message and "1,000 bytes" in message and "hidden_states.disk_budget_gb" in message
    assert failure.event_specific_data.user_failure_data.metadata["planned_bytes"].value == planned
    assert not list(root.hidden_states_dir.glob("shard-*"))  # nothing was written

    # The budget in force is the configuration's, read at run time: raising it lets the same plan through.
    _config(tmp_path, monkeypatch, budget_gb=1.0)
    assert _run_shard(instance, "00000").success


# ---------------------------------------------------------------------------------------------------------
# 4. A broken shard reruns alone


def test_a_corrupted_shard_is_partial_and_rematerializing_it_alone_repairs_it(tmp_path, monkeypatch, instance):
    from eagle_pipeline.hidden_states.checks.verify import verify_shard
    from eagle_pipeline.hidden_states.store.format import shard_paths, shard_status

    _config(tmp_path, monkeypatch)
    root = _merged(tmp_path, instance)
    defs = build_defs()
    keys = instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME)
    for key in keys:
        assert _run_shard(instance, key, defs).success
    files = {k: shard_paths(root.hidden_states_dir, int(k)) for k in keys}
    stamps = {k: [p.stat().st_mtime_ns for p in files[k]] for k in keys}

    st_path, _ = files["00001"]
    with open(st_path, "r+b") as f:  # a truncated write, e.g. a node lost mid-copy
        f.truncate(st_path.stat().st_size // 2)
    assert shard_status(root.hidden_states_dir, 1) == "partial"
    assert shard_status(root.hidden_states_dir, 1, check_hash=False) == "partial"

    result = _run_shard(instance, "00001", defs)
    assert result.success
    assert all(e.passed for e in result.get_asset_check_evaluations())
    (mat,) = result.asset_materializations_for_node("hidden_states")
    assert mat.metadata["shard_status_before"].value == "partial"
    assert mat.metadata["skipped_already_done"].value is False
    assert shard_status(root.hidden_states_dir, 1) == "done"
    assert all(c.passed for c in verify_shard(root.hidden_states_dir, 1, root.merged_dir).values())
    for key in ("00000", "00002"):
        assert [p.stat().st_mtime_ns for p in files[key]] == stamps[key]  # the other shards were not touched
        assert shard_status(root.hidden_states_dir, int(key)) == "done"
    assert [p.stat().st_mtime_ns for p in files["00001"]] != stamps["00001"]

    # Rerunning a done shard is a no-op that says so.
    again = _run_shard(instance, "00000", defs)
    (mat,) = again.asset_materializations_for_node("hidden_states")
    assert mat.metadata["skipped_already_done"].value is True and mat.metadata["shard_status_before"].value == "done"
    assert mat.metadata["device"].value == "none (already done)"  # no model was loaded for a no-op
    assert [p.stat().st_mtime_ns for p in files["00000"]] == stamps["00000"]


# ---------------------------------------------------------------------------------------------------------
# 5. A done shard is reused only under the settings it was extracted with (issue 14 item 3)


def _failure_message(result) -> str:
    return next(e for e in result.all_events if e.is_step_failure).event_specific_data.error.message


def test_a_shard_done_under_other_settings_is_refused_then_redone_on_request(tmp_path, monkeypatch, instance):
    from eagle_pipeline.hidden_states.checks.verify import verify_shard
    from eagle_pipeline.hidden_states.store.format import shard_paths, shard_status
    from eagle_pipeline.hidden_states.store.shards import SUPERSEDED_DIR

    _config(tmp_path, monkeypatch)
    root = _merged(tmp_path, instance)
    assert _run_shard(instance, "00000").success
    files = shard_paths(root.hidden_states_dir, 0)
    before = [p.read_bytes() for p in files]

    for change, expected in (
        ({"aux_layers": [0, 2, 5]}, "aux_layers: [1, 3, 4] (on disk) -> [0, 2, 5] (now)"),
        ({"seed": 1}, "model.seed: 0 (on disk) -> 1 (now)"),  # another model: the materialisation named it
        ({"family": "llama"}, "model.family: deepseek_v3 (on disk) -> llama (now)"),
        ({"shard_size": SHARD_SIZE + 1}, f"shard_size: {SHARD_SIZE} (on disk) -> {SHARD_SIZE + 1} (now)"),
    ):
        _config(tmp_path, monkeypatch, **change)
        result = _run_shard(instance, "00000")
        assert not result.success, change
        message = _failure_message(result)
        assert expected in message and "hidden_states.on_settings_change: redo" in message, message
        assert [p.read_bytes() for p in files] == before  # the old states are neither reused nor overwritten
        assert not result.asset_materializations_for_node("hidden_states")

    _config(tmp_path, monkeypatch, aux_layers=[0, 2, 5], on_settings_change="redo")
    result = _run_shard(instance, "00000")
    assert result.success
    (mat,) = result.asset_materializations_for_node("hidden_states")
    assert mat.metadata["shard_status_before"].value == "stale"
    assert mat.metadata["skipped_already_done"].value is False
    assert mat.metadata["fingerprint"].value["aux_layers"] == [0, 2, 5]
    assert all(e.passed for e in result.get_asset_check_evaluations())
    assert shard_status(root.hidden_states_dir, 0) == "done"
    assert all(c.passed for c in verify_shard(root.hidden_states_dir, 0, root.merged_dir).values())
    (kept,) = (root.hidden_states_dir / SUPERSEDED_DIR).iterdir()
    assert [(kept / p.name).read_bytes() for p in files] == before  # the old shard is kept, moved aside

    again = _run_shard(instance, "00000")  # the shell's fingerprint and the extractor's agree: a no-op now
    (mat,) = again.asset_materializations_for_node("hidden_states")
    assert mat.metadata["skipped_already_done"].value is True and mat.metadata["device"].value == "none (already done)"


def test_trainer_exports_checks_every_shard_before_writing_anything(tmp_path, monkeypatch, instance):
    from eagle_pipeline.defs.hidden_states import trainer_exports
    from eagle_pipeline.defs.resources import PipelineResource

    _config(tmp_path, monkeypatch)
    root = _merged(tmp_path, instance)
    defs = build_defs()
    for key in ("00000", "00001"):
        assert _run_shard(instance, key, defs).success
    previous = root.exports_dir / "specforge" / "train.jsonl"
    previous.parent.mkdir(parents=True)
    previous.write_text("the export a trainer is reading now\n")

    def export():
        return dg.materialize(
            [trainer_exports], instance=instance, resources={"pipeline": PipelineResource()}, raise_on_error=False
        )

    result = export()
    assert not result.success
    assert "missing: ['00002']" in _failure_message(result) and "nothing was exported" in _failure_message(result)
    assert previous.read_text() == "the export a trainer is reading now\n"
    assert not (root.exports_dir / "hf_parquet").exists() and not (root.exports_dir / "manifest.json").exists()

    assert _run_shard(instance, "00002", defs).success
    _config(tmp_path, monkeypatch, aux_layers=[0, 2, 5], on_settings_change="redo")
    assert _run_shard(instance, "00001", defs).success  # one shard now holds other layers than the rest
    _config(tmp_path, monkeypatch)
    result = export()
    assert not result.success
    assert "00001 (aux_layers: [0, 2, 5] (on disk) -> [1, 3, 4] (now))" in _failure_message(result)
    assert previous.read_text() == "the export a trainer is reading now\n"

    _config(tmp_path, monkeypatch, on_settings_change="redo")
    assert _run_shard(instance, "00001", defs).success
    result = export()
    assert result.success
    assert previous.read_text() != "the export a trainer is reading now\n"
    (mat,) = result.asset_materializations_for_node("trainer_exports")
    assert mat.metadata["hidden_state_shards"].value == 3
