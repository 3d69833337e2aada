"""Which target layers feed the EAGLE-3 drafter, and how they map onto transformers' `hidden_states` tuple.

Convention used throughout this package: an aux layer id `k` is a 0-based *decoder-layer index* and names the
**output** of decoder layer `k` (the residual stream after that layer). In transformers,
`outputs.hidden_states[0]` is the embedding output and `outputs.hidden_states[k + 1]` is the output of decoder
layer `k`; the last element (`hidden_states[num_layers]`) is replaced by the *post-final-norm* `last_hidden_state`
in transformers >= 5 (`capture_outputs(tie_last_hidden_states=True)`), so the raw output of the last decoder layer
is not in the tuple at all. `hf_hidden_states_convention` checks all of this against forward hooks at runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from eagle_pipeline.drafter_types import resample_layer_ids


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high capture layers `(1, L//2 - 1, L - 4)` as decoder-layer output indices.

    The same tensors as SpecForge's default, Model-Optimizer's `default_eagle_aux_layer_ids`, speculators/vLLM's
    `[2, L//2, L-3]` ("input of layer k") and EAGLE's own "before layers 2, L//2, L-3". Kimi-K2.5 (61): (1, 29, 57).
    """
    if num_layers < 5:
        raise ValueError(f"default aux layers need at least 5 decoder layers, got {num_layers}")
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(layers)) != 3:
        raise ValueError(f"default aux layers collide for {num_layers} layers: {layers}")
    return layers


def validate_aux_layers(aux_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    layers = tuple(int(x) for x in aux_layers)
    if not layers:
        raise ValueError("aux_layers is empty")
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"aux layers {bad} out of range for a {num_layers}-layer model (0-based decoder layers)")
    if len(set(layers)) != len(layers):
        raise ValueError(f"aux layers repeat: {layers}")
    return layers


def resolve_aux_layers(setting: Sequence[int] | int | None, num_layers: int) -> tuple[int, ...]:
    """The capture layers a `hidden_states.aux_layers` setting names for a `num_layers`-layer model: the ids as
    given; a count n spread by SpecForge's DFlash rule (`drafter_types.resample_layer_ids`: 5 of 61 layers give
    [1, 15, 30, 44, 58]); None or empty: EAGLE-3's low/mid/high. Validated (in range, no repeats)."""
    if isinstance(setting, int):
        try:
            return validate_aux_layers(resample_layer_ids(setting, num_layers), num_layers)
        except ValueError as exc:
            raise ValueError(f"aux_layers: {exc}") from None
    return validate_aux_layers(setting or default_aux_layers(num_layers), num_layers)


def aux_layer_to_hf_index(layer: int, num_layers: int) -> int | None:
    """Index into transformers' `outputs.hidden_states` holding the output of decoder layer `layer`, or None for the
    last layer: its entry (`num_layers`) holds the post-final-norm state instead, so its raw output is not there."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range for a {num_layers}-layer model")
    return layer + 1 if layer < num_layers - 1 else None


def final_state_hf_index(num_layers: int, *, post_norm: bool) -> int | None:
    """Index into `outputs.hidden_states` of the stored final state: the last entry when post-norm; None when
    pre-norm (the last decoder layer's raw output is not in the tuple)."""
    return num_layers if post_norm else None


def aux_layer_to_vllm_id(layer: int) -> int:
    """vLLM/SGLang/speculators layer id ("residual entering layer id") of the same tensor."""
    return layer + 1


def _layer_output(output: Any) -> torch.Tensor:
    # Decoder layers return a tensor in transformers >= 4.54 and a tuple before.
    return output[0] if isinstance(output, (tuple, list)) else output


@torch.no_grad()
def hf_hidden_states_convention(model: torch.nn.Module, *, seq_len: int = 8) -> dict[str, Any]:
    """Run one forward with `output_hidden_states=True` plus forward hooks and report what the tuple holds.

    Returns booleans so the caller (tests, metadata) records facts about the installed transformers rather than
    assumptions: `index0_is_embeddings`, `index_k_plus_1_is_layer_k` (for every layer but the last),
    `last_is_post_norm`, `last_is_last_layer_output` (pre-norm).
    """
    backbone = get_backbone(model)
    layers = decoder_layers(backbone)
    n = len(layers)
    captured: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_hook(lambda _m, _a, out, i=i: captured.__setitem__(i, _layer_output(out)))
        for i, layer in enumerate(layers)
    ]
    emb: dict[str, torch.Tensor] = {}
    embed = token_embedding(backbone)
    handles.append(embed.register_forward_hook(lambda _m, _a, out: emb.__setitem__("e", out)))
    try:
        device = next(backbone.parameters()).device
        ids = torch.arange(2, 2 + seq_len, device=device).remainder(embed.num_embeddings).unsqueeze(0)
        out = backbone(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    hs = out.hidden_states
    post_norm = final_norm(backbone)(captured[n - 1])
    return {
        "num_hidden_states": len(hs),
        "num_layers": n,
        "index0_is_embeddings": bool(torch.equal(hs[0], emb["e"])),
        "index_k_plus_1_is_layer_k": all(torch.equal(hs[k + 1], captured[k]) for k in range(n - 1)),
        "last_is_post_norm": bool(torch.allclose(hs[-1], post_norm, atol=0, rtol=0))
        and bool(torch.equal(hs[-1], out.last_hidden_state)),
        "last_is_last_layer_output": bool(torch.equal(hs[-1], captured[n - 1])),
    }


def get_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (`embed_tokens`, `layers`, `norm`) of a *ForCausalLM or a bare base model.

    Extraction calls the backbone directly so the lm_head (vocab x hidden: 1.2B params for Kimi) never runs.
    """
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    if hasattr(model, "layers") and hasattr(model, "norm"):
        return model
    raise TypeError(f"{type(model).__name__}: cannot find a decoder stack with .layers and .norm")


def decoder_layers(backbone: torch.nn.Module) -> torch.nn.ModuleList:
    """The backbone's decoder layers, in order."""
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(backbone).__name__}.layers is not a ModuleList of decoder layers")
    return layers


def token_embedding(backbone: torch.nn.Module) -> torch.nn.Embedding:
    """The backbone's input embedding (its width is the hidden size, its rows the vocabulary)."""
    embed = getattr(backbone, "embed_tokens", None)
    if not isinstance(embed, torch.nn.Embedding):
        raise TypeError(f"{type(backbone).__name__}.embed_tokens is not an Embedding")
    return embed


def final_norm(backbone: torch.nn.Module) -> torch.nn.Module:
    """The backbone's final norm (what turns the last layer's output into `last_hidden_state`)."""
    norm = getattr(backbone, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise TypeError(f"{type(backbone).__name__}.norm is not a module")
    return norm
