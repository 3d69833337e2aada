"""The hidden-state stage's core calls, one per step, for the Dagster assets, the CLI and scripts/gpu_check.py alike:
`plan_run` (the extraction plan, written to plan.json), `run_shard` (one shard through the configured engine) and
`export_for_trainers` (the trainer exports from finished shards, with their manifest).

The engines are a table (`ENGINES`: in_process, vllm, torchrun), each a `engine.ShardEngine`; which one runs, whether
a shard is already done, and the fingerprint it must carry are decided here, once, before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle_pipeline.drafter_types import PRE_NORM, SPECFORGE
from eagle_pipeline.hidden_states.engines.engine import EngineResult, ExtractionPaths, Log, ShardEngine, ShardJob
from eagle_pipeline.hidden_states.engines.engine_in_process import InProcessEngine, PreloadedModel
from eagle_pipeline.hidden_states.engines.engine_torchrun import TorchrunEngine
from eagle_pipeline.hidden_states.engines.runtime import fingerprint_for_config
from eagle_pipeline.hidden_states.engines.vllm.vllm_command import VLLMEngine
from eagle_pipeline.hidden_states.layouts.trainer_exports import EXPORT_MANIFEST, StatesExport, StatesExportSummary
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LAYOUTS, LayoutTarget, TrainerLayout
from eagle_pipeline.hidden_states.models.layers import get_backbone, token_embedding
from eagle_pipeline.hidden_states.models.model import TINY_RANDOM
from eagle_pipeline.hidden_states.plan.disk_plan import PLAN_FILE, check_disk_for_run, check_export_room, disk_inputs
from eagle_pipeline.hidden_states.plan.estimate import ExtractionPlan, Workload
from eagle_pipeline.hidden_states.plan.run_plan import plan_for_run
from eagle_pipeline.hidden_states.settings import DEFAULT_MAX_TOKENS_PER_BATCH, SHARDS
from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_NONE
from eagle_pipeline.hidden_states.store.shards import ShardSummary, prepare_shard, shard_state
from eagle_pipeline.shared.progress import ProgressCallback
from eagle_pipeline.shared.storage import write_json_atomic

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig
    from eagle_pipeline.merge.export import ExportSummary
    from eagle_pipeline.shared.storage import DataRoot

# `hidden_states.engine` -> the engine that runs it (docs/hidden_states.md §10-13).
ENGINES: dict[str, ShardEngine] = {
    "in_process": InProcessEngine(),
    "vllm": VLLMEngine(),
    "torchrun": TorchrunEngine(),
}
ALREADY_DONE = "none (already done)"


def plan_run(
    settings: HiddenStatesConfig,
    paths: ExtractionPaths,
    *,
    target_model_config: str | None,
    vocab_size: int,
    shard_runs: int = 1,
) -> dict[str, ExtractionPlan]:
    """The plans over the merged table ('target', 'this_run': `run_plan.plan_for_run`), with what is written item
    by item (`disk_plan.disk_inputs`; `shard_runs`: shard runs at once, the `gpu` pool's limit), written to
    `paths.out_dir/plan.json` for the shard runs' disk check (`disk_plan.check_disk_for_run`). Raises `run_plan.PlanRefused`
    when the engine cannot hold the weights (nothing is written then)."""
    from eagle_pipeline.merge.manifest import MergeManifest

    manifest = MergeManifest.read(paths.merged_dir)
    plans = plan_for_run(
        settings,
        Workload(manifest.tokens_total, manifest.rows_total),
        target_model_config=target_model_config,
        vocab_size=vocab_size,
        disk=disk_inputs(settings, paths, shard_runs=shard_runs),
    )
    write_json_atomic({k: p.to_dict() for k, p in plans.items()}, paths.out_dir / PLAN_FILE)
    return plans


@dataclass(frozen=True)
class ShardRun:
    """One shard run: the shard's summary (`skipped` when it was already done), where it ran, and the shard's
    state as found before the run (`shards.ShardState.status`: done, stale, partial, missing)."""

    summary: ShardSummary
    device: str
    status_before: str


def run_shard(
    settings: HiddenStatesConfig,
    paths: ExtractionPaths,
    shard: int,
    *,
    vocab_size: int,
    progress: ProgressCallback | None = None,
    log: Log | None = None,
    engine: ShardEngine | None = None,
    final_state: str | None = None,
    free_space: Callable[[Path], int] | None = None,
) -> ShardRun:
    """Shard `shard` of the merged table under `settings` (the `hidden_states` section), through the engine
    `settings.engine` names, or `engine` (a `ShardEngine`, e.g. `InProcessEngine(PreloadedModel(model))`).
    `final_state` ('pre_norm' / 'post_norm') overrides the convention the engine stores by default
    (`runtime.fingerprint_for_config`), e.g. to compare a torchrun shard byte for byte with an in-process one.

    The one decision of the stage, made before any model loads (sparing minutes of loading a large target just to
    skip a done shard): the engine's facts (`ShardEngine.facts`) and the settings give the wanted fingerprint; a
    done shard under it is reused; one extracted under other settings raises `shards.ShardMismatchError` or, with
    `on_settings_change: redo`, is moved aside and redone; a partial one is redone. Only a shard to extract checks
    the disk (`disk_plan.check_disk_for_run`, `free_space` its seam: against plan.json, which the Dagster asset requires and
    a script may not have written) and reaches the engine."""
    chosen = engine if engine is not None else ENGINES[settings.engine]
    facts = chosen.facts(settings, paths, shard, vocab_size)
    wanted = fingerprint_for_config(
        settings, merged_dir=paths.merged_dir, vocab_size=vocab_size, facts=facts, final_state=final_state
    )
    state = shard_state(paths.out_dir, shard, wanted)
    if state.status != "done" and (paths.out_dir / PLAN_FILE).exists():
        check_disk_for_run(settings, paths, free_space=free_space)
    decision = prepare_shard(paths.out_dir, shard, wanted, state, on_mismatch=settings.on_settings_change)
    if decision.reuse is not None:
        result = EngineResult(decision.reuse, ALREADY_DONE)
    else:
        result = chosen.extract(ShardJob(settings, paths, shard, vocab_size, wanted, facts, progress, log))
    return ShardRun(result.summary, result.device, decision.state.status)


def extract_shard(
    model: torch.nn.Module,
    merged_dir: str | Path,
    *,
    shard_index: int,
    shard_size: int,
    out_dir: str | Path,
    aux_layers: Sequence[int] | int | None = None,
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    final_state: str = PRE_NORM,
    on_mismatch: str = "refuse",
    progress: ProgressCallback | None = None,
    layout_target: LayoutTarget | None = None,
    quantize: str | None = None,
) -> ShardSummary:
    """The Python API for a model in memory: shard `shard_index` of the merged table through `run_shard` (the one
    decision: a done shard is returned `skipped`, one made under other settings refused or, with
    `on_mismatch='redo'`, moved aside and redone) with the in-process engine serving `model`
    (`PreloadedModel`: its own identity is the fingerprint's model; `dtype` the stored dtype, default the device's).
    `layout_target` (`trainer_layouts.plan_layout_target`): the states go into that
    trainer's files, under its root. `quantize` (`fp8.QUANTIZE_MODES`): how the states are stored, by default the
    layout target's (the shards': none). See `extract.extract_with_model` for what is written."""
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

    layout, stored = (layout_target.name, layout_target.quantize) if layout_target else (SHARDS, QUANTIZE_NONE)
    if quantize is None:
        quantize = stored
    elif layout_target is not None and quantize != stored:
        raise ValueError(f"quantize {quantize!r}, but the {layout} layout target stores {stored!r}")
    root = Path(layout_target.root) if layout_target else None
    settings = HiddenStatesConfig(
        shard_size=shard_size,
        aux_layers=tuple(aux_layers) if isinstance(aux_layers, Sequence) else aux_layers,
        max_tokens_per_batch=max_tokens_per_batch,
        device=device,
        on_settings_change=on_mismatch,  # type: ignore[arg-type]
        layout=layout,
        quantize=quantize,  # type: ignore[arg-type]
    )
    run = run_shard(
        settings,
        ExtractionPaths(Path(merged_dir), Path(out_dir), root.parent if root else Path(out_dir).parent / "exports"),
        shard_index,
        vocab_size=int(token_embedding(get_backbone(model)).num_embeddings),
        progress=progress,
        engine=InProcessEngine(PreloadedModel(model, dtype=dtype), layout_root=root),
        final_state=final_state,
    )
    return run.summary


@dataclass(frozen=True)
class TrainerExports:
    """What `export_for_trainers` wrote: the manifest (also at exports/manifest.json) and each export's summary."""

    manifest: dict[str, Any]
    exported: dict[str, StatesExportSummary]  # specforge_offline / speculators_offline: each layout written
    specforge_jsonl: ExportSummary
    hf_parquet: ExportSummary
    shard_keys: list[str]


def export_for_trainers(
    settings: HiddenStatesConfig, root: DataRoot, *, vocab_size: int, config_hash: str
) -> TrainerExports:
    """The trainer exports from the finished shards under `root`: SpecForge's JSONL, HF Parquet, and each state
    layout (`settings.trainer_layouts`, plus the one extraction wrote directly, `settings.layout`), with the
    draft vocabulary beside them when it was built; the manifest last.

    Every shard is checked first (`shards.require_shards_ready`, raising `ShardsNotReadyError`): a refused export
    leaves the previous one whole. The dtype is left open because this step may run on another host than the
    extraction (a CPU pod after GPU pods)."""
    from eagle_pipeline.audit.records import audit_stamps
    from eagle_pipeline.hidden_states.checks.stored_audits import summarize_audits
    from eagle_pipeline.hidden_states.store.shards import require_shards_ready
    from eagle_pipeline.merge import export_hf_parquet, export_specforge_jsonl
    from eagle_pipeline.merge.vocab import DRAFT_VOCAB_PT
    from eagle_pipeline.shared.storage import read_json

    out = root.exports_dir
    wanted = fingerprint_for_config(settings, merged_dir=root.merged_dir, vocab_size=vocab_size, pin_dtype=False)
    states = require_shards_ready(root.hidden_states_dir, root.merged_dir, wanted)
    shard_keys = [f"{s.shard_index:05d}" for s in states]
    spec = export_specforge_jsonl(root.merged_dir, out / SPECFORGE / "train.jsonl", split="train")
    hf = export_hf_parquet(root.merged_dir, out / "hf_parquet")
    # The layout extraction wrote directly is always completed (its small files); others are converted copies. In
    # the registry's order, which is the manifest's.
    chosen = {*settings.trainer_layouts, settings.layout}
    layouts = [o for n, o in LAYOUTS.items() if n in chosen and isinstance(o, TrainerLayout)]
    exported: dict[str, StatesExportSummary] = {}
    # Copied beside the states when built (the draft_vocab asset); the export's summary records where it is, or None.
    vocab_built = (root.draft_vocab_dir / DRAFT_VOCAB_PT).exists()
    for layout in layouts:
        check_export_room(root.hidden_states_dir, out / layout.name, layout.name)
        job = StatesExport(
            root.hidden_states_dir,
            root.merged_dir,
            out / layout.name,
            draft_vocab_dir=root.draft_vocab_dir if vocab_built else None,
            drafters=settings.drafters,
            extraction_layout=settings.layout,
            verifier=settings.model if settings.model != TINY_RANDOM else None,
        )
        exported[layout.export_format] = layout.export(job)
    manifest = {
        "specforge_jsonl": spec.to_dict(),
        "hf_parquet": hf.to_dict(),
        **{name: e.to_dict() for name, e in exported.items()},
        # The dataset audits behind the rows: check-drafter and the exports' check refuse the export once one of them
        # is no longer the current audit (audit.records.stale_audit_stamps).
        "dataset_audits": audit_stamps(root, read_json(root.merged_dir / "manifest.json")["upstream_versions"]),
        "hidden_state_audit": summarize_audits(root.hidden_states_dir, [s.shard_index for s in states]),
        "hidden_states_dir": str(root.hidden_states_dir),
        "hidden_state_shards": shard_keys,
        "draft_vocab_dir": str(root.draft_vocab_dir),
        "config_hash": config_hash,
    }
    write_json_atomic(manifest, out / EXPORT_MANIFEST)
    return TrainerExports(manifest, exported, spec, hf, shard_keys)
