"""Batched hidden-state extraction of one shard of the merged table."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import POST_NORM
from eagle_pipeline.hidden_states.engines.batching import padding_of, plan_batches
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LayoutTarget, SampleFilesWriter
from eagle_pipeline.hidden_states.models.layers import (
    _layer_output,
    decoder_layers,
    get_backbone,
    resolve_aux_layers,
    token_embedding,
)
from eagle_pipeline.hidden_states.models.model import describe_model_config
from eagle_pipeline.hidden_states.settings import DEFAULT_MAX_TOKENS_PER_BATCH
from eagle_pipeline.hidden_states.store.fingerprint import FINAL_STATES, ExtractionFingerprint
from eagle_pipeline.hidden_states.store.format import state_dtype
from eagle_pipeline.hidden_states.store.head import final_norm_eps, save_target_head_from_model
from eagle_pipeline.hidden_states.store.merged import MergedRows, count_rows, read_rows, shard_row_range
from eagle_pipeline.hidden_states.store.shard_writer import ShardFacts, ShardRun, ShardWriter
from eagle_pipeline.hidden_states.store.shards import ShardSummary
from eagle_pipeline.shared.progress import ProgressCallback


def default_state_dtype(device: str) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU: the stored dtype when none is given, and the dtype models are loaded in."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _model_description(model: torch.nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    try:
        return describe_model_config(cfg)
    except Exception:  # an unknown architecture still extracts; it just isn't described
        return {"model_type": str(getattr(cfg, "model_type", "unknown"))}


@dataclass(frozen=True)
class _Target:
    """The parts of the model that extraction touches, resolved once."""

    backbone: torch.nn.Module
    layers: torch.nn.ModuleList
    aux: tuple[int, ...]
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module, aux_layers: Sequence[int] | int | None) -> _Target:
        backbone = get_backbone(model)
        layers = decoder_layers(backbone)
        embed = token_embedding(backbone)
        n = len(layers)
        aux = resolve_aux_layers(aux_layers, n)
        return cls(backbone, layers, aux, int(embed.embedding_dim), int(embed.num_embeddings))


def extract_with_model(
    model: torch.nn.Module,
    merged_dir: str | Path,
    wanted: ExtractionFingerprint,
    *,
    shard_index: int,
    out_dir: str | Path,
    device: str = "cpu",
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    progress: ProgressCallback | None = None,
    layout_target: LayoutTarget | None = None,
) -> ShardSummary:
    """Extract the aux-layer and final hidden states of shard `shard_index` of the merged table with `model` into
    `out_dir/shard-NNNNN.safetensors` + `.index.parquet`, as `wanted` says (its aux layers, final state, shard
    size and dtype; it is recorded with the shard). The in-process and torchrun engines' writer: whether the shard
    is to be extracted at all was decided before (`run.run_shard`); this overwrites what is there.

    Samples with NaN/Inf are written as they are and counted (index column `n_nonfinite`, `n_nonfinite_samples`),
    never dropped. The final state is 'pre_norm' (the project's canonical convention: the last decoder layer's
    output, as vLLM gives it; the target's final norm and lm_head are recorded beside the shards,
    `head.TARGET_HEAD_FILE`, so the post-norm state is always derivable) or 'post_norm' (after the final RMSNorm,
    what the lm_head consumes). An exception from `progress(rows_done, rows_total, tokens_done, tokens_total)`
    aborts cleanly: atomic_path removes the temporary file. `layout_target` (`trainer_layouts.plan_layout_target`):
    each sample's states go straight into a trainer's layout instead of the shard file, which then keeps only ids
    and masks (no second copy of the states).
    """
    final_state = wanted.final_state
    _check_final_state(final_state, layout_target)
    out_dir = Path(out_dir)
    target = _Target.of(model, wanted.aux_layers)
    if target.aux != tuple(wanted.aux_layers):
        raise ValueError(f"aux layers {list(wanted.aux_layers)} are not the model's ({list(target.aux)})")
    out_dtype = state_dtype(wanted.dtype) if wanted.dtype is not None else default_state_dtype(device)
    rows = _shard_rows(merged_dir, shard_index, wanted.shard_size, target.vocab)
    batches = plan_batches(rows.lengths, max_tokens_per_batch)
    dev = torch.device(device)
    _place_model(model, dev)
    facts = ShardFacts(
        index=shard_index,
        rows=rows,
        fingerprint=wanted,
        num_layers=len(target.layers),
        hidden_size=target.hidden,
        dtype=out_dtype,
        model=_model_description(model),
        final_norm_eps=final_norm_eps(model),
        layout=layout_target.name if layout_target is not None else None,
        layout_root=layout_target.root if layout_target is not None else None,
    )
    with ShardWriter(out_dir, shard_index) as shard:
        shard.begin(facts, [i for b in batches for i in b])
        run = _write_states(
            target,
            shard,
            batches,
            dev=dev,
            out_dtype=out_dtype,
            post_norm=final_state == POST_NORM,
            progress=progress,
            layout_target=layout_target,
        )
    # Recorded after the shard is complete, so an aborted shard leaves nothing behind.
    # The model as the header records it (JSON, keys sorted): the head's `source` is that record.
    _, run.head_sha256 = save_target_head_from_model(model, out_dir, json.loads(facts.header()["model"]))
    return shard.write_index(run)


def _place_model(model: torch.nn.Module, dev: torch.device) -> None:
    """Puts the model on the leased device: the whole device, index included, so a model preloaded on one GPU of the
    host and leased another is moved, not left where the forward cannot reach its inputs."""
    if next(model.parameters()).device != dev:
        model.to(dev)


def _check_final_state(final_state: str, layout_target: LayoutTarget | None) -> None:
    if final_state not in FINAL_STATES:
        raise ValueError(f"final_state must be one of {FINAL_STATES}, got {final_state!r}")
    if layout_target is not None and final_state != layout_target.layout.final_state:
        raise ValueError(
            f"the {layout_target.name} layout holds the final state {layout_target.layout.final_state}; "
            f"got final_state={final_state!r}"
        )


def _shard_rows(merged_dir: str | Path, shard_index: int, shard_size: int, vocab: int) -> MergedRows:
    """The merged rows of the shard, checked for what would corrupt the file or the forward."""
    row_start, row_stop = shard_row_range(shard_index, shard_size, count_rows(merged_dir))
    rows = read_rows(merged_dir, row_start, row_stop)
    _check_rows(rows, vocab)
    return rows


def _forward_batch(
    target: _Target,
    rows: MergedRows,
    batch: Sequence[int],
    captured: dict[int, torch.Tensor],
    *,
    dev: torch.device,
    out_dtype: torch.dtype,
    post_norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(aux [B, W, n_aux*H], final [B, W, H]) on the CPU and the NaN/Inf count per row over its real tokens."""
    lengths = rows.lengths
    width = max(lengths[i] for i in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    real = torch.zeros((len(batch), width), dtype=torch.long)
    for r, i in enumerate(batch):
        ids[r, : lengths[i]] = torch.from_numpy(rows.input_ids[i].astype(np.int64))
        real[r, : lengths[i]] = 1
    ids, real = ids.to(dev), real.to(dev)
    last = len(target.layers) - 1
    captured.clear()
    with torch.inference_mode():
        # No attention_mask on purpose: with right padding in a causal model a real token never sees a pad, and
        # mask-free SDPA can take the is_causal (flash) path. Pad outputs are dropped when written.
        out = target.backbone(input_ids=ids, use_cache=False)
        final = (out.last_hidden_state if post_norm else captured[last]).to(out_dtype)
        aux_cat = torch.cat([captured[k] for k in target.aux], dim=-1).to(out_dtype)
        bad = (~torch.isfinite(aux_cat)).sum(-1) + (~torch.isfinite(final)).sum(-1)
        bad_rows = (bad * real).sum(-1).cpu().numpy()
        aux_cpu, final_cpu = aux_cat.cpu(), final.cpu()
    captured.clear()
    return aux_cpu, final_cpu, bad_rows


def _write_states(
    target: _Target,
    shard: ShardWriter,
    batches: Sequence[Sequence[int]],
    *,
    dev: torch.device,
    out_dtype: torch.dtype,
    post_norm: bool,
    progress: ProgressCallback | None,
    layout_target: LayoutTarget | None = None,
) -> ShardRun:
    """Run every batch and hand its rows to `shard` (or their states to `layout_target`'s files), a writer thread
    overlapping the disk with the next forward."""
    assert shard.facts is not None
    rows = shard.facts.rows
    captured: dict[int, torch.Tensor] = {}
    hook_layers = set(target.aux) | (set() if post_norm else {len(target.layers) - 1})
    handles = [
        target.layers[k].register_forward_hook(lambda _m, _a, out, k=k: captured.__setitem__(k, _layer_output(out)))
        for k in sorted(hook_layers)
    ]
    files = None
    if layout_target is not None:  # the states go to the trainer's files; the shard keeps ids and masks
        masks = dict(zip(rows.sample_ids, rows.loss_mask))
        files = SampleFilesWriter(layout_target, shard.out_dir, masks, len(target.aux))
    nonfinite = np.zeros(len(rows), dtype=np.int64)
    t0 = time.perf_counter()
    compute_s = wait_s = 0.0
    lengths = rows.lengths
    done_rows, done_tokens, total_tokens = 0, 0, int(sum(lengths))
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: list[Future[None]] = []
            for batch in batches:
                tb = time.perf_counter()
                aux_cpu, final_cpu, bad = _forward_batch(
                    target, rows, batch, captured, dev=dev, out_dtype=out_dtype, post_norm=post_norm
                )
                nonfinite[list(batch)] = bad
                tw = time.perf_counter()
                compute_s += tw - tb
                pending.append(pool.submit(_write_batch, shard, files, batch, aux_cpu, final_cpu))
                # Back-pressure: at most two batches in host memory waiting for the disk.
                while len(pending) > 1:
                    pending.pop(0).result()
                wait_s += time.perf_counter() - tw
                done_rows += len(batch)
                done_tokens += int(sum(lengths[i] for i in batch))
                if progress is not None:
                    progress(done_rows, len(rows), done_tokens, total_tokens)
            tw = time.perf_counter()
            for f in pending:
                f.result()
            wait_s += time.perf_counter() - tw
    finally:
        for h in handles:
            h.remove()
    return ShardRun(
        seconds=time.perf_counter() - t0,
        compute_seconds=compute_s,
        write_wait_seconds=wait_s,
        batches=len(batches),
        nonfinite=nonfinite,
        padded_tokens=padding_of(lengths, batches)[1],
        sample_files=files.files if files is not None else [],
    )


def _write_batch(
    shard: ShardWriter,
    files: SampleFilesWriter | None,
    batch: Sequence[int],
    aux_cpu: torch.Tensor,
    final_cpu: torch.Tensor,
) -> None:
    assert shard.facts is not None
    rows = shard.facts.rows
    for r, i in enumerate(batch):
        t = rows.lengths[i]
        aux, final = aux_cpu[r, :t], final_cpu[r, :t]
        if files is None:
            shard.write_sample(i, aux, final)
            continue
        ids = torch.from_numpy(rows.input_ids[i])
        files.write_sample(
            rows.sample_ids[i], {"aux_hidden_states": aux, "final_hidden_state": final, "input_ids": ids}
        )
        shard.write_sample(i)


def _check_rows(rows: MergedRows, vocab: int) -> None:
    seen: set[str] = set()
    for i, (sid, ids) in enumerate(zip(rows.sample_ids, rows.input_ids)):
        where = f"merged row {rows.row_start + i} ({sid})"
        if sid in seen:
            raise ValueError(f"{where}: duplicate sample_id in shard; keys would collide")
        seen.add(sid)
        if len(ids) == 0:
            raise ValueError(f"{where}: zero tokens")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"{where}: token id outside the model's vocabulary [0, {vocab})")
