"""Hidden-state extraction for EAGLE-3 drafter training: planner, tiny model builder, batched extractor,
safetensors shards with an index, and their checks. See docs/hidden_states.md."""

from .extract import extract_shard, padding_of, plan_batches
from .fingerprint import ExtractionFingerprint, merged_version, model_identity
from .format import (
    FORMAT_VERSION,
    TENSOR_NAMES,
    SampleLocation,
    build_sample_index,
    shard_paths,
    shard_status,
)
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
from .shards import (
    ShardMismatchError,
    ShardsNotReadyError,
    ShardState,
    ShardSummary,
    prepare_shard,
    require_shards_ready,
    shard_state,
)
from .trainer_layouts import load_sample
from .verify import CheckResult, verify_shard

__all__ = [
    "FORMAT_VERSION",
    "KIMI_K25_TEXT_CONFIG",
    "TENSOR_NAMES",
    "CheckResult",
    "DiskBudgetExceeded",
    "ExtractionFingerprint",
    "ExtractionPlan",
    "SampleLocation",
    "ShardMismatchError",
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
    "prepare_shard",
    "read_rows",
    "require_shards_ready",
    "shard_paths",
    "shard_row_range",
    "shard_state",
    "shard_status",
    "tiny_config",
    "verify_shard",
]
