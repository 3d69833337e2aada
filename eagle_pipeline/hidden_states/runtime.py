"""What the pipeline needs to run extraction from its configuration: the device, the model, the plans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .model import KIMI_K25_TEXT_CONFIG, build_tiny_model, describe_model_config, load_text_config, tiny_config
from .plan import ExtractionPlan, plan_for_model

TINY_RANDOM = "tiny-random"


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; anything else is returned as given (validated)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"hidden_states.device is {device!r} but torch sees no CUDA device (torch {torch.__version__})")
    return device


def load_extraction_model(model: str, *, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module:
    """The model to extract from: a tiny random model of `family` (offline, seeded) or a local transformers dir.

    bf16 on CUDA, fp32 on CPU. Nothing is ever fetched from a hub.
    """
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if model == TINY_RANDOM:
        return build_tiny_model(vocab_size, family=family, seed=seed, device=device, dtype=dtype)
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"hidden_states.model: {path} is not a local transformers model directory (no config.json)")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return loaded.to(device).eval()


def _facts(config: Any, name: str) -> dict[str, Any]:
    d = describe_model_config(config)
    return {"name": name, "hidden_size": d["hidden_size"], "num_layers": d["num_layers"],
            "total_params": d["params"], "active_params": d["matmul_active_params"]}


def plan_for_run(
    *,
    n_tokens: int,
    n_samples: int,
    target_model_config: str | None,
    extraction_model: str,
    extraction_family: str,
    vocab_size: int,
    aux_layers: tuple[int, ...] | None,
    shard_size: int,
    disk_budget_gb: float | None,
) -> dict[str, ExtractionPlan]:
    """Two plans over the merged tokens: 'target' (the real target model, what a production run costs) and
    'this_run' (the model configured for extraction here; the disk budget applies to it)."""
    budget = int(disk_budget_gb * 1e9) if disk_budget_gb is not None else None
    target = (
        _facts(load_text_config(target_model_config), str(target_model_config)) if target_model_config
        else KIMI_K25_TEXT_CONFIG
    )
    if extraction_model == TINY_RANDOM:
        this_run = _facts(tiny_config(vocab_size, family=extraction_family), f"tiny-random {extraction_family}")
        dtype_bytes = 2 if torch.cuda.is_available() else 4
    else:
        this_run = _facts(load_text_config(extraction_model), extraction_model)
        dtype_bytes = 2
    common = dict(n_tokens=n_tokens, n_samples=n_samples, shard_size=shard_size)
    return {
        "target": plan_for_model(target, aux_layers=None, disk_budget_bytes=None, **common),
        "this_run": plan_for_model(this_run, aux_layers=aux_layers, dtype_bytes=dtype_bytes, disk_budget_bytes=budget, **common),
    }
