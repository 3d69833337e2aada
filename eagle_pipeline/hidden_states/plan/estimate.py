"""Disk and GPU-time estimates for hidden-state extraction, before any GPU is touched."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers
from eagle_pipeline.hidden_states.plan.disk_plan import (
    FP8_SCALE_BYTES,
    DiskBudgetExceeded,
    FilesystemNeed,
    StateShape,
    check_disk,
    disk_items,
    free_bytes,
)
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_FP8, QUANTIZE_NONE
from eagle_pipeline.hidden_states.store.shard_index import IDS_BYTES, MASK_BYTES, PROJECT_SHARD_SAMPLE_BYTES
from eagle_pipeline.shared.storage import read_json

__all__ = ["DiskBudgetExceeded", "ExtractionPlan", "check_disk_budget", "plan_extraction", "plan_for_model"]
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


def plan_extraction(
    *,
    hidden_size: int,
    num_layers: int,
    total_params: float,
    active_params: float,
    n_tokens: int,
    n_samples: int,
    aux_layers: Sequence[int] | int | None = None,
    dtype_bytes: int = 2,
    save_final_state: bool = True,
    gpu_bf16_peak_tflops: float = 989.0,
    mfu: float = 0.35,
    n_gpus: int = 1,
    shard_size: int = 256,
    disk_budget_bytes: int | None = None,
    weight_bytes_per_param: float = 2.0,
    gpu_memory_bytes: float = 141e9,
    engine: str = "in_process",
    gpus_per_model: int = 1,
    replicated_params: float = 0.0,
    layer_counts: Sequence[int] = (),
    layout: str = SHARDS,
    disk: Mapping[str, Any] | None = None,
    quantize: str = QUANTIZE_NONE,
) -> ExtractionPlan:
    """Estimate disk and GPU time of extracting `n_tokens` tokens (the formulas: docs/hidden_states.md §1).

    disk = what is written (`disk_plan.disk_items`; `layout: shards`: n_tokens x [(len(aux) + final) x H x
    dtype_bytes + 5] + n_samples x 640 B + 10 kB per shard; `disk`: its other arguments, e.g. trainer_layouts,
    scratch_rows; per-shard figures default to the tokens spread evenly). FLOPs = 2 x active_params x n_tokens (one
    prefill; lm_head and attention scores ignored); GPU-hours = FLOPs / (peak x mfu) / 3600, wall = / n_gpus; min
    GPUs = ceil(split x weight_bytes_per_param / (0.9 x gpu_memory_bytes - replicated_params x weight_bytes_per_param))
    with split = total_params - replicated_params (`replicated_params`: what every GPU of one model holds whole, a
    torchrun rank's share under the installed transformers, `world_split.RankShare`), fitting the engine when <=
    `gpus_per_model`. `layer_choices`: the disk of EAGLE-3's and SpecForge's 1-/5-layer spreads (and `layer_counts`).
    """
    if n_tokens < 0 or n_samples < 0 or shard_size < 1:
        raise ValueError("n_tokens and n_samples must be non-negative, shard_size >= 1")
    compute = Compute(
        engine=engine,
        gpus_per_model=gpus_per_model,
        n_gpus=n_gpus,
        peak_tflops=gpu_bf16_peak_tflops,
        mfu=mfu,
        weight_bytes_per_param=weight_bytes_per_param,
        gpu_memory_bytes=gpu_memory_bytes,
        replicated_params=replicated_params,
    )
    aux = resolve_aux_layers(aux_layers, num_layers)
    final = 1 if save_final_state else 0
    if quantize == QUANTIZE_FP8:  # e4m3 values and one fp32 scale per token per layer (hidden_states/store/fp8.py)
        dtype_bytes, shape = 1, StateShape(len(aux) + final, hidden_size, 1, FP8_SCALE_BYTES)
    else:
        shape = StateShape(len(aux) + final, hidden_size, dtype_bytes)
    items = _disk_items(shape, layout, disk, n_tokens, n_samples, shard_size)
    total = sum(d["bytes"] for d in items if d["counted"])
    gpu = compute.figures(n_tokens, total_params, active_params)
    frac = min(shard_size / n_samples, 1.0) if n_samples else 0.0
    copies = sum(1 for d in items if d["counted"] and d["what"].startswith(("states", "copy")))  # of the states
    per_layer = n_tokens * hidden_size * dtype_bytes * copies
    return ExtractionPlan(
        hidden_size=hidden_size,
        num_layers=num_layers,
        aux_layers=aux,
        save_final_state=save_final_state,
        dtype_bytes=dtype_bytes,
        n_tokens=n_tokens,
        n_samples=n_samples,
        total_params=float(total_params),
        active_params=float(active_params),
        bytes_per_token=shape.token_bytes + IDS_BYTES + MASK_BYTES,
        hidden_bytes=n_tokens * shape.token_bytes,
        overhead_bytes=n_tokens * (IDS_BYTES + MASK_BYTES) + n_samples * PROJECT_SHARD_SAMPLE_BYTES,
        bytes_on_disk=total,
        n_gpus=n_gpus,
        shard_size=shard_size,
        n_shards=max(math.ceil(n_samples / shard_size), 1) if n_samples else 0,
        tokens_per_shard=n_tokens * frac,
        bytes_per_shard=total * frac,
        gpu_hours_per_shard=gpu["gpu_hours"] * frac,
        disk_budget_bytes=disk_budget_bytes,
        exceeds_budget=disk_budget_bytes is not None and total > disk_budget_bytes,
        engine=engine,
        gpus_per_model=gpus_per_model,
        fits_engine=gpu["min_gpus_for_weights"] is not None and gpu["min_gpus_for_weights"] <= gpus_per_model,
        assumptions=compute.assumptions(total_params, dtype_bytes),
        layer_choices=[
            {"choice": name, "aux_layers": list(ids), "bytes_on_disk": total + (len(ids) - len(aux)) * per_layer}
            for name, ids in _layer_choices(aux, num_layers, layer_counts).items()
        ],
        layout=layout,
        disk_items=items,
        **gpu,
    )


@dataclass(frozen=True)
class Compute:
    """The GPUs the plan assumes: the engine's model span and count, their peak and MFU, memory and the weights'
    bytes per parameter, and what each GPU of one model holds whole (`plan_extraction`'s docstring: the formulas)."""

    engine: str
    gpus_per_model: int
    n_gpus: int
    peak_tflops: float
    mfu: float
    weight_bytes_per_param: float
    gpu_memory_bytes: float
    replicated_params: float

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


def _disk_items(
    shape: StateShape, layout: str, disk: Mapping[str, Any] | None, n_tokens: int, n_samples: int, shard_size: int
) -> list[dict[str, Any]]:
    """`disk_plan.disk_items` for the plan; without per-shard figures the tokens are spread evenly over the shards."""
    kw = dict(disk or {})
    if "shard_rows" not in kw:
        rows = [min(shard_size, n_samples - start) for start in range(0, n_samples, shard_size)]
        kw["shard_rows"] = rows
        kw["shard_tokens"] = [n_tokens * r // n_samples for r in rows]
        if rows:
            kw["shard_tokens"][-1] += n_tokens - sum(kw["shard_tokens"])
    return disk_items(shape, layout=layout, **kw)


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


def plan_for_model(facts: Mapping[str, Any], *, n_tokens: int, n_samples: int, **kwargs: Any) -> ExtractionPlan:
    """`plan_extraction` with the shape taken from a facts dict such as `KIMI_K25_TEXT_CONFIG`."""
    return plan_extraction(
        hidden_size=int(facts["hidden_size"]),
        num_layers=int(facts["num_layers"]),
        total_params=float(facts["total_params"]),
        active_params=float(facts["active_params"]),
        n_tokens=n_tokens,
        n_samples=n_samples,
        **kwargs,
    )


def check_disk_budget(
    plan_path: str | Path,
    disk_budget_gb: float | None,
    *,
    places: Mapping[str, Path] | None = None,
    done_shards: Collection[int] = (),
    free_space: Callable[[Path], int] = free_bytes,
) -> list[FilesystemNeed]:
    """Raise `DiskBudgetExceeded` when the plan at `plan_path` ('this_run') exceeds the budget in force now, or,
    with `places` (each item's folder: `run.disk_places`), when what remains to be written on a filesystem (all but
    `done_shards`) exceeds its free space (`disk_plan.check_disk`); return each filesystem's figures.

    The budget is the caller's current setting, not the one plan.json was made under, so lowering it takes effect
    without replanning. A missing plan is a FileNotFoundError that says how to make one.
    """
    plan_path = Path(plan_path)
    if not plan_path.exists():
        raise FileNotFoundError(f"No extraction plan at {plan_path}: materialize hidden_state_plan first.")
    plan = read_json(plan_path)["this_run"]
    if places is None or "disk_items" not in plan:  # a plan.json written before the items: the budget alone
        if disk_budget_gb is not None and int(plan["bytes_on_disk"]) > disk_budget_gb * 1e9:
            raise DiskBudgetExceeded(int(plan["bytes_on_disk"]), disk_budget_gb, plan)
        return []
    return check_disk(plan, disk_budget_gb, places=places, done_shards=done_shards, free_space=free_space)
