"""The plans of the configured run, before any GPU is touched: the target's (what production costs) and this run's
(what the disk budget applies to), under the configured engine (`plan.plan_extraction` has the formulas)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from eagle_pipeline.hidden_states.models.model import (
    KIMI_K25_TEXT_CONFIG,
    TINY_RANDOM,
    describe_model_config,
    load_text_config,
    tiny_config,
)
from eagle_pipeline.hidden_states.models.world_split import ExpertsReplicated, rank_share, world_ep_size
from eagle_pipeline.hidden_states.plan.estimate import ExtractionPlan, plan_for_model
from eagle_pipeline.hidden_states.settings import SHARDS

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig


# vLLM serves compressed-tensors INT4 experts as they ship (~0.55 B/param for Kimi-K2.5 all told); transformers
# decompresses them to bf16 (docs/hidden_states.md §1), so in process every parameter is 2 bytes.
INT4_WEIGHT_BYTES_PER_PARAM = 0.55
BF16_WEIGHT_BYTES_PER_PARAM = 2.0


def _quantized_bytes_per_param(config: Any) -> float | None:
    q = config.get("quantization_config") if isinstance(config, dict) else None
    groups = (q or {}).get("config_groups") or {}
    bits = {g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)}
    return INT4_WEIGHT_BYTES_PER_PARAM if bits == {4} else None


def _facts(config: Any, name: str) -> dict[str, Any]:
    d = describe_model_config(config)
    return {
        "name": name,
        "hidden_size": d["hidden_size"],
        "num_layers": d["num_layers"],
        "total_params": d["params"],
        "active_params": d["matmul_active_params"],
        "quantized_weight_bytes_per_param": _quantized_bytes_per_param(config),
    }


class PlanRefused(ValueError):
    """The configured engine cannot hold the model's weights."""


def _torchrun_layout(config: Any, tp_size: int, ep_size: int | None, *, refuse: bool) -> dict[str, Any]:
    """One world of tp_size processes holds one model: each rank what the installed transformers' plans give it,
    with the ep_size the engine runs (`world_split.world_ep_size`; `refuse`: a world that would replicate the
    routed experts raises PlanRefused naming the setting, else the plan shows what it would hold)."""
    try:
        ep_size = world_ep_size(config, tp_size, ep_size)
    except ExpertsReplicated as e:
        if refuse:
            raise PlanRefused(str(e)) from e
    share = rank_share(config, tp_size, ep_size)
    return dict(
        engine="torchrun",
        gpus_per_model=tp_size,
        n_gpus=tp_size,
        weight_bytes_per_param=BF16_WEIGHT_BYTES_PER_PARAM,
        replicated_params=share.replicated if share is not None else 0.0,
    )


def _engine_layout(engine: str, facts: dict[str, Any], n_servers: int, gpus_per_server: int) -> dict[str, Any]:
    if engine == "vllm":
        q = facts.get("quantized_weight_bytes_per_param")
        return dict(
            engine="vllm",
            gpus_per_model=gpus_per_server,
            n_gpus=n_servers * gpus_per_server,
            weight_bytes_per_param=q or BF16_WEIGHT_BYTES_PER_PARAM,
        )
    return dict(engine=engine, gpus_per_model=1, n_gpus=1, weight_bytes_per_param=BF16_WEIGHT_BYTES_PER_PARAM)


def plan_for_run(
    *,
    n_tokens: int,
    n_samples: int,
    target_model_config: str | None,
    extraction_model: str,
    extraction_family: str,
    vocab_size: int,
    aux_layers: tuple[int, ...] | int | None,
    shard_size: int,
    layer_counts: Sequence[int] = (),
    disk_budget_gb: float | None,
    engine: str = "in_process",
    n_servers: int = 1,
    gpus_per_server: int = 8,
    tp_size: int = 2,
    ep_size: int | None = None,
    layout: str = SHARDS,
    disk: Mapping[str, Any] | None = None,
    quantize: str = "none",
) -> dict[str, ExtractionPlan]:
    """Two plans over the merged tokens: 'target' (the real target model, what a production run costs) and
    'this_run' (the model configured for extraction here; the disk budget applies to it; each with the disk of
    other layer choices, `layer_counts` among them), both under the configured
    engine: in process one GPU holds one model; with vLLM, `n_servers` servers of `gpus_per_server` GPUs each; under
    torchrun, one world of `tp_size` GPUs (`ep_size`: `hidden_states.torchrun.ep_size`), each holding what the installed
    transformers gives a rank (`world_split`).
    `layout`, `disk` and `quantize` (`plan.plan_extraction`'s): what is written, item by item, in both plans.
    Raises PlanRefused when this run's weights cannot fit the engine (Kimi-K2.5 in process on one GPU), or when its
    torchrun world would hold every routed expert on every rank."""
    budget = int(disk_budget_gb * 1e9) if disk_budget_gb is not None else None
    target_config = load_text_config(target_model_config) if target_model_config else KIMI_K25_TEXT_CONFIG
    target = _facts(target_config, str(target_model_config)) if target_model_config else KIMI_K25_TEXT_CONFIG
    config, this_run, dtype_bytes = _extraction_model(extraction_model, extraction_family, vocab_size)

    def engine_layout(facts: dict[str, Any], model_config: Any, *, refuse: bool) -> dict[str, Any]:
        if engine == "torchrun":
            return _torchrun_layout(model_config, tp_size, ep_size, refuse=refuse)
        return _engine_layout(engine, facts, n_servers, gpus_per_server)

    common: dict[str, Any] = dict(
        n_tokens=n_tokens,
        n_samples=n_samples,
        shard_size=shard_size,
        layer_counts=tuple(layer_counts),
        layout=layout,
        disk=disk,
        quantize=quantize,
    )
    plans = {
        "target": plan_for_model(
            target,
            aux_layers=aux_layers if isinstance(aux_layers, int) else None,  # a count fits any depth; ids do not
            disk_budget_bytes=None,
            **engine_layout(target, target_config, refuse=False),
            **common,
        ),
        "this_run": plan_for_model(
            this_run,
            aux_layers=aux_layers,
            dtype_bytes=dtype_bytes,
            disk_budget_bytes=budget,
            **engine_layout(this_run, config, refuse=True),
            **common,
        ),
    }
    _refuse_unless_it_fits(plans["this_run"], this_run, engine)
    return plans


def _extraction_model(model: str, family: str, vocab_size: int) -> tuple[Any, dict[str, Any], int]:
    """The extraction model's config, its plan facts and the bytes of one parameter as it will be loaded (the tiny
    random model loads in fp32 on CPU)."""
    if model == TINY_RANDOM:
        config = tiny_config(vocab_size, family=family)
        return config, _facts(config, f"tiny-random {family}"), 2 if torch.cuda.is_available() else 4
    config = load_text_config(model)
    return config, _facts(config, model), 2


def _refuse_unless_it_fits(run: ExtractionPlan, facts: dict[str, Any], engine: str) -> None:
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
        f"{facts['name']}: {facts['total_params']:.4g} parameters need {need} GPUs of 141 GB for their "
        f"weights, but engine {engine!r} holds one model on {run.gpus_per_model} GPU(s): {hint}"
    )


def plan_for_config(
    h: HiddenStatesConfig,
    *,
    target_model_config: str | None,
    n_tokens: int,
    n_samples: int,
    vocab_size: int,
    disk: Mapping[str, Any] | None = None,
) -> dict[str, ExtractionPlan]:
    """`plan_for_run` for the `hidden_states` settings: their extraction model, layers, shards, budget, engine and
    layout; `target_model_config` is `target.model_config` (None: the built-in Kimi-K2.5); `disk` as for
    `plan.plan_extraction`."""
    return plan_for_run(
        n_tokens=n_tokens,
        n_samples=n_samples,
        target_model_config=target_model_config,
        extraction_model=h.model,
        extraction_family=h.family,
        vocab_size=vocab_size,
        aux_layers=h.aux_layers,
        layer_counts=[d.layers for d in h.drafters if d.layers],
        shard_size=h.shard_size,
        disk_budget_gb=h.disk_budget_gb,
        engine=h.engine,
        n_servers=max(len(h.vllm.endpoints), 1),
        gpus_per_server=h.vllm.gpus_per_server,
        tp_size=h.torchrun.tp_size,
        ep_size=h.torchrun.ep_size,
        layout=h.layout,
        disk=disk,
        quantize=h.quantize,
    )
