"""The hidden-state stage's settings: the configuration's `hidden_states` section (`HiddenStatesConfig`) and its
sub-sections (`hidden_states.vllm`, `hidden_states.torchrun`, `hidden_states.drafters[i]`).

The stage owns them; `eagle_pipeline.config` assembles them into `PipelineConfig`, so the
engines, the plan and the CLI take this one settings object. Each is a `shared.spec_model.SpecBase`: its fields' types
and bounds are the checks, and `rule_problems` the rules across fields of the section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo
from pydantic import field_validator as _field_validator
from pydantic.dataclasses import dataclass

from eagle_pipeline.drafter_types import (
    DEFAULT_DRAFTERS,
    DRAFTER_TYPES,
    SPECFORGE,
    SPECULATORS,
    TRAINERS,
    drafter_problems,
    model_depth,
)
from eagle_pipeline.shared.spec_model import (
    SPEC_CONFIG,
    Bool,
    Float,
    Int,
    Problem,
    ResolvedPath,
    SpecBase,
    Str,
    field_value,
    resolve_path,
)


@dataclass(frozen=True, config=SPEC_CONFIG)
class VLLMEngineConfig(SpecBase):
    """`hidden_states.vllm`: the running `vllm serve` servers the `vllm` engine sends shards to."""

    label = "hidden_states.vllm"

    endpoints: tuple[Str, ...] = ()  # base URLs, or 'simulated' (a loopback double serving tiny-random)
    storage_path: Str = "/dev/shm/hidden_states"  # the connector's shared_storage_path, as this process sees it
    concurrency: Annotated[Int, Field(ge=1)] = 8  # requests in flight per endpoint
    timeout_s: Annotated[Float, Field(gt=0)] = 600.0
    max_retries: Annotated[Int, Field(ge=0)] = 4
    gpus_per_server: Annotated[Int, Field(ge=1)] = 8  # each server's TP size: the plan and `vllm-command`
    # The config.json (or local snapshot) of the model the servers load, when `vllm serve` loads a hub id: its layer
    # count and H give the layer ids (`vllm-command`) and the checks (`vllm-smoke`); None: read from the served
    # model's directory or `model` (docs/hidden_states.md §10).
    served_model_config: Str | None = None
    max_model_len: Annotated[Int, Field(ge=2)] | None = None  # `--max-model-len`; None: max_position_embeddings
    # Merged rows the servers cannot take (max_model_len tokens or more): refuse the shard before any request, or
    # drop them (recorded in the shard's metadata as dropped_rows).
    too_long_rows: Literal["refuse", "drop"] = "refuse"

    @_field_validator("endpoints")
    @classmethod
    def _base_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for e in value:
            if not (e == "simulated" or e.startswith(("http://", "https://"))):
                raise ValueError(f"expected http(s):// base URLs or 'simulated', got {e!r}")
        return value

    @_field_validator("storage_path")
    @classmethod
    def _resolve_storage(cls, value: str, info: ValidationInfo) -> str:
        return str(resolve_path(value, info))

    @_field_validator("served_model_config")
    @classmethod
    def _resolve_served_config(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else str(resolve_path(value, info))


@dataclass(frozen=True, config=SPEC_CONFIG)
class TorchrunConfig(SpecBase):
    """`hidden_states.torchrun`: one shard per torchrun world of `tp_size` processes (transformers' DistributedConfig)."""

    label = "hidden_states.torchrun"

    tp_size: Annotated[Int, Field(ge=1)] = 2
    ep_size: Annotated[Int, Field(ge=1)] | None = None

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        tp, ep = data.get("tp_size", 2), data.get("ep_size")
        if isinstance(tp, int) and isinstance(ep, int) and ep not in (1, tp):  # transformers: tp | ep | tp (no FSDP)
            return [(("ep_size",), f"must be 1 or tp_size ({tp}): transformers splits the experts over the world")]
        return []


DrafterType = Literal[DRAFTER_TYPES]  # type: ignore[valid-type]
# `hidden_states.layout`: the project's own shard files, or a trainer's own files (named by the trainer). The names
# are defined here once, where the configuration takes them; each names one object of `trainer_layouts.LAYOUTS`.
SHARDS = "shards"
LAYOUT_NAMES = (SHARDS, *TRAINERS)
LayoutName = Literal[LAYOUT_NAMES]  # type: ignore[valid-type]
# The `quantize` modes each layout's files hold (`store/fp8.py`), decided here, where the configuration is checked as
# it loads, before any layout object (or torch) is imported; each object takes its own (`Layout.quantize_modes`).
# SpecForge's loader reads its .ckpt files as they are, with no FP8 reader.
LAYOUT_QUANTIZE: dict[str, tuple[str, ...]] = {
    SHARDS: ("none", "fp8"),
    SPECFORGE: ("none",),
    SPECULATORS: ("none", "fp8"),
}
TrainerName = Literal[TRAINERS]  # type: ignore[valid-type]


@dataclass(frozen=True, config=SPEC_CONFIG)
class DrafterSpec(SpecBase):
    """One entry of `hidden_states.drafters`: a drafter type the hand-off serves (a bare name in the file is
    `{type: name}`), optionally the target-layer count it reads and the trainers it must be served by."""

    label = "drafter"

    type: DrafterType
    layers: Annotated[Int, Field(ge=1)] | None = None  # target layers the draft reads (e.g. a 5-layer DFlash)
    trainers: tuple[TrainerName, ...] | None = None  # None: every exported one that can


# Padded tokens per forward when none is given: the Python API's, torchrun's and `max_tokens_per_batch`'s default.
DEFAULT_MAX_TOKENS_PER_BATCH = 8192


def _drafter_entry(value: Any) -> Any:
    return {"type": value} if isinstance(value, str) else value


DrafterEntry = Annotated[DrafterSpec, BeforeValidator(_drafter_entry)]


@dataclass(frozen=True, config=SPEC_CONFIG)
class HiddenStatesConfig(SpecBase):
    """Hidden-state extraction: the model run, its shards, batching and disk budget."""

    label = "hidden_states"

    model: Str = "tiny-random"  # or a local transformers model directory
    family: Literal["deepseek_v3", "llama"] = "deepseek_v3"
    seed: Int = 0
    shard_size: Annotated[Int, Field(ge=1)] = 256
    # Decoder-layer outputs to capture: a list of ids, a count n (SpecForge's DFlash rule spreads n over the model),
    # or None (or empty): EAGLE-3's low/mid/high.
    aux_layers: tuple[Int, ...] | Annotated[Int, Field(ge=1)] | None = None
    max_tokens_per_batch: Annotated[Int, Field(ge=1)] = DEFAULT_MAX_TOKENS_PER_BATCH  # padded tokens per forward
    progress_every_s: Annotated[Float, Field(ge=0)] = 30.0  # a shard's progress reports (log line + observation)
    device: Str = "auto"
    disk_budget_gb: Annotated[Float, Field(ge=0)] | None = None
    # A finished shard extracted under other settings: refuse (naming what differs) or redo (old files kept aside).
    on_settings_change: Literal["refuse", "redo"] = "refuse"
    # Teacher-agreement audit: None = decide from provenance (no for tiny-random or simulated texts) / the audit's
    # default threshold (hidden_states.audit.DEFAULT_MIN_TOP1).
    texts_by_extraction_model: Bool | None = None
    teacher_min_top1: Annotated[Float, Field(ge=0, le=1)] | None = None
    # Where the states live: the project's shards, or a trainer's own files written by extraction (no copy).
    layout: LayoutName = SHARDS
    # Trainer layouts derived from the shards by trainer_exports: each is a full copy of the states (7.94 TB at Kimi
    # scale), so none unless listed.
    trainer_layouts: tuple[TrainerName, ...] = ()
    # fp8: the states as float8_e4m3fn with fp32 scales per token per layer (half the disk; hidden_states/store/fp8.py,
    # docs/hidden_states.md §15). With layout: shards or speculators, under every engine (vllm: quantized on the
    # client from the servers' bf16 files); every reader of the project dequantizes.
    quantize: Literal["none", "fp8"] = "none"
    # The drafter types the hand-off serves (docs/drafters.md), and a draft config (JSON) or trainer flag file the
    # `trainer_exports` check holds against the captured layers.
    # (the default is validated into DrafterSpec like the file's names)
    drafters: Annotated[tuple[DrafterEntry, ...], Field(validate_default=True)] = DEFAULT_DRAFTERS  # type: ignore[assignment]
    draft_config: ResolvedPath | None = None
    # in_process: the model loaded in the shard run; vllm: HTTP clients of vLLM extract_hidden_states servers;
    # torchrun: one tensor-parallel transformers world per shard (docs/hidden_states.md §10-13).
    engine: Literal["in_process", "vllm", "torchrun"] = "in_process"
    vllm: VLLMEngineConfig = VLLMEngineConfig()
    torchrun: TorchrunConfig = TorchrunConfig()

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        problems: list[Problem] = []
        if data.get("engine") == "vllm" and not field_value(data.get("vllm"), "endpoints"):
            problems.append((("vllm", "endpoints"), "required for engine 'vllm': base URLs of running servers"))
        return problems + _quantize_problems(data) + _drafters_problems(data)

    @_field_validator("model")
    @classmethod
    def _resolve_model(cls, value: str, info: ValidationInfo) -> str:
        return value if value == "tiny-random" else str(resolve_path(value, info))

    @_field_validator("aux_layers")
    @classmethod
    def _empty_is_default(cls, value: tuple[int, ...] | int | None) -> tuple[int, ...] | int | None:
        return value or None


def _quantize_problems(data: Mapping[str, Any]) -> list[Problem]:
    """A `quantize` mode where no reader of the stored files dequantizes (`LAYOUT_QUANTIZE`), each with its reason."""
    mode = data.get("quantize", "none")
    problems: list[Problem] = []
    layout = data.get("layout", SHARDS)
    if mode not in LAYOUT_QUANTIZE.get(layout, (mode,)):
        able = " or ".join(n for n, modes in LAYOUT_QUANTIZE.items() if mode in modes)
        problems.append(
            (
                ("quantize",),
                f"{mode} needs layout: {able} (the files those layouts write hold e4m3 states with their scales, and "
                f"their readers dequantize); {layout} has no {mode} reader",
            )
        )
    for name in data.get("trainer_layouts") or ():
        if mode not in LAYOUT_QUANTIZE.get(name, (mode,)):
            problems.append(
                (
                    ("trainer_layouts",),
                    f"{name} with quantize: {mode}: {name} has no {mode} reader, and a bf16 copy dequantized from the "
                    f"{mode} states would cost twice their bytes (at Kimi scale 7.94 TB beside 3.97 TB) for states "
                    f"already rounded; extract {name}'s states with quantize: none",
                )
            )
    return problems


def _drafters_problems(data: Mapping[str, Any]) -> list[Problem]:
    """`drafter_problems` over the raw or validated section: the drafters the captured layers and the exported
    trainers cannot serve."""
    entries = data.get("drafters", DEFAULT_DRAFTERS)
    if not isinstance(entries, (list, tuple)):
        return []
    aux = data.get("aux_layers")
    n_aux = aux if isinstance(aux, int) else len(aux) if isinstance(aux, (list, tuple)) and aux else 3
    layouts = data.get("trainer_layouts", ())
    layout = data.get("layout", SHARDS)
    trainers = sorted(set(layouts if isinstance(layouts, (list, tuple)) else ()) | ({layout} & set(TRAINERS)))
    model = data.get("model")
    return drafter_problems(
        [
            {"type": e, "layers": None, "trainers": None}
            if isinstance(e, str)
            else dataclasses.asdict(e)
            if isinstance(e, DrafterSpec)
            else e
            if isinstance(e, Mapping)
            else {}
            for e in entries
        ],
        n_aux=n_aux,
        trainers=trainers,
        layout=str(layout),
        num_layers=model_depth(str(model)) if isinstance(model, str) and model != "tiny-random" else None,
    )
