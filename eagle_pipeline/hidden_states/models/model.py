"""Target-model construction (offline, from config objects only) and model shape facts for the planner."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# Public shape numbers of Kimi-K2.5's text model (a DeepSeek-V3-style `kimi_k2` text_config inside the VLM config):
# see config.json in the shared Kimi tokenizer directory. Params are Moonshot's published totals (1.04T total, 32B
# activated); `describe_model_config(load_text_config(path))` recomputes them from the config itself.
KIMI_K25_TEXT_CONFIG: dict[str, Any] = {
    "name": "Kimi-K2.5 (text)",
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_layers": 61,
    "first_k_dense_replace": 1,
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "total_params": 1.04e12,
    "active_params": 32e9,
    "quantized_weight_bytes_per_param": 0.55,  # compressed-tensors INT4 routed experts, as vLLM serves them
}

# The `hidden_states.model` that names the tiny random target the demo and the tests build offline.
TINY_RANDOM = "tiny-random"

_DEEPSEEK_TYPES = {"deepseek_v3", "kimi_k2", "kite_text", "deepseek_v2"}


def load_text_config(path: str | Path) -> dict[str, Any]:
    """The text-model config dict from a config.json (or its directory); VLM wrappers keep it under text_config."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = json.loads(p.read_text())
    return dict(cfg.get("text_config") or cfg)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def count_params(config: Any) -> dict[str, int]:
    """Parameter counts computed from a Llama- or DeepSeek-V3-style config (object or dict).

    `active` counts what one token touches (routed experts: top-k of them); `matmul_active` = active minus the
    embedding and the lm_head, because extraction does a table lookup and never runs the lm_head, so
    2 x matmul_active is its per-token FLOP count (norm weights included, attention-score FLOPs excluded).
    """
    model_type = str(_get(config, "model_type", "llama"))
    h = int(_get(config, "hidden_size"))
    n_layers = int(_get(config, "num_hidden_layers", _get(config, "num_layers")))
    vocab = int(_get(config, "vocab_size"))
    n_heads = int(_get(config, "num_attention_heads"))
    bias = bool(_get(config, "attention_bias", False))
    tied = bool(_get(config, "tie_word_embeddings", False))
    inter = int(_get(config, "intermediate_size"))
    embed = vocab * h
    lm_head = 0 if tied else vocab * h
    norms_per_layer = 2 * h

    if model_type in _DEEPSEEK_TYPES:
        q_lora = _get(config, "q_lora_rank")
        kv_lora = int(_get(config, "kv_lora_rank"))
        nope, rope, v = (int(_get(config, k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        qk = nope + rope
        if q_lora:
            attn = h * q_lora + (q_lora if bias else 0) + q_lora + q_lora * n_heads * qk
        else:
            attn = h * n_heads * qk
        attn += h * (kv_lora + rope) + ((kv_lora + rope) if bias else 0) + kv_lora  # kv_a_proj + kv_a_layernorm
        attn += kv_lora * n_heads * (nope + v) + n_heads * v * h + (h if bias else 0)
        moe_inter = int(_get(config, "moe_intermediate_size"))
        n_routed = int(_get(config, "n_routed_experts"))
        n_shared = int(_get(config, "n_shared_experts") or 0)
        top_k = int(_get(config, "num_experts_per_tok"))
        k_dense = int(_get(config, "first_k_dense_replace") or 0)
        dense_mlp = 3 * h * inter
        expert = 3 * h * moe_inter
        moe_common = n_shared * expert + n_routed * h  # shared experts + router weight
        n_moe = max(n_layers - k_dense, 0)
        n_dense = n_layers - n_moe
        total_layers = (
            n_layers * (attn + norms_per_layer) + n_dense * dense_mlp + n_moe * (moe_common + n_routed * expert)
        )
        active_layers = (
            n_layers * (attn + norms_per_layer) + n_dense * dense_mlp + n_moe * (moe_common + top_k * expert)
        )
        is_moe = n_moe > 0
    else:
        n_kv = int(_get(config, "num_key_value_heads") or n_heads)
        head_dim = int(_get(config, "head_dim", None) or h // n_heads)
        attn = h * n_heads * head_dim + 2 * h * n_kv * head_dim + n_heads * head_dim * h
        if bias:
            attn += n_heads * head_dim + 2 * n_kv * head_dim + h
        total_layers = active_layers = n_layers * (attn + norms_per_layer + 3 * h * inter)
        is_moe = False
    final_norm = h
    total = embed + lm_head + total_layers + final_norm
    active = embed + lm_head + active_layers + final_norm
    return {
        "total": total,
        "active": active,
        "matmul_active": active_layers + final_norm,
        "embedding": embed,
        "lm_head": lm_head,
        "is_moe": is_moe,
    }


def describe_model_config(config: Any) -> dict[str, Any]:
    """Shape summary of a transformers config (or config dict): what the planner and shard metadata need."""
    counts = count_params(config)
    model_type = str(_get(config, "model_type", "llama"))
    desc = {
        "model_type": model_type,
        "hidden_size": int(_get(config, "hidden_size")),
        "num_layers": int(_get(config, "num_hidden_layers", _get(config, "num_layers"))),
        "vocab_size": int(_get(config, "vocab_size")),
        "num_attention_heads": int(_get(config, "num_attention_heads")),
        "params": counts["total"],
        "active_params": counts["active"],
        "matmul_active_params": counts["matmul_active"],
        "is_moe": counts["is_moe"],
    }
    if counts["is_moe"]:
        desc.update(
            n_routed_experts=int(_get(config, "n_routed_experts")),
            num_experts_per_tok=int(_get(config, "num_experts_per_tok")),
            first_k_dense_replace=int(_get(config, "first_k_dense_replace") or 0),
        )
    return desc


def tiny_config(
    vocab_size: int,
    *,
    family: str = "deepseek_v3",
    hidden_size: int = 64,
    num_layers: int = 8,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    initializer_range: float = 0.1,
):
    """A small transformers config of the given family. The larger-than-default init std makes every layer move
    the residual stream visibly, so layer-mapping and padding bugs show up in tests instead of hiding under 1e-4."""
    inter = intermediate_size or 2 * hidden_size
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=inter,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=8192,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        head = max(hidden_size // num_heads, 4)
        # Not a declared field of transformers 5's config (kept as a plain attribute): no multi-token-prediction layer.
        no_mtp: dict[str, Any] = {"num_nextn_predict_layers": 0}
        return DeepseekV3Config(
            **common,
            num_key_value_heads=num_heads,
            moe_intermediate_size=max(inter // 4, 8),
            n_routed_experts=n_routed_experts,
            n_shared_experts=1,
            num_experts_per_tok=num_experts_per_tok,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,  # Kimi-K2: one dense layer, then MoE
            routed_scaling_factor=2.827,
            q_lora_rank=2 * head,
            kv_lora_rank=head,
            qk_nope_head_dim=head // 2,
            qk_rope_head_dim=head // 2,
            v_head_dim=head,
            **no_mtp,
        )
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, num_key_value_heads=max(num_heads // 2, 1))
    raise ValueError(f"unknown family {family!r}: expected 'deepseek_v3' or 'llama'")


def llama_8b_config(vocab_size: int = 128256):
    """Llama-3.1-8B's shape (random weights only; nothing is downloaded)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model_from_config(
    config: Any, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """Instantiate a *ForCausalLM from `config` with seeded random weights, allocated directly on `device`
    in `dtype` (no full-size CPU copy for GPU-sized models). Returned in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    with torch.device(device), _default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()


def build_tiny_model(
    vocab_size: int,
    *,
    family: str = "deepseek_v3",
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """The default tiny random-weight target of `family` (`tiny_config`; DeepSeek-V3 family = Kimi-K2's
    architecture: MLA + MoE with a shared expert + first_k_dense_replace=1), deterministic for a given seed, in eval
    mode. Another shape: `build_model_from_config(tiny_config(...))`."""
    return build_model_from_config(tiny_config(vocab_size, family=family), seed=seed, device=device, dtype=dtype)
