"""What one rank of a `torchrun` world holds under the installed transformers (`engine: torchrun`, docs/hidden_states.md
§13), and the `ep_size` that makes the world split a MoE model's routed experts.

transformers decides the split with its parallel plans: `tp_plan` (a style per module or parameter name pattern) and,
when `ep_size > 1`, `ep_plan`, which takes precedence for the experts. Releases differ: 5.24's DeepSeek-V3 TP plan
splits each routed expert across the world, 5.25's lists only the shared experts and the dense MLP, so TP alone would
put every routed expert on every rank. `world_ep_size` asks the installed plans, through `RankShare`, what a rank
would hold, and turns on expert parallelism where TP alone would replicate the routed experts, or refuses an
explicit `ep_size` that would. The plan's GPU count uses the same `RankShare` (`replicated`: what every rank holds
whole). The plans are read from the model built on the meta device (no memory, no weights) from its config, with
one layer of each kind when the layers after `first_k_dense_replace` repeat (Kimi-K2.5: 2 of 61 layers, ~0.2 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EP_SETTING = "hidden_states.torchrun.ep_size"
# The parallel styles that shard a parameter across the world (transformers' ALL_PARALLEL_STYLES): the TP ones that
# split a dimension and EP's grouped experts. The others (replicate*, local*, the module-level moe_*/ep_dispatch_*
# hooks, sequence_parallel norms) leave it whole.
_SHARDING_PREFIXES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise", "embedding_", "grouped_gemm")


# Kimi-K2 and K2.5 text models (kimi_k2, kite_text) are DeepSeek-V3 (their own code subclasses it); the facts
# dicts name the layer count num_layers.
_MODEL_TYPES = {"kimi_k2": "deepseek_v3", "kite_text": "deepseek_v3"}
_FIELD_NAMES = {"num_layers": "num_hidden_layers"}


class ExpertsReplicated(ValueError):
    """The configured world would hold every routed expert on every rank."""


def is_routed_expert(name: str) -> bool:
    """A routed-expert parameter (`...mlp.experts.gate_up_proj`), not a shared expert (`...shared_experts...`)."""
    return "experts" in name.split(".")


def _matches(pattern: str, name: str) -> bool:
    """transformers' plan keys: dot-separated, `*` one segment, naming a module (its parameters match) or one
    parameter."""
    want, got = pattern.split("."), name.split(".")
    return len(got) in (len(want), len(want) + 1) and all(w in ("*", g) for w, g in zip(want, got))


def _style(name: str, plan: Mapping[str, str]) -> str | None:
    keys = [k for k in plan if _matches(k, name)]
    return plan[max(keys, key=len)] if keys else None  # the most specific rule


def _shards(style: str | None, name: str) -> bool:
    if style is None or not style.startswith(_SHARDING_PREFIXES):
        return False
    return not (style.startswith("rowwise") and name.endswith(".bias"))  # added after the reduce: whole


@dataclass(frozen=True)
class RankShare:
    """Parameter counts of a model and of one rank of a world of `world` ranks with `ep_size` (None: TP alone)."""

    world: int
    ep_size: int | None
    params: float
    replicated: float  # every rank holds these whole
    routed_experts: float
    routed_experts_replicated: float

    @property
    def params_per_rank(self) -> float:
        return self.replicated + (self.params - self.replicated) / self.world

    @property
    def routed_experts_per_rank(self) -> float:
        split = self.routed_experts - self.routed_experts_replicated
        return self.routed_experts_replicated + split / self.world

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "params_per_rank": self.params_per_rank,
            "routed_expert_params": self.routed_experts,
            "routed_expert_params_per_rank": self.routed_experts_per_rank,
        }


def hf_config(config: Any) -> Any | None:
    """A transformers config from a config object or a config.json dict; None for a model type transformers does
    not know (its plans are the model's own code's)."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    fields = {_FIELD_NAMES.get(str(k), str(k)): v for k, v in config.items() if k != "model_type"}
    model_type = str(config.get("model_type", "llama"))
    try:
        return AutoConfig.for_model(_MODEL_TYPES.get(model_type, model_type), **fields)
    except (KeyError, ValueError):
        return None


def _repeating_layers(cfg: Any) -> tuple[int, int]:
    """(layers built, layers in the model): the layers from `first_k_dense_replace` on are one kind, so one of
    them stands for all (a model with per-layer patterns of its own is built whole)."""
    n = int(cfg.num_hidden_layers)
    if any(getattr(cfg, k, None) for k in ("mlp_layer_types", "layer_types", "mlp_only_layers")):
        return n, n
    k_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    return min(n, k_dense + 1), n


def rank_share(config: Any, world: int, ep_size: int | None) -> RankShare | None:
    """What a rank of a `world`-rank torchrun world holds of `config`'s model under the installed transformers'
    plans (None: a model type transformers does not know)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config)
    if cfg is None:
        return None
    built, n_layers = _repeating_layers(cfg)
    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers = built
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tp_plan = dict(model.tp_plan or {})
    ep_plan = dict(model.ep_plan or {}) if (ep_size or 1) > 1 else {}
    totals = {"params": 0.0, "replicated": 0.0, "routed_experts": 0.0, "routed_experts_replicated": 0.0}
    for name, p in model.named_parameters():
        segments = name.split(".")
        # A built layer stands for itself and, the last one, for every layer after it.
        weight = float(n_layers - built + 1) if "layers" in segments and _layer(segments) == built - 1 else 1.0
        count = p.numel() * weight
        style = _style(name, ep_plan) or _style(name, tp_plan)
        whole = not _shards(style, name)
        totals["params"] += count
        totals["replicated"] += count if whole else 0.0
        if is_routed_expert(name):
            totals["routed_experts"] += count
            totals["routed_experts_replicated"] += count if whole else 0.0
    return RankShare(world=world, ep_size=ep_size, **totals)


def _layer(segments: list[str]) -> int:
    return int(segments[segments.index("layers") + 1])


def world_ep_size(config: Any, tp_size: int, ep_size: int | None) -> int | None:
    """The `ep_size` a world of `tp_size` ranks runs `config`'s model with: as configured, unless transformers' TP
    plan alone would hold every routed expert on every rank, where it is `tp_size` (expert parallelism splits them).
    An explicit `ep_size` that leaves them replicated raises ExpertsReplicated naming the setting."""
    if tp_size == 1:
        return ep_size
    share = rank_share(config, tp_size, ep_size)
    if share is None or share.routed_experts == 0 or share.routed_experts_replicated == 0:
        return ep_size  # dense, unknown to transformers, or already split
    import transformers

    replicated = (
        f"{share.routed_experts_replicated:.4g} routed-expert parameters on each of the {tp_size} ranks: "
        f"transformers {transformers.__version__}'s tensor-parallel plan for {type(hf_config(config)).__name__} "
        "does not split the routed experts"
    )
    if ep_size is not None:
        raise ExpertsReplicated(
            f"{EP_SETTING}: {ep_size} with tp_size {tp_size} would hold {replicated}; set it to {tp_size} (or leave "
            "it unset: the engine then splits them by expert parallelism)"
        )
    with_ep = rank_share(config, tp_size, tp_size)
    if with_ep is None or with_ep.routed_experts_replicated:
        raise ExpertsReplicated(f"tp_size {tp_size} would hold {replicated}, nor does its expert-parallel plan")
    return tp_size
