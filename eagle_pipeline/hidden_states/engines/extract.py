"""Batched hidden-state extraction of one shard of the merged table."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import POST_NORM
from eagle_pipeline.hidden_states.engines.batching import padding_of, plan_batches
from eagle_pipeline.hidden_states.layouts.trainer_layouts import (
    LayoutTarget,
    SampleFilesWriter,
    without_states,
)
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
from eagle_pipeline.hidden_states.store.format import (
    StreamingSafetensorsWriter,
    shard_layout,
    shard_paths,
    state_dtype,
    tensor_key,
)
from eagle_pipeline.hidden_states.store.head import final_norm_eps, save_target_head_from_model
from eagle_pipeline.hidden_states.store.merged import MergedRows, count_rows, read_rows, shard_row_range
from eagle_pipeline.hidden_states.store.shard_index import (
    IDS_DTYPE,
    MASK_DTYPE,
    shard_header,
    shard_summary,
    write_shard_index,
)
from eagle_pipeline.hidden_states.store.shards import ShardSummary
from eagle_pipeline.shared.progress import ProgressCallback
from eagle_pipeline.shared.storage import atomic_path


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


@dataclass
class _Written:
    sha256: str
    size_bytes: int
    nonfinite: np.ndarray  # per row: NaN/Inf values among its real tokens
    seconds: float
    compute_seconds: float
    write_wait_seconds: float
    sample_files: list[dict[str, Any]] = field(default_factory=list)  # states written into a trainer's layout


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
    shard = _Shard(
        shard_index, rows, plan_batches(rows.lengths, max_tokens_per_batch), wanted, out_dtype, layout_target
    )
    dev = torch.device(device)
    _place_model(model, dev)
    meta = shard.header(target, model)
    st_path = shard_paths(out_dir, shard_index)[0]
    written = _write_states(
        target,
        rows,
        shard.batches,
        meta,
        st_path,
        dev=dev,
        out_dtype=out_dtype,
        post_norm=final_state == POST_NORM,
        progress=progress,
        layout_target=layout_target,
    )
    # Recorded after the shard is complete, so an aborted shard leaves nothing behind.
    _, head_sha = save_target_head_from_model(model, out_dir, json.loads(meta["model"]))
    return shard.write_index(out_dir, written, target, model, head_sha, json.loads(meta["model"]))


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


@dataclass(frozen=True)
class _Shard:
    """One shard to extract: its rows, their batches, and how its states are stored."""

    index: int
    rows: MergedRows
    batches: list[list[int]]
    fingerprint: ExtractionFingerprint  # its final state is the shard's
    out_dtype: torch.dtype
    layout_target: LayoutTarget | None

    def header(self, target: _Target, model: torch.nn.Module) -> dict[str, str]:
        """The shard file's safetensors header."""
        extra = {"final_norm_eps": repr(final_norm_eps(model))}
        if self.layout_target is not None:
            extra["layout"] = self.layout_target.name
        return shard_header(
            self.rows,
            shard_index=self.index,
            aux=target.aux,
            num_layers=len(target.layers),
            hidden_size=target.hidden,
            dtype=self.out_dtype,
            final_state=self.fingerprint.final_state,
            model=_model_description(model),
            fingerprint=self.fingerprint,
            extra=extra,
        )

    def write_index(
        self,
        out_dir: Path,
        written: _Written,
        target: _Target,
        model: torch.nn.Module,
        head_sha: str,
        description: dict[str, Any],
    ) -> ShardSummary:
        """The shard's summary and index (the 'done' marker), with the head's hash and a layout's files."""
        rows, st_path, idx_path = self.rows, *shard_paths(out_dir, self.index)
        summary = shard_summary(
            rows,
            shard_index=self.index,
            paths=(st_path, idx_path),
            sha256=written.sha256,
            size_bytes=written.size_bytes,
            dtype=self.out_dtype,
            final_state=self.fingerprint.final_state,
            fingerprint=self.fingerprint,
            seconds=written.seconds,
            compute_seconds=written.compute_seconds,
            write_wait_seconds=written.write_wait_seconds,
            batches=len(self.batches),
            padded_tokens=padding_of(rows.lengths, self.batches)[1],
            nonfinite_samples=int((written.nonfinite > 0).sum()),
        )
        index_extra: dict[str, Any] = {
            "final_state": self.fingerprint.final_state,
            "final_norm_eps": final_norm_eps(model),
            "target_head_sha256": head_sha,
        }
        if self.layout_target is not None:
            index_extra.update(
                layout=self.layout_target.name,
                layout_root=os.path.relpath(self.layout_target.root, out_dir),
                sample_files=written.sample_files,
            )
        write_shard_index(
            idx_path, rows, summary, written.nonfinite, hidden=target.hidden, model=description, extra=index_extra
        )
        return summary


def _shard_rows(merged_dir: str | Path, shard_index: int, shard_size: int, vocab: int) -> MergedRows:
    """The merged rows of the shard, checked for what would corrupt the file or the forward."""
    row_start, row_stop = shard_row_range(shard_index, shard_size, count_rows(merged_dir))
    rows = read_rows(merged_dir, row_start, row_stop)
    _check_rows(rows, vocab)
    return rows


def _tensor_layout(
    rows: MergedRows, order: Sequence[int], target: _Target, out_dtype: torch.dtype
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return shard_layout(
        rows.sample_ids,
        rows.lengths,
        list(order),
        n_aux=len(target.aux),
        hidden=target.hidden,
        state_dtype=out_dtype,
        ids_dtype=IDS_DTYPE,
        mask_dtype=MASK_DTYPE,
    )


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
    rows: MergedRows,
    batches: Sequence[Sequence[int]],
    meta: dict[str, str],
    st_path: Path,
    *,
    dev: torch.device,
    out_dtype: torch.dtype,
    post_norm: bool,
    progress: ProgressCallback | None,
    layout_target: LayoutTarget | None = None,
) -> _Written:
    """Run every batch and stream the safetensors file, a writer thread overlapping the disk with the next forward."""
    order = [i for b in batches for i in b]
    captured: dict[int, torch.Tensor] = {}
    hook_layers = set(target.aux) | (set() if post_norm else {len(target.layers) - 1})
    handles = [
        target.layers[k].register_forward_hook(lambda _m, _a, out, k=k: captured.__setitem__(k, _layer_output(out)))
        for k in sorted(hook_layers)
    ]
    nonfinite = np.zeros(len(rows), dtype=np.int64)
    t0 = time.perf_counter()
    compute_s = wait_s = 0.0
    lengths = rows.lengths
    done_rows, done_tokens, total_tokens = 0, 0, int(sum(lengths))
    try:
        with atomic_path(st_path) as tmp, open(tmp, "wb") as fh, ThreadPoolExecutor(max_workers=1) as pool:
            layout = _tensor_layout(rows, order, target, out_dtype)
            if layout_target is not None:  # the states go to the trainer's files; the shard keeps ids and masks
                layout = without_states(layout)
            writer: Any = StreamingSafetensorsWriter(fh, layout, meta)
            if layout_target is not None:
                masks = dict(zip(rows.sample_ids, rows.loss_mask))
                writer = SampleFilesWriter(writer, layout_target, st_path.parent, masks, len(target.aux))
            pending: list[Future[None]] = []
            for batch in batches:
                tb = time.perf_counter()
                aux_cpu, final_cpu, bad = _forward_batch(
                    target, rows, batch, captured, dev=dev, out_dtype=out_dtype, post_norm=post_norm
                )
                nonfinite[list(batch)] = bad
                tw = time.perf_counter()
                compute_s += tw - tb
                pending.append(pool.submit(_write_batch, writer, rows, batch, aux_cpu, final_cpu))
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
            for i in order:
                writer.write(tensor_key(rows.sample_ids[i], "loss_mask"), torch.from_numpy(rows.loss_mask[i]))
            sha = writer.finish()
    finally:
        for h in handles:
            h.remove()
    files = list(getattr(writer, "files", []))
    return _Written(sha, writer.total_bytes, nonfinite, time.perf_counter() - t0, compute_s, wait_s, files)


def _write_batch(
    writer: StreamingSafetensorsWriter | SampleFilesWriter,
    rows: MergedRows,
    batch: Sequence[int],
    aux_cpu: torch.Tensor,
    final_cpu: torch.Tensor,
) -> None:
    lengths = rows.lengths
    for r, i in enumerate(batch):
        t, sid = lengths[i], rows.sample_ids[i]
        writer.write(tensor_key(sid, "aux_hidden_states"), aux_cpu[r, :t])
        writer.write(tensor_key(sid, "final_hidden_state"), final_cpu[r, :t])
        writer.write(tensor_key(sid, "input_ids"), torch.from_numpy(rows.input_ids[i]))


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
