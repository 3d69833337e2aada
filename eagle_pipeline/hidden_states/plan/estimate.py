"""Disk and GPU-time estimates for hidden-state extraction, before any GPU is touched (the disk side, item by item,
is `disk_plan`'s)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers
from eagle_pipeline.hidden_states.models.model import describe_model_config
from eagle_pipeline.hidden_states.plan.disk_plan import DiskInputs, extraction_disk, state_shape
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_NONE

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

# The field's observed extraction rate for Kimi-K2.5 on H200 (TorchSpec: 6B tokens in 1,500 GPU-hours including
# training, docs/hidden_states.md §1): shown beside the MFU assumption, which it may undercut by up to ~2.5x.
OBSERVED_TOKENS_PER_GPU_S = (2200.0, 3700.0)


@dataclass
class ExtractionPlan:
    hidden_size: int
    num_layers: int
    aux_layers: tuple[int, ...]
    save_final_state: bool
    dtype_bytes: int
    n_tokens: int
    n_samples: int
    total_params: float
    active_params: float
    bytes_per_token: int
    hidden_bytes: int
    overhead_bytes: int
    bytes_on_disk: int
    flops: float
    gpu_hours: float
    n_gpus: int
    wall_hours: float
    shard_size: int
    n_shards: int
    tokens_per_shard: float
    bytes_per_shard: float
    gpu_hours_per_shard: float
    disk_budget_bytes: int | None
    exceeds_budget: bool
    min_gpus_for_weights: int | None  # None: no count of GPUs holds them (each would hold too much whole)
    engine: str = "in_process"
    gpus_per_model: int = 1  # GPUs one copy of the model spans under the engine (a vLLM server's TP size)
    fits_engine: bool = True  # the weights fit in gpus_per_model GPUs
    assumed_tokens_per_gpu_s: float = 0.0  # what the MFU assumption means per GPU
    observed_tokens_per_gpu_s: tuple[float, float] = OBSERVED_TOKENS_PER_GPU_S
    observed_wall_hours: tuple[float, float] = (0.0, 0.0)  # wall hours at the observed rates (slow, fast)
    assumptions: dict[str, Any] = field(default_factory=dict)
    # The disk of other layer choices over the same tokens (docs/drafters.md): {choice, aux_layers, bytes_on_disk}.
    layer_choices: list[dict[str, Any]] = field(default_factory=list)
    layout: str = SHARDS  # hidden_states.layout: where the states are written
    # What is written, item by item (`disk_plan.disk_items`); bytes_on_disk is the sum of the counted ones.
    disk_items: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        d["observed_tokens_per_gpu_s"] = list(self.observed_tokens_per_gpu_s)
        d["observed_wall_hours"] = list(self.observed_wall_hours)
        return d

    def to_markdown(self) -> str:
        budget = "none" if self.disk_budget_bytes is None else _bytes(self.disk_budget_bytes)
        verdict = "**EXCEEDS the disk budget**" if self.exceeds_budget else "within budget"
        lines = [
            "| quantity | value |",
            "|---|---|",
            f"| tokens / samples | {self.n_tokens:,} / {self.n_samples:,} |",
            f"| hidden size / layers | {self.hidden_size} / {self.num_layers} |",
            f"| aux layers (decoder-layer outputs) | {list(self.aux_layers)}"
            f"{' + final' if self.save_final_state else ''} |",
            f"| bytes per token | {self.bytes_per_token:,} |",
            f"| disk, all that is written | {_bytes(self.bytes_on_disk)} (budget {budget}: {verdict}) |",
            f"| compute | {self.flops:.3g} FLOPs = {self.gpu_hours:,.1f} GPU-hours "
            f"({self.wall_hours:,.1f} h on {self.n_gpus} GPU{'s' if self.n_gpus != 1 else ''}) |",
            f"| engine | {self.engine}: {self.n_gpus // self.gpus_per_model} x {self.gpus_per_model} GPU"
            f"{'s' if self.gpus_per_model != 1 else ''} |",
            f"| throughput per GPU | {self.assumed_tokens_per_gpu_s:,.0f} tokens/s assumed (MFU); the field observed "
            f"{self.observed_tokens_per_gpu_s[0]:,.0f}-{self.observed_tokens_per_gpu_s[1]:,.0f} (TorchSpec, "
            f"Kimi-K2.5 on H200): {self.observed_wall_hours[1]:,.1f}-{self.observed_wall_hours[0]:,.1f} h wall |",
            f"| GPUs needed to hold the weights | "
            f"{'none: what every GPU holds whole exceeds one' if self.min_gpus_for_weights is None else f'>= {self.min_gpus_for_weights}'}"
            f"{'' if self.fits_engine else f' (**does NOT fit** the {self.gpus_per_model} GPU(s) of one {self.engine} model)'} |",
            f"| shards | {self.n_shards:,} x {self.shard_size} rows: ~{_bytes(self.bytes_per_shard)}, "
            f"~{self.gpu_hours_per_shard:.3g} GPU-hours each |",
            "",
            "Assumptions:",
            "",
        ]
        lines += [f"- {k}: {v}" for k, v in self.assumptions.items()]
        lines += [
            "",
            f"Disk, by what is written (layout {self.layout}):",
            "",
            "| what | where | bytes |",
            "|---|---|---|",
        ]
        lines += [
            f"| {d['what']} | {d['place']} | {d['bytes']:,} ({_bytes(d['bytes'])})"
            f"{'' if d['counted'] else ', not counted: ' + d['note']} |"
            for d in self.disk_items
        ]
        lines.append(f"| **total** | | **{self.bytes_on_disk:,} ({_bytes(self.bytes_on_disk)})** |")
        if self.layer_choices:
            lines += [
                "",
                "Disk by layer choice (the same tokens):",
                "",
                "| choice | aux layers | disk |",
                "|---|---|---|",
            ]
            lines += [
                f"| {c['choice']} | {c['aux_layers']} | {_bytes(c['bytes_on_disk'])} |" for c in self.layer_choices
            ]
        return "\n".join(lines) + "\n"


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its name, width and depth, its parameters (all of them, and those a token's
    matmuls touch), and the bytes per parameter of the quantized weights it ships with (None: it ships none)."""

    name: str
    hidden_size: int
    num_layers: int
    total_params: float
    active_params: float
    quantized_weight_bytes_per_param: float | None = None

    @classmethod
    def of_facts(cls, facts: Mapping[str, Any]) -> ModelShape:
        """From a facts dict such as `KIMI_K25_TEXT_CONFIG`."""
        return cls(
            name=str(facts["name"]),
            hidden_size=int(facts["hidden_size"]),
            num_layers=int(facts["num_layers"]),
            total_params=float(facts["total_params"]),
            active_params=float(facts["active_params"]),
            quantized_weight_bytes_per_param=facts.get("quantized_weight_bytes_per_param"),
        )

    @classmethod
    def of_config(cls, config: Any, name: str, *, quantized_weight_bytes_per_param: float | None = None) -> ModelShape:
        """From a transformers config (or config dict), through `model.describe_model_config`."""
        d = describe_model_config(config)
        return cls(
            name=name,
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_layers"]),
            total_params=float(d["params"]),
            active_params=float(d["matmul_active_params"]),
            quantized_weight_bytes_per_param=quantized_weight_bytes_per_param,
        )


@dataclass(frozen=True)
class Workload:
    """The tokens and rows a plan covers: the merged table's, or a scale sized before its data exists."""

    n_tokens: int
    n_samples: int

    def __post_init__(self) -> None:
        if self.n_tokens < 0 or self.n_samples < 0:
            raise ValueError("n_tokens and n_samples must be non-negative")


@dataclass(frozen=True)
class Storage:
    """What is written of each token and how it is sharded: the aux layers (ids, a count, or None for EAGLE-3's
    low/mid/high), the final state, the bytes of one value, `quantize` (FP8: 1 B values and a scale per vector), the
    layout, rows per shard, the layer counts the drafters read (the disk of each is shown beside), and the disk budget
    (None: none). `of_settings` reads them from the `hidden_states` section."""

    aux_layers: Sequence[int] | int | None = None
    dtype_bytes: int = 2
    save_final_state: bool = True
    quantize: str = QUANTIZE_NONE
    layout: str = SHARDS
    shard_size: int = 256
    layer_counts: tuple[int, ...] = ()
    disk_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.shard_size < 1:
            raise ValueError("shard_size must be >= 1")

    @classmethod
    def of_settings(cls, h: HiddenStatesConfig, *, dtype_bytes: int = 2) -> Storage:
        """The section's layers, quantization, layout, shard size, drafters' layer counts and budget; `dtype_bytes`:
        the values' bytes as the extraction model is loaded."""
        budget = int(h.disk_budget_gb * 1e9) if h.disk_budget_gb is not None else None
        return cls(
            aux_layers=h.aux_layers,
            dtype_bytes=dtype_bytes,
            quantize=h.quantize,
            layout=h.layout,
            shard_size=h.shard_size,
            layer_counts=tuple(d.layers for d in h.drafters if d.layers),
            disk_budget_bytes=budget,
        )


def plan_extraction(
    model: ModelShape,
    work: Workload,
    stored: Storage | None = None,
    compute: Compute | None = None,
    *,
    disk: DiskInputs | None = None,
) -> ExtractionPlan:
    """Estimate disk and GPU time of extracting `work` with `model` (the formulas: docs/hidden_states.md §1).

    disk = what is written (`disk_plan.disk_items`; `layout: shards`: n_tokens x [(len(aux) + final) x H x
    dtype_bytes + 5] + n_samples x 640 B + 10 kB per shard; `disk`: the per-shard figures, trainer copies and
    connector peak from the merged rows, `disk_plan.disk_inputs`; None: the tokens spread evenly over the shards).
    FLOPs = 2 x active_params x n_tokens (one prefill; lm_head and attention scores ignored); GPU-hours = FLOPs /
    (peak x mfu) / 3600, wall = / n_gpus; min GPUs = ceil(split x weight_bytes_per_param / (0.9 x gpu_memory_bytes -
    replicated_params x weight_bytes_per_param)) with split = total_params - replicated_params (`Compute`; default:
    one GPU in process), fitting the engine when <= `gpus_per_model`. `layer_choices`: the disk of EAGLE-3's and
    SpecForge's 1-/5-layer spreads (and `stored.layer_counts`).
    """
    stored, compute = stored or Storage(), compute or Compute()
    n_tokens, n_samples, shard_size = work.n_tokens, work.n_samples, stored.shard_size
    aux = resolve_aux_layers(stored.aux_layers, model.num_layers)
    final = 1 if stored.save_final_state else 0
    shape = state_shape(len(aux) + final, model.hidden_size, stored.dtype_bytes, stored.quantize)
    written = extraction_disk(shape, stored.layout, disk, n_tokens, n_samples, shard_size)
    total = written.bytes_on_disk
    gpu = compute.figures(n_tokens, model.total_params, model.active_params)
    frac = min(shard_size / n_samples, 1.0) if n_samples else 0.0
    budget = stored.disk_budget_bytes
    return ExtractionPlan(
        hidden_size=model.hidden_size,
        num_layers=model.num_layers,
        aux_layers=aux,
        save_final_state=stored.save_final_state,
        dtype_bytes=shape.dtype_bytes,
        n_tokens=n_tokens,
        n_samples=n_samples,
        total_params=float(model.total_params),
        active_params=float(model.active_params),
        bytes_per_token=written.bytes_per_token,
        hidden_bytes=written.hidden_bytes,
        overhead_bytes=written.overhead_bytes,
        bytes_on_disk=total,
        n_gpus=compute.n_gpus,
        shard_size=shard_size,
        n_shards=max(math.ceil(n_samples / shard_size), 1) if n_samples else 0,
        tokens_per_shard=n_tokens * frac,
        bytes_per_shard=total * frac,
        gpu_hours_per_shard=gpu["gpu_hours"] * frac,
        disk_budget_bytes=budget,
        exceeds_budget=budget is not None and total > budget,
        engine=compute.engine,
        gpus_per_model=compute.gpus_per_model,
        fits_engine=gpu["min_gpus_for_weights"] is not None and gpu["min_gpus_for_weights"] <= compute.gpus_per_model,
        assumptions=compute.assumptions(model.total_params, shape.dtype_bytes),
        layer_choices=[
            {"choice": name, "aux_layers": list(ids), "bytes_on_disk": written.bytes_with_states(len(ids) + final)}
            for name, ids in _layer_choices(aux, model.num_layers, stored.layer_counts).items()
        ],
        layout=stored.layout,
        disk_items=written.items,
        **gpu,
    )


@dataclass(frozen=True)
class Compute:
    """The GPUs the plan assumes: the engine's model span and count, their peak and MFU, memory and the weights'
    bytes per parameter, and what each GPU of one model holds whole (`plan_extraction`'s docstring: the formulas)."""

    engine: str = "in_process"
    gpus_per_model: int = 1
    n_gpus: int = 1
    peak_tflops: float = 989.0  # dense bf16, H100/H200 SXM
    mfu: float = 0.35
    weight_bytes_per_param: float = 2.0
    gpu_memory_bytes: float = 141e9
    replicated_params: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.n_gpus < 1 or self.gpus_per_model < 1:
            raise ValueError("n_gpus and gpus_per_model must be >= 1")

    def figures(self, n_tokens: int, total_params: float, active_params: float) -> dict[str, Any]:
        """The compute side of the plan: FLOPs, GPU and wall hours, the GPUs the weights need, the rates."""
        flops = 2.0 * active_params * n_tokens
        per_param = self.weight_bytes_per_param
        room = 0.9 * self.gpu_memory_bytes - self.replicated_params * per_param  # per GPU, for the split weights
        split = (total_params - self.replicated_params) * per_param
        rate = self.peak_tflops * 1e12 * self.mfu
        gpu_hours = flops / rate / 3600.0
        slow, fast = OBSERVED_TOKENS_PER_GPU_S
        return dict(
            flops=flops,
            gpu_hours=gpu_hours,
            wall_hours=gpu_hours / self.n_gpus,
            min_gpus_for_weights=max(math.ceil(split / room), 1) if room > 0 else None,
            assumed_tokens_per_gpu_s=rate / (2.0 * active_params) if active_params else float("inf"),
            observed_wall_hours=(n_tokens / (slow * self.n_gpus) / 3600.0, n_tokens / (fast * self.n_gpus) / 3600.0),
        )

    def assumptions(self, total_params: float, dtype_bytes: int) -> dict[str, Any]:
        """The plan's assumptions, in words, as the plan prints them."""
        slow, fast = OBSERVED_TOKENS_PER_GPU_S
        replicated = self.replicated_params
        return {
            "disk formula": "tokens x (n_aux + final) x hidden x dtype_bytes + tokens x 5 B ids/mask + samples x "
            "640 B + shards x 10 kB for the project's shards; each item's own per-token and per-file bytes below",
            "flops formula": "2 x active_params x tokens (prefill only, no lm_head, attention scores ignored)",
            "gpu peak": f"{self.peak_tflops} TFLOP/s dense bf16 (H100/H200 SXM)",
            "mfu": f"{self.mfu} (assumed; MoE prefill at small batch usually runs below dense MFU)",
            "observed rate": f"{slow:,.0f}-{fast:,.0f} tokens/s per GPU: TorchSpec's Kimi-K2.5 drafter, 6B tokens "
            "in 1,500 H200 GPU-hours including training (so an upper bound on cost); vLLM's extraction costs 10-42% "
            "of prefill throughput by the reports",
            "engine": f"{self.engine}: one model copy spans {self.gpus_per_model} GPU(s); {self.n_gpus} GPU(s) in all",
            "weights": f"{total_params:.4g} params x {self.weight_bytes_per_param} B on "
            f"{self.gpu_memory_bytes / 1e9:.0f} GB GPUs, 10% kept for activations (sets the minimum GPU count, not "
            "the hours; Kimi-K2.5 ships INT4 experts, ~0.55 B/param)"
            + (
                f"; {replicated:.4g} of them held whole by every GPU of a model, the rest split evenly (what a"
                " torchrun rank holds under the installed transformers' parallel plans)"
                if replicated
                else ", split evenly over the GPUs of a model"
            ),
            "dtype bytes": dtype_bytes,
            "no compression": "hidden states are stored raw; bf16 activations compress poorly",
            "no padding on disk": "batches are padded in memory only; files hold each sample's real tokens",
        }


def _layer_choices(aux: Sequence[int], num_layers: int, counts: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Choice name -> its layer ids: the configured ones first, then those that differ from them."""
    out: dict[str, tuple[int, ...]] = {"configured": tuple(aux)}
    candidates: list[tuple[str, Sequence[int] | int | None]] = [("EAGLE-3 low/mid/high", None)]
    candidates += [(f"{n} layers (SpecForge's DFlash spread)", n) for n in dict.fromkeys([1, 5, *counts])]
    for name, setting in candidates:
        try:
            ids = resolve_aux_layers(setting, num_layers)
        except ValueError:  # a count this depth cannot hold
            continue
        if ids not in out.values():
            out[name] = ids
    return out
