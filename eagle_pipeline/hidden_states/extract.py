"""Batched hidden-state extraction of one shard of the merged table."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..storage import atomic_path
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    TENSOR_NAMES,
    StreamingSafetensorsWriter,
    dtype_name,
    read_index_meta,
    remove_shard,
    shard_paths,
    shard_status,
    tensor_key,
    write_index,
)
from .layers import _layer_output, aux_layer_to_hf_index, default_aux_layers, get_backbone, validate_aux_layers
from .merged import count_rows, read_rows, shard_row_range
from .model import describe_model_config

IDS_DTYPE = torch.int32
MASK_DTYPE = torch.int8
FINAL_STATES = ("post_norm", "pre_norm")


@dataclass
class ShardSummary:
    shard_index: int
    row_start: int
    row_stop: int
    rows: int
    tokens: int
    padded_tokens: int
    padding_fraction: float
    batches: int
    seconds: float
    tokens_per_s: float
    path: str
    index_path: str
    sha256: str
    size_bytes: int
    dtype: str
    aux_layers: list[int]
    final_state_is_post_norm: bool
    n_nonfinite_samples: int
    compute_seconds: float = 0.0  # forward + device-to-host copy (the GPU-bound part)
    write_wait_seconds: float = 0.0  # time the forward loop stalled on the disk writer
    skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_batches(lengths: Sequence[int], max_tokens_per_batch: int, *, sort: bool = True) -> list[list[int]]:
    """Group row positions into batches whose padded size (rows x longest row) stays within the budget.

    Sorted longest-first so similar lengths share a batch (little padding) and an out-of-memory batch, if any,
    comes first rather than hours in. A row longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort else list(range(len(lengths)))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > max_tokens_per_batch:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def padding_of(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(real tokens, padding tokens) of running `batches` right-padded to each batch's longest row."""
    real = sum(lengths)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches) - real
    return real, padded


def _resolve_dtype(dtype: torch.dtype | None, device: str) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _model_description(model: torch.nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    try:
        return describe_model_config(cfg)
    except Exception:  # an unknown architecture still extracts; it just isn't described
        return {"model_type": str(getattr(cfg, "model_type", "unknown"))}


def extract_shard(
    model: torch.nn.Module,
    merged_dir: str | Path,
    *,
    shard_index: int,
    shard_size: int,
    out_dir: str | Path,
    aux_layers: Sequence[int] | None = None,
    max_tokens_per_batch: int = 8192,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    final_state: str = "post_norm",
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ShardSummary:
    """Extract aux-layer and final hidden states for global rows of shard `shard_index` into
    `out_dir/shard-NNNNN.safetensors` + `.index.parquet`.

    A done shard is skipped (unless `force`); a partial one is deleted and redone. Samples with NaN/Inf are
    written as they are and counted (index column `n_nonfinite`, `n_nonfinite_samples`), never dropped.
    `final_state`: 'post_norm' (after the final RMSNorm, what the lm_head consumes; SpecForge/EAGLE/
    Model-Optimizer HF convention) or 'pre_norm' (output of the last decoder layer; vLLM/speculators).
    An exception from `progress(rows_done, rows_total)` aborts cleanly: atomic_path removes the temporary file.
    """
    if final_state not in FINAL_STATES:
        raise ValueError(f"final_state must be one of {FINAL_STATES}, got {final_state!r}")
    out_dir = Path(out_dir)
    st_path, idx_path = shard_paths(out_dir, shard_index)
    n_rows = count_rows(merged_dir)
    row_start, row_stop = shard_row_range(shard_index, shard_size, n_rows)

    status = shard_status(out_dir, shard_index)
    if status == "done" and not force:
        summary = dict(read_index_meta(idx_path)["summary"])
        summary["skipped"] = True
        return ShardSummary(**summary)
    remove_shard(out_dir, shard_index)

    backbone = get_backbone(model)
    layers = backbone.layers
    n_layers = len(layers)
    aux = validate_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(n_layers), n_layers)
    out_dtype = _resolve_dtype(dtype, device)
    hidden = int(backbone.embed_tokens.embedding_dim)
    vocab = int(backbone.embed_tokens.num_embeddings)

    rows = read_rows(merged_dir, row_start, row_stop)
    lengths = rows.lengths
    _check_rows(rows, vocab)
    batches = plan_batches(lengths, max_tokens_per_batch)
    real, padded = padding_of(lengths, batches)

    dev = torch.device(device)
    if next(model.parameters()).device.type != dev.type:
        model.to(dev)

    post_norm = final_state == "post_norm"
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "aux_layers": json.dumps(list(aux)),
        "aux_layers_convention": "0-based decoder-layer outputs",
        "hf_hidden_states_indices": json.dumps([aux_layer_to_hf_index(x) for x in aux]),
        "final_state_is_post_norm": json.dumps(post_norm),
        "hidden_size": str(hidden),
        "dtype": dtype_name(out_dtype),
        "ids_dtype": dtype_name(IDS_DTYPE),
        "mask_dtype": dtype_name(MASK_DTYPE),
        "shard_index": str(shard_index),
        "row_start": str(row_start),
        "row_stop": str(row_stop),
        "rows": str(len(rows)),
        "tokens": str(real),
        "model": json.dumps(_model_description(model), sort_keys=True),
        "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
    }
    # File layout: samples in processing order (aux, final, ids each), then every loss mask. Keeps 4-byte
    # tensors ahead of the 1-byte masks so all offsets stay aligned, and makes the file strictly sequential.
    order = [i for b in batches for i in b]
    n_aux = len(aux)
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for i in order:
        sid, t = rows.sample_ids[i], lengths[i]
        layout += [
            (tensor_key(sid, "aux_hidden_states"), out_dtype, (t, n_aux * hidden)),
            (tensor_key(sid, "final_hidden_state"), out_dtype, (t, hidden)),
            (tensor_key(sid, "input_ids"), IDS_DTYPE, (t,)),
        ]
    layout += [(tensor_key(rows.sample_ids[i], "loss_mask"), MASK_DTYPE, (lengths[i],)) for i in order]

    captured: dict[int, torch.Tensor] = {}
    hook_layers = set(aux) | (set() if post_norm else {n_layers - 1})
    handles = [
        layers[k].register_forward_hook(lambda _m, _a, out, k=k: captured.__setitem__(k, _layer_output(out)))
        for k in sorted(hook_layers)
    ]
    nonfinite = np.zeros(len(rows), dtype=np.int64)
    t0 = time.perf_counter()
    compute_s = wait_s = 0.0
    done_rows = 0
    try:
        with atomic_path(st_path) as tmp, open(tmp, "wb") as fh, ThreadPoolExecutor(max_workers=1) as pool:
            writer = StreamingSafetensorsWriter(fh, layout, meta)
            pending: list[Future] = []
            for batch in batches:
                tb = time.perf_counter()
                width = max(lengths[i] for i in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                attn = torch.zeros((len(batch), width), dtype=torch.long)
                for r, i in enumerate(batch):
                    ids[r, : lengths[i]] = torch.from_numpy(rows.input_ids[i].astype(np.int64))
                    attn[r, : lengths[i]] = 1
                ids, attn = ids.to(dev), attn.to(dev)
                captured.clear()
                with torch.inference_mode():
                    # No attention_mask on purpose: with right padding in a causal model a real token never sees
                    # a pad, and mask-free SDPA can take the is_causal (flash) path. Pad outputs are dropped below.
                    out = backbone(input_ids=ids, use_cache=False)
                    final = (out.last_hidden_state if post_norm else captured[n_layers - 1]).to(out_dtype)
                    aux_cat = torch.cat([captured[k] for k in aux], dim=-1).to(out_dtype)
                    bad = (~torch.isfinite(aux_cat)).sum(-1) + (~torch.isfinite(final)).sum(-1)
                    bad = (bad * attn).sum(-1).cpu().numpy()
                    aux_cpu, final_cpu = aux_cat.cpu(), final.cpu()
                captured.clear()
                del out, aux_cat, final
                for r, i in enumerate(batch):
                    nonfinite[i] = int(bad[r])
                tw = time.perf_counter()
                compute_s += tw - tb
                pending.append(pool.submit(_write_batch, writer, rows, batch, lengths, aux_cpu, final_cpu))
                # Back-pressure: at most two batches in host memory waiting for the disk.
                while len(pending) > 1:
                    pending.pop(0).result()
                wait_s += time.perf_counter() - tw
                done_rows += len(batch)
                if progress is not None:
                    progress(done_rows, len(rows))
            tw = time.perf_counter()
            for f in pending:
                f.result()
            wait_s += time.perf_counter() - tw
            for i in order:
                writer.write(tensor_key(rows.sample_ids[i], "loss_mask"), torch.from_numpy(rows.loss_mask[i]))
            sha = writer.finish()
            size = writer.total_bytes
    finally:
        for h in handles:
            h.remove()
    seconds = time.perf_counter() - t0

    summary = ShardSummary(
        shard_index=shard_index,
        row_start=row_start,
        row_stop=row_stop,
        rows=len(rows),
        tokens=real,
        padded_tokens=padded,
        padding_fraction=padded / max(real + padded, 1),
        batches=len(batches),
        seconds=seconds,
        tokens_per_s=real / seconds if seconds > 0 else float("inf"),
        path=str(st_path),
        index_path=str(idx_path),
        sha256=sha,
        size_bytes=size,
        dtype=dtype_name(out_dtype),
        aux_layers=list(aux),
        final_state_is_post_norm=post_norm,
        n_nonfinite_samples=int((nonfinite > 0).sum()),
        compute_seconds=compute_s,
        write_wait_seconds=wait_s,
    )
    index_meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "safetensors_file": st_path.name,
        "sha256": sha,
        "size_bytes": size,
        "shard_index": shard_index,
        "row_start": row_start,
        "row_stop": row_stop,
        "aux_layers": list(aux),
        "hidden_size": hidden,
        "dtype": dtype_name(out_dtype),
        "final_state_is_post_norm": post_norm,
        "model": json.loads(meta["model"]),
        "summary": summary.to_dict(),
    }
    write_index(
        idx_path,
        {
            "sample_id": rows.sample_ids,
            "dataset": rows.datasets,
            "row_index": [row_start + i for i in range(len(rows))],
            "n_tokens": lengths,
            "n_supervised": [int((m != 0).sum()) for m in rows.loss_mask],
            "n_nonfinite": nonfinite.tolist(),
            "keys": [[tensor_key(sid, k) for k in TENSOR_NAMES] for sid in rows.sample_ids],
        },
        index_meta,
    )
    return summary


def _write_batch(writer, rows, batch, lengths, aux_cpu: torch.Tensor, final_cpu: torch.Tensor) -> None:
    for r, i in enumerate(batch):
        t, sid = lengths[i], rows.sample_ids[i]
        writer.write(tensor_key(sid, "aux_hidden_states"), aux_cpu[r, :t])
        writer.write(tensor_key(sid, "final_hidden_state"), final_cpu[r, :t])
        writer.write(tensor_key(sid, "input_ids"), torch.from_numpy(rows.input_ids[i]))


def _check_rows(rows, vocab: int) -> None:
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


def _transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:
        return "unknown"
