"""`eagle-pipeline vllm-command` prints the server command from the configuration; `vllm-smoke` validates one
request's file against a running server (here the loopback double)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from eagle_pipeline.cli import main
from eagle_pipeline.config import DEFAULT_CONFIG
from eagle_pipeline.hidden_states.runtime import load_extraction_model
from eagle_pipeline.hidden_states.vllm_command import vllm_serve_command
from eagle_pipeline.hidden_states.vllm_double import VLLMHiddenStatesDouble


def _config(tmp_path: Path, **hidden_states) -> Path:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    raw["target"]["tokenizer"] = "demo"
    raw["hidden_states"].update(hidden_states)
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _kimi_config_dir(tmp_path: Path, kimi_dir: Path) -> Path:
    d = tmp_path / "kimi"
    d.mkdir()
    (d / "config.json").write_text((kimi_dir / "config.json").read_text())  # the shape only, no weights
    return d


def test_vllm_command_for_kimi_k25(tmp_path, capsys, kimi_dir):
    model_dir = _kimi_config_dir(tmp_path, kimi_dir)
    cfg = _config(tmp_path, model=str(model_dir), engine="vllm", vllm={"endpoints": ["http://gpu-node-0:8000"]})
    assert main(["vllm-command", "--config", str(cfg), "--served-model", "moonshotai/Kimi-K2.5"]) == 0
    printed = capsys.readouterr().out
    words = shlex.split(printed.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words[:2])
    assert env == {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200", "VLLM_ENGINE_ITERATION_TIMEOUT_S": "1200"}
    expected = vllm_serve_command(
        "moonshotai/Kimi-K2.5",
        layer_ids=(2, 30, 58, 61),  # Model-Optimizer's Kimi-K2.5 recipe: aux (1, 29, 57) + the final id 61
        storage_path="/dev/shm/hidden_states",
        model_type="kimi_k2",
    )
    assert words[2:] == expected.argv
    for flag in (
        "--tensor-parallel-size 8",
        "--trust-remote-code",
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--enforce-eager",
        '"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]',
        '"shared_storage_path": "/dev/shm/hidden_states"',
        "ExampleHiddenStatesConnector",
    ):
        assert flag in printed


def test_vllm_command_needs_a_served_model_for_tiny_random(tmp_path, capsys):
    assert main(["vllm-command", "--config", str(_config(tmp_path))]) == 2
    assert "--served-model" in capsys.readouterr().err
    assert main(["vllm-command", "--config", str(_config(tmp_path)), "--served-model", "m", "--port", "9000"]) == 0
    out = capsys.readouterr().out
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in out and "--port 9000" in out
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" in out  # tiny-random's family is deepseek_v3: Kimi's knobs


@pytest.mark.parametrize("fault", [None, "final_layer_missing"])
def test_vllm_smoke_validates_one_request(fault, tmp_path, capsys):
    storage = tmp_path / "storage"
    cfg = _config(tmp_path, engine="vllm", vllm={"endpoints": ["http://127.0.0.1:1"], "storage_path": str(storage)})
    model = load_extraction_model("tiny-random", family="deepseek_v3", seed=0, vocab_size=2560, device="cpu")
    faults = {fault: 1.0} if fault else None
    with VLLMHiddenStatesDouble(model, layer_ids=(2, 4, 5, 8), storage_path=storage, faults=faults) as srv:
        rc = main(["vllm-smoke", "--config", str(cfg), "--endpoint", srv.url])
        assert srv.total_requests == 1
    out = capsys.readouterr()
    if fault is None:
        assert rc == 0 and "OK " in out.out and "[64, 4, 64]" in out.out
    else:
        assert rc == 1 and "#46973" in out.err and "the final id 8 is missing" in out.err
    assert list(storage.iterdir()) == []


def test_vllm_smoke_against_the_simulated_endpoint(tmp_path, capsys):
    cfg = _config(tmp_path, engine="vllm", vllm={"endpoints": ["simulated"], "storage_path": str(tmp_path / "s")})
    assert main(["vllm-smoke", "--config", str(cfg), "--ids", "5,6,7"]) == 0
    assert "[3, 4, 64]" in capsys.readouterr().out
