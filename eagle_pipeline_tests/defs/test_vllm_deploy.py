"""deploy/k8s/vllm-server.yaml parses and runs exactly the command `eagle-pipeline vllm-command` prints."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from eagle_pipeline.hidden_states.engines.vllm.vllm_command import PINNED_VLLM_VERSION, vllm_serve_command
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
from eagle_pipeline.hidden_states.models.layers import default_aux_layers

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "vllm-server.yaml"


def test_vllm_server_manifest_runs_the_printed_command_with_probes_and_the_shared_volume():
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "StatefulSet"}
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    expected = vllm_serve_command(
        "/models/Kimi-K2.5",
        layer_ids=vllm_layer_ids(default_aux_layers(61), 61),  # Kimi-K2.5: [2, 30, 58, 61]
        storage_path="/data/eagle/vllm_connector",
        tensor_parallel_size=8,
        port=8000,
        model_type="kimi_k2",
        max_model_len=262144,  # Kimi-K2.5's max_position_embeddings
    )
    assert c["command"] == expected.argv
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env.items() >= expected.env.items()
    # vLLM 0.32 warns about (and ignores) VLLM_* variables it does not read: only the ones the command sets.
    assert {k for k in env if k.startswith("VLLM_")} == set(expected.env)
    # The image is the pinned release: builds cut before vLLM PR #46973 (2026-06-28; v0.22.0 is 2026-05-30) drop
    # Kimi's final layer (docs/hidden_states.md §10).
    assert c["image"] == f"vllm/vllm-openai:v{PINNED_VLLM_VERSION}"
    spec = json.loads(c["command"][c["command"].index("--speculative-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58, 61]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["command"][c["command"].index("--tensor-parallel-size") + 1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 8000}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 2400  # Kimi's cold start
    # The connector writes under the data-root volume the CPU shard pods mount at the same path.
    kv = json.loads(c["command"][c["command"].index("--kv-transfer-config") + 1])
    storage = kv["kv_connector_extra_config"]["shared_storage_path"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert storage.startswith(mounts["eagle-data"] + "/")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["eagle-data"]["persistentVolumeClaim"]["claimName"] == "eagle-data"
    values = yaml.safe_load((MANIFEST.parent / "values.yaml").read_text())
    (code,) = values["dagster-user-deployments"]["deployments"]  # run and step pods inherit its volumes
    assert {"name": "eagle-data", "mountPath": mounts["eagle-data"]} in code["volumeMounts"]
