"""The in_process engine: the model loaded in the shard run's own process (`extract.extract_shard`), on a GPU this
run leases (`runtime.shard_device`), from the per-process model cache; the one engine that can write a trainer's
layout directly (`hidden_states.layout`)."""

from __future__ import annotations

from typing import Protocol

import torch

from .engine import EngineResult, ShardJob
from .extract import extract_shard
from .runtime import MODEL_CACHE, shard_device
from .trainer_layouts import plan_layout_target


class ModelSource(Protocol):
    """Where the engine gets its model: `runtime.MODEL_CACHE` (loaded once per process), or one already built."""

    def get(self, model: str, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module: ...

    def devices(self) -> list[str]: ...


class PreloadedModel:
    """A model already in memory (scripts/gpu_check.py: random weights of a realistic shape, never saved), served
    whatever the settings name; the settings' `model` still names the checkpoint the fingerprint identifies."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def get(self, model: str, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module:
        return self.model

    def devices(self) -> list[str]:
        """The device the model is on, so that a GPU lease picks that one (`runtime.shard_device`)."""
        return [str(next(self.model.parameters()).device)]


class InProcessEngine:
    """`hidden_states.engine: in_process` (the `ShardEngine` interface)."""

    def __init__(self, models: ModelSource = MODEL_CACHE):
        self.models = models

    def extract(self, job: ShardJob) -> EngineResult:
        h, paths = job.settings, job.paths
        # A trainer's layout: the states go straight into its export folder, in its final-state convention.
        target = plan_layout_target(h.layout, paths.exports_dir / h.layout, paths.merged_dir, quantize=h.quantize)
        with shard_device(h.device, job.shard, prefer=self.models.devices(), log=job.log) as device:
            summary = extract_shard(
                self.models.get(h.model, h.family, h.seed, job.vocab_size, device),
                paths.merged_dir,
                shard_index=job.shard,
                shard_size=h.shard_size,
                out_dir=paths.out_dir,
                aux_layers=h.aux_layers,
                max_tokens_per_batch=h.max_tokens_per_batch,
                device=device,
                on_mismatch=h.on_settings_change,
                model_identity=job.wanted.model,
                progress=job.progress,
                final_state=job.wanted.final_state,
                layout_target=target,
            )
        return EngineResult(summary, device)
