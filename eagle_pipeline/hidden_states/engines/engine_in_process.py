"""The in_process engine: the model loaded in the shard run's own process (`extract.extract_with_model`), on a GPU
this run leases (`runtime.shard_device`), from the per-process model cache or one already in memory; the one engine
that can write a trainer's layout directly (`hidden_states.layout`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from eagle_pipeline.hidden_states.engines.engine import EngineResult, ExtractionPaths, RunFacts, ShardJob
from eagle_pipeline.hidden_states.engines.extract import extract_with_model
from eagle_pipeline.hidden_states.engines.runtime import MODEL_CACHE, shard_device
from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
from eagle_pipeline.hidden_states.models.layers import decoder_layers, get_backbone
from eagle_pipeline.hidden_states.store.fingerprint import model_identity
from eagle_pipeline.hidden_states.store.format import dtype_name

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig


class ModelSource(Protocol):
    """Where the engine gets its model: `runtime.MODEL_CACHE` (loaded once per process), or one already built."""

    def get(self, model: str, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module: ...

    def devices(self) -> list[str]: ...

    def facts(self) -> RunFacts: ...


class PreloadedModel:
    """A model already in memory (scripts/gpu_check.py: random weights of a realistic shape, never saved; the Python
    API's `run.extract_shard`), served whatever the settings name. Its own identity, layer count and, when given,
    the stored `dtype` are the run's facts, so its shards are fingerprinted as what it is."""

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype | None = None):
        self.model = model
        self.dtype = dtype

    def get(self, model: str, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module:
        return self.model

    def devices(self) -> list[str]:
        """The device the model is on, so that a GPU lease picks that one (`runtime.shard_device`)."""
        return [str(next(self.model.parameters()).device)]

    def facts(self) -> RunFacts:
        return RunFacts(
            model_identity=model_identity(self.model),
            num_layers=len(decoder_layers(get_backbone(self.model))),
            dtype=dtype_name(self.dtype) if self.dtype is not None else None,
        )


class InProcessEngine:
    """`hidden_states.engine: in_process` (the `ShardEngine` interface). `layout_root`: where a trainer layout's
    files go when not `<exports>/<layout>` (the Python API's `layout_target`)."""

    def __init__(self, models: ModelSource = MODEL_CACHE, *, layout_root: Path | None = None):
        self.models = models
        self.layout_root = layout_root

    def facts(self, settings: HiddenStatesConfig, paths: ExtractionPaths, shard: int, vocab_size: int) -> RunFacts:
        return self.models.facts()

    def extract(self, job: ShardJob) -> EngineResult:
        h, paths = job.settings, job.paths
        # A trainer's layout: the states go straight into its export folder, in its final-state convention.
        root = self.layout_root or paths.exports_dir / h.layout
        target = plan_layout_target(h.layout, root, paths.merged_dir, quantize=h.quantize)
        with shard_device(h.device, job.shard, prefer=self.models.devices(), log=job.log) as device:
            summary = extract_with_model(
                self.models.get(h.model, h.family, h.seed, job.vocab_size, device),
                paths.merged_dir,
                job.wanted,
                shard_index=job.shard,
                out_dir=paths.out_dir,
                device=device,
                max_tokens_per_batch=h.max_tokens_per_batch,
                progress=job.progress,
                layout_target=target,
            )
        return EngineResult(summary, device)
