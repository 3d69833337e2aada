"""Tiny model construction, parameter counting and the transformers hidden_states convention."""

from __future__ import annotations

import pytest
import torch

from eagle_pipeline.hidden_states.models.layers import (
    aux_layer_to_hf_index,
    aux_layer_to_vllm_id,
    default_aux_layers,
    get_backbone,
    hf_hidden_states_convention,
)
from eagle_pipeline.hidden_states.models.model import (
    KIMI_K25_TEXT_CONFIG,
    build_tiny_model,
    count_params,
    describe_model_config,
    llama_8b_config,
    load_text_config,
)

from .conftest import VOCAB


def _forward(model, ids):
    with torch.no_grad():
        return get_backbone(model)(input_ids=ids, use_cache=False).last_hidden_state


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_tiny_model_is_deterministic_per_seed(family):
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    a = build_tiny_model(VOCAB, family=family, seed=3)
    b = build_tiny_model(VOCAB, family=family, seed=3)
    c = build_tiny_model(VOCAB, family=family, seed=4)
    assert not a.training
    assert torch.equal(_forward(a, ids), _forward(b, ids))
    assert not torch.allclose(_forward(a, ids), _forward(c, ids))


def test_tiny_deepseek_has_kimi_structure(tiny_ds):
    layers = get_backbone(tiny_ds).layers
    assert type(tiny_ds).__name__ == "DeepseekV3ForCausalLM"
    # first_k_dense_replace=1: layer 0 dense, the rest MoE with a shared expert; MLA attention (low-rank q/kv).
    assert not hasattr(layers[0].mlp, "experts")
    assert all(hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "shared_experts") for layer in layers[1:])
    assert hasattr(layers[0].self_attn, "kv_a_proj_with_mqa")


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_param_count_matches_instantiated_model(family, tiny_ds, tiny_llama):
    model = tiny_ds if family == "deepseek_v3" else tiny_llama
    desc = describe_model_config(model.config)
    assert desc["params"] == sum(p.numel() for p in model.parameters())
    assert desc["num_layers"] == 8 and desc["hidden_size"] == 64
    if family == "deepseek_v3":
        assert desc["is_moe"] and desc["active_params"] < desc["params"]
    else:
        assert desc["active_params"] == desc["params"]


def test_llama_8b_shape_counts_to_the_published_8b():
    counts = count_params(llama_8b_config())
    assert counts["total"] == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert counts["matmul_active"] == counts["total"] - 2 * 128256 * 4096  # no embedding lookup / lm_head


def test_kimi_config_counts_match_published_totals(kimi_dir):
    cfg = load_text_config(kimi_dir / "config.json")
    desc = describe_model_config(cfg)
    assert desc["hidden_size"] == KIMI_K25_TEXT_CONFIG["hidden_size"]
    assert desc["num_layers"] == KIMI_K25_TEXT_CONFIG["num_layers"]
    assert desc["vocab_size"] == KIMI_K25_TEXT_CONFIG["vocab_size"]
    # Published: ~1.04T total (incl. vision tower), ~32B activated.
    assert 1.00e12 < desc["params"] < 1.06e12
    assert 31e9 < desc["active_params"] < 34e9


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_hidden_states_tuple_convention_in_installed_transformers(family, tiny_ds, tiny_llama):
    conv = hf_hidden_states_convention(tiny_ds if family == "deepseek_v3" else tiny_llama)
    assert conv["num_hidden_states"] == conv["num_layers"] + 1
    assert conv["index0_is_embeddings"]
    assert conv["index_k_plus_1_is_layer_k"]
    # transformers >= 5 ties hidden_states[-1] to last_hidden_state: post final norm, not the last layer's output.
    assert conv["last_is_post_norm"]
    assert not conv["last_is_last_layer_output"]


def test_default_aux_layers_and_their_other_names():
    assert default_aux_layers(61) == (1, 29, 57)  # Kimi-K2.5
    assert default_aux_layers(32) == (1, 15, 28)  # Llama-3-8B
    assert default_aux_layers(8) == (1, 3, 4)
    for n in (8, 32, 61):
        # speculators/vLLM and EAGLE name the same tensors [2, L//2, L-3] ("input of layer k").
        assert [aux_layer_to_vllm_id(x) for x in default_aux_layers(n)] == [2, n // 2, n - 3]
        assert [aux_layer_to_hf_index(x, n) for x in default_aux_layers(n)] == [2, n // 2, n - 3]
    with pytest.raises(ValueError):
        default_aux_layers(4)
    with pytest.raises(ValueError, match="collide"):
        default_aux_layers(6)
