"""`eagle-pipeline vllm-command` prints the server command from the configuration of the model the server loads;
`vllm-smoke` validates one request's file against a running server (here the loopback double)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from eagle_pipeline.cli import main
from eagle_pipeline.config import DEFAULT_CONFIG
from eagle_pipeline.hidden_states.engines.runtime import load_extraction_model
from eagle_pipeline.hidden_states.engines.vllm.vllm_command import PINNED_VLLM_VERSION, vllm_serve_command
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
from eagle_pipeline.hidden_states.models.layers import default_aux_layers
from eagle_pipeline.hidden_states.models.model import tiny_config
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

VOCAB = 2560  # the demo tokenizer's


def _config(tmp_path: Path, **hidden_states) -> Path:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    raw["target"]["tokenizer"] = "demo"
    raw["hidden_states"].update(hidden_states)
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _kimi_config_dir(tmp_path: Path, kimi_dir: Path) -> Path:
    d = tmp_path / "kimi"
    d.mkdir()
    (d / "config.json").write_text((kimi_dir / "config.json").read_text())  # the shape only, no weights
    return d


def _model_dir(tmp_path: Path, name: str, *, layers: int, hidden: int = 64, family: str = "llama") -> Path:
    """A local model directory holding only a config.json of a tiny model of that shape."""
    d = tmp_path / name
    d.mkdir()
    tiny_config(VOCAB, family=family, hidden_size=hidden, num_layers=layers).to_json_file(str(d / "config.json"))
    return d


def _command(printed: str) -> tuple[dict[str, str], list[str], list[str]]:
    """The environment, the argument vector and the comment lines of what vllm-command printed."""
    comments = [line for line in printed.splitlines() if line.startswith("#")]
    body = "\n".join(line for line in printed.splitlines() if not line.startswith("#"))
    words = shlex.split(body.replace("\\\n", " "))
    n_env = next(i for i, w in enumerate(words) if w == "vllm")
    return dict(w.split("=", 1) for w in words[:n_env]), words[n_env:], comments


def test_vllm_command_for_kimi_k25(tmp_path, capsys, kimi_dir):
    model_dir = _kimi_config_dir(tmp_path, kimi_dir)
    cfg = _config(tmp_path, model=str(model_dir), engine="vllm", vllm={"endpoints": ["http://gpu-node-0:8000"]})
    assert main(["vllm-command", "--config", str(cfg)]) == 0
    printed = capsys.readouterr().out
    env, argv, comments = _command(printed)
    # vLLM 0.32 reads VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; VLLM_ENGINE_ITERATION_TIMEOUT_S is gone (it warns "Unknown
    # vLLM environment variable detected" and ignores it).
    assert env == {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200"}
    expected = vllm_serve_command(
        str(model_dir),
        layer_ids=(2, 30, 58, 61),  # Model-Optimizer's Kimi-K2.5 recipe: aux (1, 29, 57) + the final id 61
        storage_path="/dev/shm/hidden_states",
        model_type="kimi_k2",
        max_model_len=262144,  # Kimi-K2.5's max_position_embeddings
    )
    assert argv == expected.argv
    for flag in (
        "--tensor-parallel-size 8",
        "--trust-remote-code",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--max-model-len 262144",
        '"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]',
        '"shared_storage_path": "/dev/shm/hidden_states"',
        "ExampleHiddenStatesConnector",
    ):
        assert flag in printed
    # 0.32 fills the connector's file from the KV cache once the whole prompt is in, so chunked prefill stays on
    # (disabling it makes 0.32 warn that it "may cause the engine to crash or produce incorrect outputs").
    assert "chunked-prefill" not in printed
    text = "\n".join(comments)
    assert f"vLLM {PINNED_VLLM_VERSION}" in text and "61 layers" in text and str(model_dir) in text


def test_vllm_command_refuses_a_tiny_extraction_model_for_a_kimi_server(tmp_path, capsys, kimi_dir):
    """The shipped pipeline.yaml extracts with tiny-random: its ids [2, 4, 5, 8] for a Kimi server are a silent
    data bug (right shapes, wrong layers), so the command refuses and names the key to set."""
    kimi = _kimi_config_dir(tmp_path, kimi_dir)
    assert main(["vllm-command", "--config", str(_config(tmp_path)), "--served-model", str(kimi)]) == 2
    err = capsys.readouterr().err
    assert "hidden_states.model" in err and "61 layers" in err and "8 layers" in err and "tiny-random" in err


def test_vllm_command_refuses_when_the_layer_counts_differ(tmp_path, capsys):
    extraction = _model_dir(tmp_path, "extraction", layers=8)
    served = _model_dir(tmp_path, "served", layers=6)
    cfg = _config(tmp_path, model=str(extraction))
    assert main(["vllm-command", "--config", str(cfg), "--served-model", str(served)]) == 2
    err = capsys.readouterr().err
    assert "Set hidden_states.model" in err and "6 layers" in err and "8 layers" in err
    # the served model named by the hub id it loads, with its config.json given beside it: the same refusal
    args = ["--served-model", "org/served", "--served-model-config", str(served / "config.json")]
    assert main(["vllm-command", "--config", str(cfg), *args]) == 2
    assert "Set hidden_states.model" in capsys.readouterr().err


@pytest.mark.parametrize("layers", [10, 12])
def test_vllm_command_prints_the_served_models_layer_ids(layers, tmp_path, capsys):
    extraction = _model_dir(tmp_path, "extraction", layers=layers)
    served = _model_dir(tmp_path, "served", layers=layers)
    cfg = _config(tmp_path, model=str(extraction), vllm={"served_model_config": str(served)})
    assert main(["vllm-command", "--config", str(cfg), "--served-model", "org/tiny", "--port", "9000"]) == 0
    env, argv, comments = _command(capsys.readouterr().out)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == list(vllm_layer_ids(default_aux_layers(layers), layers)) and ids[-1] == layers
    assert argv[:3] == ["vllm", "serve", "org/tiny"] and "9000" in argv and env == {}  # llama: no cold-start knobs
    assert argv[argv.index("--max-model-len") + 1] == "8192"  # the config's max_position_embeddings
    assert any("org/tiny" in c and f"{layers} layers" in c for c in comments)


def test_vllm_command_needs_the_served_models_config(tmp_path, capsys):
    assert main(["vllm-command", "--config", str(_config(tmp_path))]) == 2
    assert "--served-model" in capsys.readouterr().err
    # a hub id cannot be read offline: its config.json must be given
    assert main(["vllm-command", "--config", str(_config(tmp_path)), "--served-model", "org/m"]) == 2
    err = capsys.readouterr().err
    assert "--served-model-config" in err and "hidden_states.vllm.served_model_config" in err


def test_vllm_command_max_model_len_setting(tmp_path, capsys):
    served = _model_dir(tmp_path, "served", layers=8, family="deepseek_v3")
    cfg = _config(tmp_path, vllm={"max_model_len": 4096, "served_model_config": str(served)})
    assert main(["vllm-command", "--config", str(cfg), "--served-model", "org/m"]) == 0
    _, argv, _ = _command(capsys.readouterr().out)
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    cfg = _config(tmp_path, vllm={"max_model_len": 10000, "served_model_config": str(served)})
    assert main(["vllm-command", "--config", str(cfg), "--served-model", "org/m"]) == 2
    assert "hidden_states.vllm.max_model_len" in capsys.readouterr().err  # over max_position_embeddings 8192


def _tiny_served_config(tmp_path: Path, **kw) -> Path:
    return _model_dir(tmp_path, "served", layers=kw.pop("layers", 8), family="deepseek_v3", **kw)


@pytest.mark.parametrize("fault", [None, "final_layer_missing"])
def test_vllm_smoke_validates_one_request(fault, tmp_path, capsys):
    storage = tmp_path / "storage"
    cfg = _config(tmp_path, engine="vllm", vllm={"endpoints": ["http://127.0.0.1:1"], "storage_path": str(storage)})
    model = load_extraction_model("tiny-random", family="deepseek_v3", seed=0, vocab_size=VOCAB, device="cpu")
    faults = {fault: 1.0} if fault else None
    served = _tiny_served_config(tmp_path)
    with VLLMHiddenStatesDouble(model, layer_ids=(2, 4, 5, 8), storage_path=storage, faults=faults) as srv:
        rc = main(["vllm-smoke", "--config", str(cfg), "--endpoint", srv.url, "--served-model-config", str(served)])
        assert srv.total_requests == 1
    out = capsys.readouterr()
    if fault is None:
        assert rc == 0 and "OK " in out.out and "[64, 4, 64]" in out.out and "max_model_len 8192" in out.out
    else:
        assert rc == 1 and "#46973" in out.err and "the final id 8 is missing" in out.err
    assert list(storage.iterdir()) == []


def test_vllm_smoke_checks_against_the_served_models_config(tmp_path, capsys):
    """The server's file is checked against the config.json of the model it serves: a server of another H fails,
    and a tiny-random configuration against a real endpoint needs that config.json named."""
    storage = tmp_path / "storage"
    extraction = _model_dir(tmp_path, "extraction", layers=8, hidden=128, family="deepseek_v3")
    vllm = {"endpoints": ["http://127.0.0.1:1"], "storage_path": str(storage), "timeout_s": 30}
    cfg = _config(tmp_path, model=str(extraction), engine="vllm", vllm=vllm)
    cfg_tiny = _config(tmp_path / "tiny", engine="vllm", vllm=vllm)
    model = load_extraction_model("tiny-random", family="deepseek_v3", seed=0, vocab_size=VOCAB, device="cpu")
    with VLLMHiddenStatesDouble(model, layer_ids=(2, 4, 5, 8), storage_path=storage) as srv:
        args = ["--endpoint", srv.url, "--served-model-config", str(extraction)]
        assert main(["vllm-smoke", "--config", str(cfg), *args]) == 1  # serves H 64, its config says 128
        assert "hidden size 64, expected 128" in capsys.readouterr().err
        assert main(["vllm-smoke", "--config", str(cfg_tiny), "--endpoint", srv.url]) == 2
        assert "--served-model-config" in capsys.readouterr().err


def test_vllm_smoke_against_the_simulated_endpoint(tmp_path, capsys):
    cfg = _config(tmp_path, engine="vllm", vllm={"endpoints": ["simulated"], "storage_path": str(tmp_path / "s")})
    assert main(["vllm-smoke", "--config", str(cfg), "--ids", "5,6,7"]) == 0
    out = capsys.readouterr().out
    assert "[3, 4, 64]" in out and "max_model_len 8192" in out and "vLLM 0.32.0" in out
    # the simulated server is started with hidden_states.vllm.max_model_len, and refuses as vLLM does
    vllm = {"endpoints": ["simulated"], "storage_path": str(tmp_path / "s"), "max_model_len": 3}
    cfg = _config(tmp_path, engine="vllm", vllm=vllm)
    assert main(["vllm-smoke", "--config", str(cfg), "--ids", "5,6,7"]) == 1
    assert "max_tokens must be at least 1, got 0" in capsys.readouterr().err


def test_plan_at_a_scale_from_the_models_config(tmp_path, capsys, kimi_dir):
    """`plan --tokens --samples` sizes a run before its data exists, from the served checkpoint's config.json."""
    model_dir = _kimi_config_dir(tmp_path, kimi_dir)
    cfg = _config(
        tmp_path,
        model=str(model_dir),
        engine="vllm",
        disk_budget_gb=9000,
        vllm={"endpoints": ["http://gpu-node-0:8000"]},
    )
    assert main(["plan", "--config", str(cfg), "--tokens", "138400000", "--samples", "40000"]) == 0
    out = capsys.readouterr().out
    assert "| hidden size / layers | 7168 / 61 |" in out and "[1, 29, 57] + final" in out
    assert "| bytes per token | 57,349 |" in out  # (3 aux + final) x 7168 x bf16 + 5 B of id and mask
    assert "within budget" in out and "vllm: 1 x 8 GPUs" in out


def test_the_kimi_plan_with_fp8_prints_the_fp8_total(tmp_path, capsys, kimi_dir):
    """`quantize: fp8` with `engine: vllm` (Kimi fits only vLLM) in `layout: speculators`: the plan counts 1 B per
    value and one fp32 scale per token per layer: about half the bf16 total (docs/kimi.md §6)."""
    model_dir = _kimi_config_dir(tmp_path, kimi_dir)
    vllm = {"endpoints": ["http://gpu-node-0:8000"], "storage_path": str(tmp_path / "connector")}
    common = dict(model=str(model_dir), engine="vllm", disk_budget_gb=9000, layout="speculators", trainer_layouts=[])
    common["vllm"] = vllm
    totals = {}
    for quantize in ("none", "fp8"):
        cfg = _config(tmp_path / quantize, quantize=quantize, **common)
        assert main(["plan", "--config", str(cfg), "--tokens", "138400000", "--samples", "40000"]) == 0
        out = capsys.readouterr().out
        total = next(line for line in out.splitlines() if line.startswith("| **total**"))
        totals[quantize] = int(total.split("**")[3].split(" ")[0].replace(",", ""))
    # (3 aux + final) x 7168 x 1 B + 4 fp32 scales + 5 B of id and mask
    assert "| bytes per token | 28,693 |" in out and "within budget" in out
    states = 138_400_000 * (4 * 7168 + 4 * 4 + 8) + 40_000 * 272  # speculators' FP8 hs_{i}, int64 token_ids
    assert f"| states: speculators hs_{{i}}.safetensors | exports | {states:,}" in out
    assert totals["fp8"] < 0.51 * totals["none"]


def test_plan_refusals(tmp_path, capsys, kimi_dir):
    """Over the disk budget: exit 1; Kimi in process: refused (exit 1, naming the engine); nothing merged and no
    scale given: exit 2 naming the merged folder; --tokens without --samples: exit 2."""
    model_dir = _kimi_config_dir(tmp_path, kimi_dir)
    small = _config(
        tmp_path / "a",
        model=str(model_dir),
        engine="vllm",
        disk_budget_gb=100,
        vllm={"endpoints": ["http://gpu-node-0:8000"]},
    )
    assert main(["plan", "--config", str(small), "--tokens", "138400000", "--samples", "40000"]) == 1
    assert "EXCEEDS the disk budget" in capsys.readouterr().out
    in_process = _config(tmp_path / "b", model=str(model_dir))
    assert main(["plan", "--config", str(in_process), "--tokens", "1000", "--samples", "1"]) == 1
    assert "refused" in capsys.readouterr().err
    root = tmp_path / "c"
    cfg = _config(root)
    raw = yaml.safe_load(cfg.read_text())
    raw["data_root"] = str(root / "data")
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "nothing merged yet" in capsys.readouterr().err
    assert main(["plan", "--config", str(cfg), "--tokens", "5"]) == 2
    assert "--samples" in capsys.readouterr().err
