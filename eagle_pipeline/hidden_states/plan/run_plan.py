"""The plans of the configured run, before any GPU is touched: the target's (what production costs) and this run's
(what the disk budget applies to), under the configured engine (`estimate.plan_extraction` has the formulas). One
path for the `hidden_state_plan` asset and `eagle-pipeline plan` (both through `run.plan_run` over the merged
table, or `plan_for_run` over a scale given by hand)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from eagle_pipeline.hidden_states.models.model import (
    KIMI_K25_TEXT_CONFIG,
    TINY_RANDOM,
    load_text_config,
    tiny_config,
)
from eagle_pipeline.hidden_states.models.world_split import ExpertsReplicated, rank_share, world_ep_size
from eagle_pipeline.hidden_states.plan.disk_plan import DiskInputs
from eagle_pipeline.hidden_states.plan.estimate import (
    Compute,
    ExtractionPlan,
    ModelShape,
    Storage,
    Workload,
    plan_extraction,
)

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig


# vLLM serves compressed-tensors INT4 experts as they ship (~0.55 B/param for Kimi-K2.5 all told); transformers
# decompresses them to bf16 (docs/hidden_states.md §1), so in process every parameter is 2 bytes.
INT4_WEIGHT_BYTES_PER_PARAM = 0.55
BF16_WEIGHT_BYTES_PER_PARAM = 2.0
KIMI_SHAPE = ModelShape.of_facts(KIMI_K25_TEXT_CONFIG)  # the target's plan when target.model_config is unset


def _quantized_bytes_per_param(config: Any) -> float | None:
    q = config.get("quantization_config") if isinstance(config, dict) else None
    groups = (q or {}).get("config_groups") or {}
    bits = {g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)}
    return INT4_WEIGHT_BYTES_PER_PARAM if bits == {4} else None


def _shape(config: Any, name: str) -> ModelShape:
    return ModelShape.of_config(config, name, quantized_weight_bytes_per_param=_quantized_bytes_per_param(config))


class PlanRefused(ValueError):
    """The configured engine cannot hold the model's weights."""


def _torchrun_compute(config: Any, tp_size: int, ep_size: int | None, *, refuse: bool) -> Compute:
    """One world of tp_size processes holds one model: each rank what the installed transformers' plans give it,
    with the ep_size the engine runs (`world_split.world_ep_size`; `refuse`: a world that would replicate the
    routed experts raises PlanRefused naming the setting, else the plan shows what it would hold)."""
    try:
        ep_size = world_ep_size(config, tp_size, ep_size)
    except ExpertsReplicated as e:
        if refuse:
            raise PlanRefused(str(e)) from e
    share = rank_share(config, tp_size, ep_size)
    return Compute(
        engine="torchrun",
        gpus_per_model=tp_size,
        n_gpus=tp_size,
        weight_bytes_per_param=BF16_WEIGHT_BYTES_PER_PARAM,
        replicated_params=share.replicated if share is not None else 0.0,
    )


def _compute(h: HiddenStatesConfig, model: ModelShape, config: Any, *, refuse: bool) -> Compute:
    """The GPUs the configured engine gives one model of `model` (`config`: its config, for torchrun's shares): in
    process one GPU; with vLLM, one server per endpoint of `vllm.gpus_per_server` GPUs, holding the weights as they
    ship; under torchrun, one world of `torchrun.tp_size` GPUs."""
    if h.engine == "torchrun":
        return _torchrun_compute(config, h.torchrun.tp_size, h.torchrun.ep_size, refuse=refuse)
    if h.engine == "vllm":
        per_server = h.vllm.gpus_per_server
        return Compute(
            engine="vllm",
            gpus_per_model=per_server,
            n_gpus=max(len(h.vllm.endpoints), 1) * per_server,
            weight_bytes_per_param=model.quantized_weight_bytes_per_param or BF16_WEIGHT_BYTES_PER_PARAM,
        )
    return Compute(engine=h.engine, weight_bytes_per_param=BF16_WEIGHT_BYTES_PER_PARAM)


def plan_for_run(
    settings: HiddenStatesConfig,
    work: Workload,
    *,
    target_model_config: str | None,
    vocab_size: int,
    disk: DiskInputs | None = None,
) -> dict[str, ExtractionPlan]:
    """Two plans over `work` under the `hidden_states` settings: 'target' (the real target model,
    `target.model_config`, or the built-in Kimi-K2.5 when None: what a production run costs) and 'this_run' (the
    model configured for extraction here; the disk budget applies to it), each with the disk of other layer choices
    (the drafters' layer counts among them), both under the configured engine (`_compute`). `disk`
    (`disk_plan.disk_inputs`; None: the tokens spread evenly, no trainer copies, no connector): what is written,
    item by item, in both plans. Raises PlanRefused when this run's weights cannot fit the engine (Kimi-K2.5 in
    process on one GPU), or when its torchrun world would hold every routed expert on every rank."""
    target_config = load_text_config(target_model_config) if target_model_config else KIMI_K25_TEXT_CONFIG
    target = _shape(target_config, str(target_model_config)) if target_model_config else KIMI_SHAPE
    config, this_run, dtype_bytes = _extraction_model(settings.model, settings.family, vocab_size)
    stored = Storage.of_settings(settings, dtype_bytes=dtype_bytes)
    aux = settings.aux_layers
    # The target's plan: the section's layer count (a count fits any depth; ids do not), no budget, bf16 values.
    target_stored = replace(
        stored, aux_layers=aux if isinstance(aux, int) else None, dtype_bytes=2, disk_budget_bytes=None
    )
    plans = {
        "target": plan_extraction(
            target, work, target_stored, _compute(settings, target, target_config, refuse=False), disk=disk
        ),
        "this_run": plan_extraction(
            this_run, work, stored, _compute(settings, this_run, config, refuse=True), disk=disk
        ),
    }
    _refuse_unless_it_fits(plans["this_run"], this_run, settings.engine)
    return plans


def _extraction_model(model: str, family: str, vocab_size: int) -> tuple[Any, ModelShape, int]:
    """The extraction model's config, its plan facts and the bytes of one parameter as it will be loaded (the tiny
    random model loads in fp32 on CPU)."""
    if model == TINY_RANDOM:
        config = tiny_config(vocab_size, family=family)
        return config, _shape(config, f"tiny-random {family}"), 2 if torch.cuda.is_available() else 4
    config = load_text_config(model)
    return config, _shape(config, model), 2


def _refuse_unless_it_fits(run: ExtractionPlan, model: ModelShape, engine: str) -> None:
    """PlanRefused, with the setting to change, when this run's weights do not fit one model of the engine."""
    if run.fits_engine:
        return
    hint = (
        "use hidden_states.engine: vllm with servers of enough GPUs (docs/kimi.md)"
        if engine == "in_process"
        else "raise hidden_states.vllm.gpus_per_server (the servers' tensor-parallel size)"
        if engine == "vllm"
        else "raise hidden_states.torchrun.tp_size, or use engine: vllm"
    )
    need = "more than any count of" if run.min_gpus_for_weights is None else f"at least {run.min_gpus_for_weights}"
    raise PlanRefused(
        f"{model.name}: {model.total_params:.4g} parameters need {need} GPUs of 141 GB for their "
        f"weights, but engine {engine!r} holds one model on {run.gpus_per_model} GPU(s): {hint}"
    )
