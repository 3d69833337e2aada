"""Shard runs of the vLLM and torchrun engines through the stage's one decision (`run.run_shard`), for tests that
drive an engine against a server double of a model in memory or a saved tiny checkpoint: the settings a user would
write, built from the few values each test varies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
from eagle_pipeline.hidden_states.engines.vllm.engine_vllm import EngineModel
from eagle_pipeline.hidden_states.engines.vllm.vllm_command import VLLMEngine
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LayoutTarget
from eagle_pipeline.hidden_states.run import run_shard
from eagle_pipeline.hidden_states.settings import HiddenStatesConfig, TorchrunConfig, VLLMEngineConfig
from eagle_pipeline.hidden_states.store.shards import ShardSummary


def _paths(merged: str | Path, out: str | Path, layout_target: LayoutTarget | None) -> tuple[str, ExtractionPaths]:
    layout = layout_target.name if layout_target is not None else "shards"
    exports = Path(layout_target.root).parent if layout_target is not None else Path(out).parent / "exports"
    if layout_target is not None and Path(layout_target.root).name != layout:
        raise ValueError(f"a layout's files go to <exports>/{layout}; got {layout_target.root}")
    return layout, ExtractionPaths(Path(merged), Path(out), exports)


def vllm_shard(
    merged: str | Path,
    *,
    shard_index: int = 0,
    shard_size: int,
    out_dir: str | Path,
    endpoints: Sequence[str],
    storage_path: str | Path,
    num_layers: int,
    aux_layers: Sequence[int] | int | None = None,
    hidden_size: int,
    model_description: dict[str, Any] | None = None,
    head_checkpoint: str | Path | None = None,
    concurrency: int = 8,
    timeout_s: float = 600.0,
    max_retries: int = 4,
    backoff_base_s: float = 2.0,
    on_mismatch: str = "refuse",
    too_long_rows: str = "refuse",
    log: Callable[[str], None] | None = None,
    progress: Any = None,
    layout_target: LayoutTarget | None = None,
    quantize: str | None = None,
    vocab_size: int = 256,
) -> ShardSummary:
    """One shard through `engine: vllm` against `endpoints` serving a model of `num_layers` layers and
    `hidden_size` (its identity `model_description`, default its shape; its head read from `head_checkpoint`).
    `quantize`: the setting, by default the layout target's (the shards': none)."""
    layout, paths = _paths(merged, out_dir, layout_target)
    if quantize is None:
        quantize = layout_target.quantize if layout_target is not None else "none"
    settings = HiddenStatesConfig(
        engine="vllm",
        shard_size=shard_size,
        aux_layers=tuple(aux_layers) if isinstance(aux_layers, Sequence) else aux_layers,
        on_settings_change=on_mismatch,  # type: ignore[arg-type]
        layout=layout,  # type: ignore[arg-type]
        quantize=quantize,  # type: ignore[arg-type]
        vllm=VLLMEngineConfig(
            endpoints=tuple(endpoints),
            storage_path=str(storage_path),
            concurrency=concurrency,
            timeout_s=timeout_s,
            max_retries=max_retries,
            too_long_rows=too_long_rows,  # type: ignore[arg-type]
        ),
    )
    description = {"num_layers": num_layers, "hidden_size": hidden_size, **(model_description or {})}
    model = EngineModel(
        description,
        Path(head_checkpoint) if head_checkpoint is not None else None,
        identity=dict(model_description or description),
    )
    engine = VLLMEngine(model, backoff_base_s=backoff_base_s)
    run = run_shard(settings, paths, shard_index, vocab_size=vocab_size, progress=progress, log=log, engine=engine)
    return run.summary


def torchrun_shard(
    model_dir: str | Path,
    merged: str | Path,
    *,
    shard_index: int = 0,
    shard_size: int,
    out_dir: str | Path,
    tp_size: int = 2,
    ep_size: int | None = None,
    aux_layers: Sequence[int] | int | None = None,
    max_tokens_per_batch: int | None = None,
    final_state: str | None = None,
    layout_target: LayoutTarget | None = None,
    on_mismatch: str = "refuse",
    device: str = "auto",
    log: Callable[[str], None] | None = None,
    vocab_size: int = 256,
) -> ShardSummary:
    """One shard through `engine: torchrun` over the checkpoint in `model_dir` (a `tp_size` world)."""
    layout, paths = _paths(merged, out_dir, layout_target)
    extra = {"max_tokens_per_batch": max_tokens_per_batch} if max_tokens_per_batch is not None else {}
    settings = HiddenStatesConfig(
        model=str(model_dir),
        engine="torchrun",
        shard_size=shard_size,
        aux_layers=tuple(aux_layers) if isinstance(aux_layers, Sequence) else aux_layers,
        on_settings_change=on_mismatch,  # type: ignore[arg-type]
        layout=layout,  # type: ignore[arg-type]
        device=device,
        torchrun=TorchrunConfig(tp_size=tp_size, ep_size=ep_size),
        **extra,
    )
    return run_shard(settings, paths, shard_index, vocab_size=vocab_size, final_state=final_state, log=log).summary
