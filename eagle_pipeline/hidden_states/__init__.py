"""Hidden-state extraction for EAGLE-3 drafter training: planner, tiny model builder, batched extractor,
safetensors shards with an index, and their checks. See docs/hidden_states.md."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import EngineResult, ExtractionPaths, ShardEngine, ShardJob
    from .extract import padding_of, plan_batches
    from .fingerprint import ExtractionFingerprint, merged_version, model_identity
    from .format import FORMAT_VERSION, TENSOR_NAMES, SampleLocation, build_sample_index, shard_paths, shard_status
    from .layers import (
        aux_layer_to_hf_index,
        aux_layer_to_vllm_id,
        default_aux_layers,
        final_state_hf_index,
        get_backbone,
        hf_hidden_states_convention,
    )
    from .merged import count_rows, num_shards, read_rows, shard_row_range
    from .model import (
        KIMI_K25_TEXT_CONFIG,
        build_model_from_config,
        build_tiny_model,
        count_params,
        describe_model_config,
        llama_8b_config,
        load_text_config,
        tiny_config,
    )
    from .plan import DiskBudgetExceeded, ExtractionPlan, check_disk_budget, plan_extraction, plan_for_model
    from .run import ENGINES, ShardRun, export_for_trainers, extract_shard, plan_run, run_shard
    from .shards import (
        ShardMismatchError,
        ShardsNotReadyError,
        ShardState,
        ShardSummary,
        require_shards_ready,
        shard_state,
    )
    from .trainer_layouts import load_sample
    from .verify import verify_shard

# Imported on first use: the Dagster code location reads the check registry (`checks`) at load time without
# importing torch, and a process imports only the modules it runs.
_EXPORTS = {
    "DiskBudgetExceeded": "plan",
    "ENGINES": "run",
    "EngineResult": "engine",
    "ExtractionFingerprint": "fingerprint",
    "ExtractionPaths": "engine",
    "ExtractionPlan": "plan",
    "FORMAT_VERSION": "format",
    "KIMI_K25_TEXT_CONFIG": "model",
    "SampleLocation": "format",
    "ShardEngine": "engine",
    "ShardJob": "engine",
    "ShardMismatchError": "shards",
    "ShardRun": "run",
    "ShardState": "shards",
    "ShardSummary": "shards",
    "ShardsNotReadyError": "shards",
    "TENSOR_NAMES": "format",
    "aux_layer_to_hf_index": "layers",
    "aux_layer_to_vllm_id": "layers",
    "build_model_from_config": "model",
    "build_sample_index": "format",
    "build_tiny_model": "model",
    "check_disk_budget": "plan",
    "count_params": "model",
    "count_rows": "merged",
    "default_aux_layers": "layers",
    "describe_model_config": "model",
    "export_for_trainers": "run",
    "extract_shard": "run",
    "final_state_hf_index": "layers",
    "get_backbone": "layers",
    "hf_hidden_states_convention": "layers",
    "llama_8b_config": "model",
    "load_sample": "trainer_layouts",
    "load_text_config": "model",
    "merged_version": "fingerprint",
    "model_identity": "fingerprint",
    "num_shards": "merged",
    "padding_of": "extract",
    "plan_batches": "extract",
    "plan_extraction": "plan",
    "plan_for_model": "plan",
    "plan_run": "run",
    "read_rows": "merged",
    "require_shards_ready": "shards",
    "run_shard": "run",
    "shard_paths": "format",
    "shard_row_range": "merged",
    "shard_state": "shards",
    "shard_status": "format",
    "tiny_config": "model",
    "verify_shard": "verify",
}

__all__ = [
    "ENGINES",
    "FORMAT_VERSION",
    "KIMI_K25_TEXT_CONFIG",
    "TENSOR_NAMES",
    "DiskBudgetExceeded",
    "EngineResult",
    "ExtractionFingerprint",
    "ExtractionPaths",
    "ExtractionPlan",
    "SampleLocation",
    "ShardEngine",
    "ShardJob",
    "ShardMismatchError",
    "ShardRun",
    "ShardState",
    "ShardSummary",
    "ShardsNotReadyError",
    "aux_layer_to_hf_index",
    "aux_layer_to_vllm_id",
    "build_model_from_config",
    "build_sample_index",
    "build_tiny_model",
    "check_disk_budget",
    "count_params",
    "count_rows",
    "default_aux_layers",
    "describe_model_config",
    "export_for_trainers",
    "extract_shard",
    "final_state_hf_index",
    "get_backbone",
    "hf_hidden_states_convention",
    "llama_8b_config",
    "load_sample",
    "load_text_config",
    "merged_version",
    "model_identity",
    "num_shards",
    "padding_of",
    "plan_batches",
    "plan_extraction",
    "plan_for_model",
    "plan_run",
    "read_rows",
    "require_shards_ready",
    "run_shard",
    "shard_paths",
    "shard_row_range",
    "shard_state",
    "shard_status",
    "tiny_config",
    "verify_shard",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
